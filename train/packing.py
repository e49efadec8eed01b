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

Attention over a packed row (`--segment-attention`, on by default with `--attention sdpa`): transformers turns
the boundaries into a dense block-diagonal [L, L] mask, which keeps sdpa off its flash / cuDNN kernels (they
take no mask) and grows with the square of the row (two 512-frame windows: ~11 GB). `use_segment_attention`
gives the language model an attention that runs transformers' own sdpa forward once per sample, causal and
unmasked, on that sample's slice of q, k and v: the same attention the mask describes, on the kernels an
unpacked row gets. The boundaries come from the text positions every layer receives (where they do not step
by one, transformers' own rule), read to the host once per row. Rows with a padding mask, and `--attention
eager` (the reference), keep transformers' mask.

Qwen3.5 is refused (train/main.py): its linear-attention layers carry state along the row, and transformers'
torch fallback for them cannot be told where a sample ends.
"""
from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from train.vision import inner_model

LENGTHS_KEY = "pack_lengths"  # per-sample lengths of a packed row (train.data.collate(pack=True))
SEGMENT_ATTENTION = "video_ora_segments"  # the attention implementation name registered with transformers
# text position ids seen by the layers -> the row's sample lengths; one host read per row, not per layer
_LENGTHS = WeakIdKeyDictionary()


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


def row_lengths(text_positions: torch.Tensor) -> list[int]:
    """Sample lengths of a one-row batch from its text positions, by transformers' own rule
    (`find_packed_sequence_indices`: a sample starts where the position does not step by one), which its mask
    path uses for the same row."""
    from transformers.masking_utils import find_packed_sequence_indices

    lengths = _LENGTHS.get(text_positions)
    if lengths is None:
        samples = find_packed_sequence_indices(text_positions.reshape(1, -1))  # None: one sample
        lengths = [text_positions.numel()] if samples is None else torch.bincount(samples[0]).tolist()
        _LENGTHS[text_positions] = lengths
    return lengths


def segment_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None, **kwargs):
    """transformers' sdpa attention, run once per packed sample (module docstring); any other batch as sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None or position_ids is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    lengths = row_lengths(position_ids)
    if len(lengths) == 1:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    if sum(lengths) != query.shape[2]:
        raise ValueError(f"packed row of {query.shape[2]} tokens, but its positions describe samples of {lengths}")
    outs, start = [], 0
    for n in lengths:
        part = slice(start, start + n)
        out, _ = sdpa_attention_forward(module, query[:, :, part], key[:, :, part], value[:, :, part], None, **kwargs)
        outs.append(out)
        start += n
    return torch.cat(outs, dim=1), None


def _segment_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """No mask for an unpadded row (segment_attention keeps the samples apart); sdpa's mask for padded rows."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def use_segment_attention(model) -> dict[str, str]:
    """The language model's attention (not the vision tower's) becomes `segment_attention`; needs sdpa."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
    AttentionMaskInterface.register(SEGMENT_ATTENTION, _segment_mask)
    config = inner_model(model).language_model.config
    if config._attn_implementation != "sdpa":
        raise ValueError(f"--segment-attention runs sdpa per packed sample; this model's language attention is "
                         f"{config._attn_implementation!r}")
    config._attn_implementation = SEGMENT_ATTENTION
    return {"language_model": SEGMENT_ATTENTION, "was": "sdpa"}
