"""The vision tower, run outside the language model's autograd and one temporal chunk at a time.

Why: with the tower frozen nothing in it needs a gradient, so its forward need not build a graph; and its
transient activations (qkv and fc1 outputs over every patch of the video) grow with the frame count, so
running it over a bounded number of temporal groups at a time bounds them.

Why chunking is exact for Qwen3-VL and Qwen3.5: transformers' `get_vision_cu_seqlens` gives every temporal
group (`temporal_patch_size` frames) its own attention segment (`merge_temporal=False`), the learned
position embedding is interpolated per (h, w) and repeated over t, and the rotary positions are (h, w)
only. A group's output therefore depends on its own patches alone, and a video split into chunks of
groups, encoded chunk by chunk and concatenated, gives the same embeddings (up to float reassociation in
batched matmuls). tests/test_levers.py compares against the model's own `get_video_features`.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

# The language model's forward takes precomputed vision outputs under this key (transformers 5.x).
ENCODER_KEY = "video"


def unwrap(model):
    """The transformers model under a DeepSpeed engine and/or a PEFT wrapper."""
    model = getattr(model, "module", model)  # DeepSpeedEngine
    if hasattr(model, "get_base_model"):  # PeftModel
        model = model.get_base_model()
    return model


def inner_model(model):
    """The `*Model` (visual + language_model) under a `*ForConditionalGeneration`."""
    hf = unwrap(model)
    return getattr(hf, "model", hf)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkSpan:
    """Temporal groups [t0, t1) of video `video`, one piece of a chunk."""

    video: int
    t0: int
    t1: int


def plan_chunks(grids: list[tuple[int, int, int]], groups_per_chunk: int) -> list[list[ChunkSpan]]:
    """Consecutive temporal groups of all videos, at most `groups_per_chunk` per chunk (0: one chunk);
    a chunk may end one video and start the next."""
    total = sum(t for t, _, _ in grids)
    per = total if groups_per_chunk <= 0 else groups_per_chunk
    chunks: list[list[ChunkSpan]] = []
    current: list[ChunkSpan] = []
    room = per
    for v, (t, _, _) in enumerate(grids):
        t0 = 0
        while t0 < t:
            take = min(room, t - t0)
            current.append(ChunkSpan(video=v, t0=t0, t1=t0 + take))
            t0 += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], per
    if current:
        chunks.append(current)
    return chunks


def encode_videos(model, pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor, *,
                  chunk_frames: int = 0, no_grad: bool = True):
    """The model's own video features (pooler output per video, deepstack features where the family has
    them), computed `chunk_frames` frames at a time (0: the whole batch at once) and under no_grad when
    asked. Returns the object `get_video_features` returns, ready for `mm_encoder_outputs`."""
    inner = inner_model(model)
    visual = inner.visual
    temporal = int(getattr(visual.config, "temporal_patch_size", 2))
    merge = int(visual.spatial_merge_size) ** 2
    grids = [tuple(int(x) for x in g) for g in video_grid_thw.tolist()]
    if chunk_frames and chunk_frames % temporal:
        raise ValueError(f"vision chunk of {chunk_frames} frames: must be a multiple of the temporal patch "
                         f"size {temporal}")
    chunks = plan_chunks(grids, chunk_frames // temporal if chunk_frames else 0)
    row_start = [0]
    for t, h, w in grids:
        row_start.append(row_start[-1] + t * h * w)
    pooled: list[list[torch.Tensor]] = [[] for _ in grids]
    deep: list[list[list[torch.Tensor]]] = []
    first = None
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        for chunk in chunks:
            rows, sub = [], []
            for s in chunk:
                t, h, w = grids[s.video]
                start = row_start[s.video] + s.t0 * h * w
                rows.append(pixel_values_videos[start:row_start[s.video] + s.t1 * h * w])
                sub.append((s.t1 - s.t0, h, w))
            pixels = rows[0] if len(rows) == 1 else torch.cat(rows)
            grid = torch.tensor(sub, dtype=video_grid_thw.dtype, device=video_grid_thw.device)
            out = inner.get_video_features(pixels, grid, return_dict=True)
            first = first if first is not None else out
            for s, piece in zip(chunk, out.pooler_output):
                pooled[s.video].append(piece)
            feats = getattr(out, "deepstack_features", None) or []
            while len(deep) < len(feats):
                deep.append([[] for _ in grids])
            for level, per_video in enumerate(feats):
                for s, piece in zip(chunk, per_video):
                    deep[level][s.video].append(piece)
    result = first
    result.pooler_output = tuple(_cat(p) for p in pooled)
    if deep:
        result.deepstack_features = [tuple(_cat(p) for p in level) for level in deep]
    result.last_hidden_state = None  # per chunk only; the language model reads pooler/deepstack outputs
    for (t, h, w), p in zip(grids, result.pooler_output):
        if p.shape[0] != t * h * w // merge:
            raise RuntimeError(f"vision chunking produced {p.shape[0]} tokens for grid {(t, h, w)}, "
                               f"expected {t * h * w // merge}")
    return result


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
