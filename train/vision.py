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

The cache (`VisionCache`, `--vision-cache-gib`): with the blocks frozen, a sample's block outputs are the same
every time it is seen, so they are kept per sample id and a repeat runs only the heads (the merger and the
deepstack mergers, trained or not) over them. What the heads read is the output of the last block and of every
deepstack block; the patch embedding, position embeddings and blocks run only on a miss, through the model's
own `get_video_features` (their outputs are picked up by forward hooks). Exact: the heads run the same calls
over the same rows as the uncached path (VisionCache), so what is left is whether a window's block outputs
depend on the other windows of the tower pass it was first computed in; they do not when a matmul's rows do
not depend on the row count, which holds bit for bit on CPU fp32 (tests/test_vision_cache.py: the model's own
features and a train.main run's losses, torch.equal / ==). GPU kernels chosen by matrix size may differ in the
last bits there (unmeasured). The first batch with misses checks the heads against the model's own output, so
a family whose tower does something else after its blocks fails loudly.

What a hit does not need is its pixels: `VisionCache.plan` decides before training, from the rank's micro-batches in
order and each sample's entry size, which samples every micro-batch will find cached (the rule `_store` then
follows), and the loader reads those without their frames (train/data.py). A miss that comes without pixels is an
error, never a silent zero.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

# The language model's forward takes precomputed vision outputs under this key (transformers 5.x).
ENCODER_KEY = "video"
# A micro-batch whose cache hits were loaded without frames (VisionCache.plan) carries this bool tensor: which
# samples have their rows in pixel_values_videos. Read by the cache, never passed to the model.
WITH_PIXELS_KEY = "videos_with_pixels"


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
                  chunk_frames: int = 0, no_grad: bool = True, cache: VisionCache | None = None,
                  keys: list[str] | None = None, with_pixels: torch.Tensor | None = None):
    """The model's own video features (pooler output per video, deepstack features where the family has
    them), computed `chunk_frames` frames at a time (0: the whole batch at once) and under no_grad when
    asked; with a cache, the videos whose `keys` (sample ids) it holds run only the heads. `with_pixels`
    (WITH_PIXELS_KEY): which videos have rows in `pixel_values_videos` (None: all). Returns the object
    `get_video_features` returns, ready for `mm_encoder_outputs`."""
    if cache is not None:
        return cache.encode(model, pixel_values_videos, video_grid_thw, keys, chunk_frames=chunk_frames,
                            no_grad=no_grad, with_pixels=with_pixels)
    if with_pixels is not None and not bool(with_pixels.all()):
        raise RuntimeError("videos without pixels (a vision-cache plan) but no vision cache to read them from")
    return _run_tower(model, pixel_values_videos, video_grid_thw, chunk_frames=chunk_frames, no_grad=no_grad)[0]


