"""mRoPE position ids kept per sample: a sample's positions are a pure function of its own tokens and grid.

Why: transformers' `get_rope_index` walks every row in Python, with tensor ops per text run and per temporal
group (~4 ms a micro-batch of 8 in the demo, CPU, every forward), though a sample's positions never change.

Why it is exact: for each row, `get_rope_index` keeps the attended tokens (attention_mask), numbers them from 0
(text runs counting on, each temporal group (t, h, w) from where the text stopped) and leaves padding at 0; no row
reads another row. So a row is the sample's own positions, computed alone, scattered into its attended slots: the
same integers. One video per sample, in row order (what train.data.collate gives). The first micro-batch of
each layout (its row count, padded or not) is checked against the model's own call (`PositionCache.checked`), so
a family that numbers differently fails loudly, also where only padded or larger batches differ (a run whose first
micro-batch has one row or no padding would otherwise never check the masked path).
"""
from __future__ import annotations

import torch

from train.vision import inner_model


def sample_positions(model, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor,
                     video_grid_thw: torch.Tensor) -> torch.Tensor:
    """(3, n) mRoPE positions of one unpadded sample: input_ids and mm_token_type_ids (n,), its video's grid (1, 3)."""
    positions, _ = inner_model(model).get_rope_index(input_ids[None], mm_token_type_ids[None],
                                                     video_grid_thw=video_grid_thw)
    return positions[:, 0]


class PositionCache:
    """Positions per sample id; `batch_positions` assembles a padded micro-batch's (3, B, L) from them."""

    def __init__(self):
        self._rows: dict[str, torch.Tensor] = {}
        self.checked: set[tuple[int, bool]] = set()  # layouts (rows, padded) matched against get_rope_index

    def batch_positions(self, model, batch: dict[str, torch.Tensor], sample_ids: list[str]) -> torch.Tensor:
        """What `get_rope_index(input_ids, mm_token_type_ids, video_grid_thw=..., attention_mask=...)` returns for
        this micro-batch (one video per row), from the rows kept per sample id (computed on first sight)."""
        ids, types, grids = batch["input_ids"], batch["mm_token_type_ids"], batch["video_grid_thw"]
        mask = batch.get("attention_mask")
        if len(sample_ids) != ids.shape[0] or grids.shape[0] != ids.shape[0]:
            raise ValueError(f"positions per sample: {ids.shape[0]} rows, {grids.shape[0]} videos, "
                             f"{len(sample_ids)} sample ids (one of each per row)")
        out = torch.zeros((3, *ids.shape), dtype=ids.dtype, device=ids.device)
        for b, sid in enumerate(sample_ids):
            keep = mask[b].bool() if mask is not None else torch.ones_like(ids[b], dtype=torch.bool)
            row = self._rows.get(sid)
            if row is None:
                row = self._rows[sid] = sample_positions(model, ids[b][keep], types[b][keep], grids[b:b + 1])
            elif row.shape[1] != int(keep.sum()):
                raise RuntimeError(f"positions: sample {sid} came with {int(keep.sum())} tokens, kept with "
                                   f"{row.shape[1]}")
            out[:, b, keep] = row
        layout = (ids.shape[0], mask is not None and not bool(mask.all()))
        if layout not in self.checked:
            own, _ = inner_model(model).get_rope_index(ids, types, video_grid_thw=grids, attention_mask=mask)
            if not torch.equal(own, out):
                raise RuntimeError(f"positions kept per sample differ from the model's own get_rope_index over the "
                                   f"micro-batch of {sample_ids} ({layout[0]} rows, padded: {layout[1]}): this "
                                   f"family numbers rows differently than train/positions.py assumes")
            self.checked.add(layout)
        return out
