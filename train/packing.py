"""Sequence packing: a micro-batch's samples back to back in one row, trained as if each were alone.

What keeps it exact (tests/test_levers.py: packed loss and gradients equal the padded batch's):
- positions: transformers' `get_rope_index` numbers the whole row as one sequence (the second sample's
  mRoPE positions would continue from the first's), so it runs per sample here and the rows are joined;
- attention: the position ids passed have 4 rows, the first being each sample's text positions (0, 1, ...
  restarting per sample); from those transformers finds the sample boundaries and builds a block-diagonal
  causal mask (sdpa/eager) or varlen boundaries (flash_attention_2), so no token attends across samples;
- labels: a sample's first label is a prompt token (-100), so the last position of one sample never
  learns to predict the next sample;
- weighting: per supervised token over the micro-batch, as unpacked (train/loss.py).

Qwen3.5 is refused (train/main.py): its linear-attention layers carry state along the row, and transformers'
torch fallback for them cannot be told where a sample ends.
"""
from __future__ import annotations

import torch

from train.vision import inner_model

LENGTHS_KEY = "pack_lengths"  # per-sample lengths of a packed row (train.data.collate(pack=True))


def packed_position_ids(model, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor,
                        video_grid_thw: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(4, 1, L) position ids of a packed row: per-sample text positions, then per-sample mRoPE (t, h, w)
    exactly as `get_rope_index` gives each sample on its own. One video per sample, in row order."""
    if input_ids.shape[0] != 1 or sum(lengths) != input_ids.shape[1]:
        raise ValueError(f"packed row of shape {tuple(input_ids.shape)} does not hold samples of lengths {lengths}")
    if video_grid_thw.shape[0] != len(lengths):
        raise ValueError(f"{video_grid_thw.shape[0]} video grids for {len(lengths)} packed samples (one each)")
    rope_index = inner_model(model).get_rope_index
    pieces, start = [], 0
    for i, n in enumerate(lengths):
        ids, types = input_ids[:, start:start + n], mm_token_type_ids[:, start:start + n]
        mrope, _ = rope_index(ids, types, video_grid_thw=video_grid_thw[i:i + 1])
        text = torch.arange(n, device=input_ids.device, dtype=mrope.dtype).view(1, 1, n)
        pieces.append(torch.cat([text, mrope], dim=0))
        start += n
    return torch.cat(pieces, dim=2)


def unpack_inputs(model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A packed batch made ready for the model: position ids per sample, no attention mask (the row has no
    padding; the boundaries come from the text positions). Unpacked batches pass through unchanged."""
    if LENGTHS_KEY not in batch:
        return batch
    batch = dict(batch)
    lengths = [int(x) for x in batch.pop(LENGTHS_KEY).tolist()]
    batch["position_ids"] = packed_position_ids(model, batch["input_ids"], batch["mm_token_type_ids"],
                                                batch["video_grid_thw"], lengths)
    batch.pop("attention_mask", None)
    return batch