def _run_tower(model, pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor, *, chunk_frames: int,
               no_grad: bool, capture: tuple[int, ...] = ()):
    """encode_videos without a cache; also returns the outputs of blocks `capture`, per level per video."""
    inner = inner_model(model)
    visual = inner.visual
    temporal = int(getattr(visual.config, "temporal_patch_size", 2))
    merge = int(visual.spatial_merge_size) ** 2
    grids = [tuple(int(x) for x in g) for g in video_grid_thw.tolist()]
    if chunk_frames and chunk_frames % temporal:
        raise ValueError(f"vision chunk of {chunk_frames} frames: must be a multiple of the temporal patch "
                         f"size {temporal}")
    chunks = plan_chunks(grids, chunk_frames // temporal if chunk_frames else 0)
    row_start = _row_starts(grids)
    pooled: list[list[torch.Tensor]] = [[] for _ in grids]
    deep: list[list[list[torch.Tensor]]] = []
    states: list[list[list[torch.Tensor]]] = [[[] for _ in grids] for _ in capture]  # level, video, pieces
    seen: dict[int, torch.Tensor] = {}
    hooks = [visual.blocks[b].register_forward_hook(lambda _m, _i, out, b=b: seen.__setitem__(b, out.detach()))
             for b in capture]
    first = None
    with torch.no_grad() if no_grad else contextlib.nullcontext(), _removing(hooks):
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
            for level, b in enumerate(capture):
                for s, piece in zip(chunk, torch.split(seen.pop(b), [t * h * w for t, h, w in sub])):
                    states[level][s.video].append(piece)
    result = first
    result.pooler_output = tuple(_cat(p) for p in pooled)
    if deep:
        result.deepstack_features = [tuple(_cat(p) for p in level) for level in deep]
    result.last_hidden_state = None  # per chunk only; the language model reads pooler/deepstack outputs
    for (t, h, w), p in zip(grids, result.pooler_output):
        if p.shape[0] != t * h * w // merge:
            raise RuntimeError(f"vision chunking produced {p.shape[0]} tokens for grid {(t, h, w)}, "
                               f"expected {t * h * w // merge}")
    return result, [[_cat(p) for p in level] for level in states]


@contextlib.contextmanager
def _removing(hooks):
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _row_starts(grids: list[tuple[int, int, int]]) -> list[int]:
    """Where each video's patch rows start in the micro-batch's pixel tensor (and where the last one ends)."""
    starts = [0]
    for t, h, w in grids:
        starts.append(starts[-1] + t * h * w)
    return starts


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


# ------------------------------------------------------------------------------------- the cache

HEADS = ("merger", "deepstack_merger_list")  # the tower's modules after its blocks: run on every pass, may train


def cache_problems(model) -> list[str]:
    """Why the frozen part of the tower (everything but HEADS) would not give the same outputs every pass."""
    visual = inner_model(model).visual
    problems = []
    trained = [n for n, p in visual.named_parameters() if p.requires_grad and n.split(".")[0] not in HEADS]
    if trained:
        problems.append(f"--vision-cache-gib keeps the frozen vision blocks' outputs, but {len(trained)} vision "
                        f"tensors outside the mergers train ({', '.join(trained[:3])}...): drop --unfreeze-vision "
                        "(or the --lora-targets that match the tower)")
    for name, mod in visual.named_modules():
        if name.split(".")[0] in HEADS:
            continue
        rate = getattr(mod, "p", 0.0) if isinstance(mod, torch.nn.Dropout) else getattr(mod, "attention_dropout", 0.0)
        if isinstance(rate, float) and rate > 0:
            problems.append(f"--vision-cache-gib: vision module {name or 'visual'} drops out at {rate} in training, "
                            "so its outputs differ every pass")
    return problems


def cached_levels(visual) -> tuple[int, ...]:
    """The blocks whose outputs the heads read: every deepstack block and the last one."""
    return tuple(sorted({*getattr(visual, "deepstack_visual_indexes", ()), len(visual.blocks) - 1}))


def entry_bytes(model, grid: tuple[int, int, int]) -> int:
    """What one sample's cache entry holds: each cached block's output over its t*h*w patch rows, in the
    tower's dtype (the size `_store` counts, known before anything runs)."""
    visual = inner_model(model).visual
    t, h, w = grid
    return len(cached_levels(visual)) * t * h * w * int(visual.config.hidden_size) * visual.dtype.itemsize


@dataclasses.dataclass(kw_only=True)
class CacheStats:
    """What the cache did over a run (logged per step as counts, and in full at the end)."""

    hits: int = 0  # videos encoded from the cache (heads only)
    misses: int = 0  # videos run through the whole tower
    entries: int = 0
    bytes: int = 0
    not_stored: int = 0  # misses left out because the bound was reached
    checked: bool = False  # the first misses' heads-only recompute matched the model's own output


class VisionCache:
    """Block outputs per sample id, at most `max_bytes` of them (on the tensors' device; entries are never
    evicted: a full cache just stops storing, every later miss is counted in `not_stored`).

    A micro-batch of misses only runs the uncached path itself (hooks keep the block outputs). Otherwise every
    video, hit or miss, gets its features from the heads over block outputs, run chunk by chunk exactly as the
    uncached path runs the tower (`plan_chunks` over the whole micro-batch): the same head calls over the same
    rows, so the forward values and the gradients' summation order match it; the tower then runs (without
    autograd: its frozen part needs none) over the misses only, for their block outputs."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        self._entries: dict[str, tuple[tuple[int, int, int], list[torch.Tensor]]] = {}
        self._output_type = None
        self._planned: dict[str, int] | None = None  # plan(): the samples it will store, with their sizes

    def _fits(self, held_bytes: int, size: int) -> bool:
        """The one admission rule: an entry is stored at its first miss while it fits under the bound."""
        return held_bytes + size <= self.max_bytes

    def plan(self, micro_batches: list[list[str]], sizes: dict[str, int]) -> list[list[bool]]:
        """Before training: which samples of each micro-batch (sample ids, in the order this rank encodes them;
        `sizes`: entry_bytes per sample) will be hits. A sample is stored at its first micro-batch while it
        fits (`_fits`, as `_store` does it) and is a hit in every later one; the loader reads the hits without
        their frames. From here on the cache stores exactly the planned samples (a disagreement raises)."""
        held: dict[str, int] = {}
        total, hits = 0, []
        for ids in micro_batches:
            hits.append([sid in held for sid in ids])
            for sid in ids:
                if sid not in held and self._fits(total, sizes[sid]):
                    held[sid] = sizes[sid]
                    total += sizes[sid]
        self._planned = held
        return hits

    @property
    def planned_entries(self) -> int | None:
        """How many samples plan() decided to store (None: no plan, entries are admitted as they come)."""
        return None if self._planned is None else len(self._planned)

    def encode(self, model, pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor, keys: list[str] | None,
               *, chunk_frames: int, no_grad: bool, with_pixels: torch.Tensor | None = None):
        grids = [tuple(int(x) for x in g) for g in video_grid_thw.tolist()]
        if keys is None or len(keys) != len(grids):
            raise ValueError(f"the vision cache needs one key (sample id) per video: {len(grids)} videos, keys {keys}")
        for key, grid in zip(keys, grids):
            if key in self._entries and self._entries[key][0] != grid:
                raise RuntimeError(f"vision cache: sample {key} came with grid {grid}, cached with {self._entries[key][0]}")
        visual = inner_model(model).visual
        levels = cached_levels(visual)
        miss = [v for v, k in enumerate(keys) if k not in self._entries]
        present = [True] * len(grids) if with_pixels is None else [bool(x) for x in with_pixels.tolist()]
        if lacking := [keys[v] for v in miss if not present[v]]:
            raise RuntimeError(f"vision cache: samples {lacking} came without pixels but are not cached (the "
                               "loader's plan and the cache disagree)")
        self.stats.hits += len(grids) - len(miss)
        self.stats.misses += len(miss)
        fresh: dict[int, list[torch.Tensor]] = {}
        if miss:
            rows = _row_starts([g if p else (0, 0, 0) for g, p in zip(grids, present)])
            only_misses = len(miss) == len(grids)
            pixels = pixel_values_videos if only_misses else \
                torch.cat([pixel_values_videos[rows[v]:rows[v + 1]] for v in miss])
            # misses only (a first epoch): the uncached path itself, its outputs returned; else no graph needed
            out, captured = _run_tower(model, pixels, video_grid_thw[miss], chunk_frames=chunk_frames,
                                       no_grad=no_grad if only_misses else True, capture=levels)
            self._output_type = type(out)
            fresh = {v: [level[i] for level in captured] for i, v in enumerate(miss)}
            if not self.stats.checked:
                self._check(visual, levels, [grids[v] for v in miss], [fresh[v] for v in miss], out, chunk_frames)
            for v in miss:
                self._store(keys[v], grids[v], fresh[v])
            if only_misses:
                return out
        states = [fresh[v] if v in fresh else self._entries[keys[v]][1] for v in range(len(grids))]
        return self._heads(visual, levels, grids, states, chunk_frames, no_grad=no_grad)

    def _heads(self, visual, levels: tuple[int, ...], grids, states, chunk_frames: int, *, no_grad: bool):
        """The tower's output object from block outputs `states[video][level]`: per chunk of temporal groups (as
        in `_run_tower`), the merger over the last block's rows and deepstack merger j over block
        deepstack_visual_indexes[j]'s; pieces concatenated per video."""
        temporal = int(getattr(visual.config, "temporal_patch_size", 2))
        merge = int(visual.spatial_merge_size) ** 2
        deep_blocks = list(getattr(visual, "deepstack_visual_indexes", ()))
        # in the tower's own order (deepstack mergers, then the merger), so backward meets them in the same order
        heads = [(visual.deepstack_merger_list[j], levels.index(b)) for j, b in enumerate(deep_blocks)] + \
            [(visual.merger, levels.index(len(visual.blocks) - 1))]
        pieces: list[list[list[torch.Tensor]]] = [[[] for _ in grids] for _ in heads]  # head, video, pieces
        with torch.no_grad() if no_grad else contextlib.nullcontext():
            for chunk in plan_chunks(grids, chunk_frames // temporal if chunk_frames else 0):
                per_group = [grids[s.video][1] * grids[s.video][2] for s in chunk]  # rows per temporal group
                for k, (head, level) in enumerate(heads):
                    rows = [states[s.video][level][s.t0 * g:s.t1 * g] for s, g in zip(chunk, per_group)]
                    out = head(rows[0] if len(rows) == 1 else torch.cat(rows))
                    sizes = [(s.t1 - s.t0) * g // merge for s, g in zip(chunk, per_group)]
                    for s, piece in zip(chunk, torch.split(out, sizes)):
                        pieces[k][s.video].append(piece)
        result = self._output_type()
        result.pooler_output = tuple(_cat(p) for p in pieces[-1])
        if deep_blocks:
            result.deepstack_features = [tuple(_cat(p) for p in per_video) for per_video in pieces[:-1]]
        return result

    def _store(self, key: str, grid: tuple[int, int, int], states: list[torch.Tensor]) -> None:
        if key in self._entries:  # the same sample twice in one micro-batch (tail=pad repeats)
            return
        size = sum(t.numel() * t.element_size() for t in states)
        if self._planned is not None and self._planned.get(key, size) != size:
            raise RuntimeError(f"vision cache: sample {key}'s entry is {size} bytes, its plan said {self._planned[key]}")
        if not self._fits(self.stats.bytes, size):
            if self._planned is not None and key in self._planned:
                raise RuntimeError(f"vision cache: sample {key} was planned in but does not fit (the plan and the "
                                   "cache disagree)")
            self.stats.not_stored += 1
            return
        if self._planned is not None and key not in self._planned:
            raise RuntimeError(f"vision cache: sample {key} fits but was planned out (the plan and the cache disagree)")
        self._entries[key] = (grid, [t.clone() for t in states])  # not views that keep a whole chunk alive
        self.stats.entries += 1
        self.stats.bytes += size

    def _check(self, visual, levels, grids, states, out, chunk_frames: int) -> None:
        """The heads over the captured block outputs must give what the model's own tower just gave."""
        again = self._heads(visual, levels, grids, states, chunk_frames, no_grad=True)
        pairs = list(zip(again.pooler_output, out.pooler_output))
        pairs += [(a, b) for x, y in zip(getattr(again, "deepstack_features", None) or [],
                                         getattr(out, "deepstack_features", None) or []) for a, b in zip(x, y)]
        if not all(torch.equal(a, b) for a, b in pairs):
            worst = max((a - b).abs().max().item() for a, b in pairs)
            raise RuntimeError(f"vision cache: the heads over the cached block outputs {levels} do not reproduce the "
                               f"model's own video features (max difference {worst:.3g}); this tower does more after "
                               "its blocks than train/vision.py knows: train without --vision-cache-gib")
        self.stats.checked = True

    def counts(self) -> dict:
        """Hits and misses so far (the step log's `vision_cache`)."""
        return {"hits": self.stats.hits, "misses": self.stats.misses}

    def summary(self) -> dict:
        return dataclasses.asdict(self.stats) | {"max_bytes": self.max_bytes}

    def line(self) -> str:
        s = self.stats
        return (f"vision cache: {s.hits} hits, {s.misses} misses, {s.entries} samples in "
                f"{s.bytes / 2**20:.1f} MiB (bound {self.max_bytes / 2**20:.0f} MiB, {s.not_stored} not stored)")
