"""From a planned micro-batch to model inputs: read the sample from its tar, decode, patchify, collate.

Each rank reads only its own samples through schemas.shard.ShardReader: a shard's tar is indexed once by
member offset (header scan, no data read), then a sample is a handful of seek+read calls, every member
checked against the sha256 the manifest recorded before it is decoded. The pixel values are computed exactly
like transformers' `Qwen3VLVideoProcessor` with `do_resize=False, do_sample_frames=False` (frames are
already at the budget size in the shard): rescale 1/255, normalize with mean/std, then the processor's
10-dim view + permute into rows of `3 * temporal_patch * patch * patch`. Tests compare with the processor.

Pre-flight checks name the sample: `SampleRecord.problems` (the one definition of a consistent sample,
also used by prep verify and predict) with the loaded ids, frames and pixel rows, and an untruncated answer.
"""
from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from PIL import Image

from schemas.build import rebuild_command
from schemas.manifest import SampleRecord, read_records
from schemas.prompt import layout_refusal
from schemas.shard import ShardError, ShardReader
from train.plan import MicroBatch
from train.vision import WITH_PIXELS_KEY

IGNORE_INDEX = -100  # label of positions without a loss (prompt and padding)
VIDEO_TOKEN_TYPE = 2  # mm_token_type_ids value on <|video_pad|> (0 = text, 1 = image)
MANIFEST = "manifest.parquet"


SampleError = ShardError  # a sample could not be read as recorded: the message names shard, member and sample


class PreflightError(ValueError):
    """A sample would train wrong (no supervision, truncated answer, tokens or pixels not matching its grid)."""


@dataclasses.dataclass(kw_only=True)
class LoadedSample:
    """One sample as read from its shard, before patchify."""

    record: SampleRecord
    input_ids: list[int]  # prompt (video blocks expanded) + answer + <|im_end|>
    prompt_tokens: int  # leading positions without a label
    frames: np.ndarray | None  # uint8 (T, H, W, 3), RGB, at (record.height, record.width); None: not read


# ---------------------------------------------------------------------------------------------------------
# Reading


class SampleStore:
    """Random access to samples of a build: manifest.parquet for the records, ShardReader for the bytes.

    Picklable (no open files are kept), so DataLoader workers get their own copy; call `index_for(ids)` in
    the parent first so the workers inherit the offsets instead of rescanning the tars.
    """

    def __init__(self, shards_dir: str | Path, records: Sequence[SampleRecord] | None = None):
        self.root = Path(shards_dir)
        if records is None:
            manifest = self.root / MANIFEST
            if not manifest.exists():
                raise FileNotFoundError(f"{manifest} not found: --shards must be the output of `python -m prep build`")
            records = read_records(manifest, SampleRecord)
        self.records: dict[str, SampleRecord] = {r.sample_id: r for r in records}
        self.reader = ShardReader(self.root)

    def __len__(self) -> int:
        return len(self.records)

    def record(self, sample_id: str) -> SampleRecord:
        try:
            return self.records[sample_id]
        except KeyError:
            raise SampleError(f"sample {sample_id!r} is not in {self.root / MANIFEST}", shard="",
                              sample_id=sample_id) from None

    def index_for(self, sample_ids: Sequence[str]) -> None:
        """Index the shards holding these samples (and only those)."""
        for shard in sorted({self.record(sid).shard for sid in sample_ids}):
            self.reader.index(shard)

    def check_layout(self, asked: str) -> None:
        """Refuse samples tokenized in another prompt layout than `asked` (PreflightError with the rebuild)."""
        why = layout_refusal({r.prompt_layout for r in self.records.values()}, asked, self.root,
                             rebuild_command(self.root, prompt_layout=asked))
        if why:
            raise PreflightError(why)

    def get(self, sample_id: str, *, frames: bool = True) -> LoadedSample:
        """The sample with its decoded frames; frames=False: its tokens only (no JPEG read, decoded or checked)."""
        record = self.record(sample_id)
        meta, jpegs = self.reader.read(record, frames=frames)
        decoded = np.stack([_decode_jpeg(data, record, i) for i, data in enumerate(jpegs)]) if frames else None
        return LoadedSample(record=record, input_ids=meta.input_ids, prompt_tokens=meta.prompt_tokens,
                            frames=decoded)


def _decode_jpeg(data: bytes, record: SampleRecord, i: int) -> np.ndarray:
    try:
        with Image.open(io.BytesIO(data)) as im:
            return np.asarray(im.convert("RGB"))
    except OSError as e:
        raise SampleError(f"sample {record.sample_id}: frame {i} is not a readable JPEG ({e})", shard=record.shard,
                          member=f"{record.key}.f{i:03d}.jpg", sample_id=record.sample_id) from e


# ---------------------------------------------------------------------------------------------------------
# Pixels


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionSpec:
    """The vision tower's input geometry and normalization (Qwen3-VL and Qwen3.5 share these defaults)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2  # spatial merge: merge_size x merge_size patches become one LLM token
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_model_config(cls, config: Any) -> "VisionSpec":
        """Patch geometry from a transformers config (its vision_config), normalization at the defaults."""
        vision = getattr(config, "vision_config", config)
        get = (lambda k: vision[k]) if isinstance(vision, dict) else (lambda k: getattr(vision, k))
        return cls(patch_size=_int(get("patch_size")), temporal_patch_size=_int(get("temporal_patch_size")),
                   merge_size=_int(get("spatial_merge_size")))

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def tokens(self, grid: Sequence[int]) -> int:
        """LLM tokens (video pads) of a grid."""
        t, h, w = grid
        return t * h * w // (self.merge_size * self.merge_size)


def _int(v: Any) -> int:
    # configs allow patch sizes as [h, w]; the Qwen models use square patches
    if isinstance(v, (list, tuple)):
        if len(set(v)) != 1:
            raise ValueError(f"non-square patch size {v} is not supported")
        v = v[0]
    return int(v)


def patchify(frames: np.ndarray, spec: VisionSpec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8 (T, H, W, 3) -> (float32 (T/tp * H/p * W/p, 3*tp*p*p), (grid_t, grid_h, grid_w)), bit for bit the
    Qwen3VLVideoProcessor output for frames already at a valid size."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 (T, H, W, 3), got {frames.dtype} {frames.shape}")
    T, H, W, C = frames.shape
    tp, p, m = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    if T % tp or H % (p * m) or W % (p * m):
        raise ValueError(
            f"frames {T}x{H}x{W}: need frames divisible by {tp} and sides divisible by {p * m} (the budget guarantees both)"
        )
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # (T, C, H, W), uint8
    gt, gh, gw = T // tp, H // p, W // p
    patches = video.view(gt, tp, C, gh // m, m, p, gw // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # the processor's permute without its batch dim
    # Rearranged as uint8 (a quarter of the bytes to move), normalized after: the processor normalizes first,
    # but the operation is elementwise per channel, so the values are the same bit for bit.
    rows = patches.reshape(gt * gh * gw, C, tp * p * p).to(torch.float32)
    # The processor's fused rescale+normalize: mean and std scaled by 1/rescale_factor, then (x - mean) / std.
    mean = (torch.tensor(spec.image_mean) * (1.0 / spec.rescale_factor)).view(1, -1, 1)
    std = (torch.tensor(spec.image_std) * (1.0 / spec.rescale_factor)).view(1, -1, 1)
    rows = rows.sub_(mean).div_(std)
    return rows.view(gt * gh * gw, C * tp * p * p), (gt, gh, gw)


# ---------------------------------------------------------------------------------------------------------
# Batches


@dataclasses.dataclass(kw_only=True)
class BatchMeta:
    """What the step log and an OOM report need about a micro-batch; no tensors."""

    sample_ids: list[str]
    repeat: list[bool]  # pad repeats (tail=pad) in this micro-batch
    input_tokens: list[int]  # per sample, before padding
    visual_tokens: list[int]
    supervised_tokens: list[int]
    grid_thw: list[tuple[int, int, int]]
    padded_tokens: int  # rows x row length (batch x longest sequence; packed: the sum of the lengths)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def collate(
    samples: Sequence[LoadedSample],
    spec: VisionSpec,
    *,
    video_token_id: int,
    pad_token_id: int,
    repeat: Sequence[bool] | None = None,
    pixels: Sequence[torch.Tensor | None] | None = None,
    pack: bool = False,
) -> tuple[dict[str, torch.Tensor], BatchMeta]:
    """Model inputs of a micro-batch, and its metadata: right-padded rows, or with `pack` one row holding the
    samples back to back (plus `pack_lengths`, from which train/packing.py builds per-sample positions).
    `pixels` (already patchified, one per sample) skips patchify; a None there is a sample whose pixels the
    vision cache does not need (its rows are left out of `pixel_values_videos`, and `WITH_PIXELS_KEY` says
    which samples have rows there)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    if pixels is None:
        pixels = [patchify(s.frames, spec)[0] for s in samples]
    held = [p for p in pixels if p is not None]
    lengths = [len(s.input_ids) for s in samples]
    offsets = [0] * len(samples) if not pack else [sum(lengths[:i]) for i in range(len(samples))]
    n, longest = (len(samples), max(lengths)) if not pack else (1, sum(lengths))
    input_ids = torch.full((n, longest), pad_token_id, dtype=torch.long)
    labels = torch.full((n, longest), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((n, longest), dtype=torch.long)
    for i, s in enumerate(samples):
        ids = torch.tensor(s.input_ids, dtype=torch.long)
        r, a = (i if not pack else 0), offsets[i]
        input_ids[r, a: a + len(ids)] = ids
        labels[r, a + s.prompt_tokens: a + len(ids)] = ids[s.prompt_tokens:]
        attention_mask[r, a: a + len(ids)] = 1
    mm_token_type_ids = torch.where(
        (input_ids == video_token_id) & attention_mask.bool(), VIDEO_TOKEN_TYPE, 0
    ).to(torch.long)
    grids = [(s.record.grid_t, s.record.grid_h, s.record.grid_w) for s in samples]
    tensors = {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "mm_token_type_ids": mm_token_type_ids,
        # one sample per micro-batch is the common case: skip the copy
        "pixel_values_videos": (held[0] if len(held) == 1 else torch.cat(held, dim=0)) if held
        else torch.zeros((0, spec.patch_dim)),
        "video_grid_thw": torch.tensor(grids, dtype=torch.long),
    }
    if len(held) < len(pixels):
        tensors[WITH_PIXELS_KEY] = torch.tensor([p is not None for p in pixels])
    if pack:
        tensors["pack_lengths"] = torch.tensor(lengths, dtype=torch.long)
    meta = BatchMeta(
        sample_ids=[s.record.sample_id for s in samples],
        repeat=list(repeat) if repeat is not None else [False] * n,
        input_tokens=[len(s.input_ids) for s in samples],
        visual_tokens=[s.record.visual_tokens for s in samples],
        supervised_tokens=[len(s.input_ids) - s.prompt_tokens for s in samples],
        grid_thw=grids,
        padded_tokens=n * longest,
    )
    return tensors, meta


# ---------------------------------------------------------------------------------------------------------
# Pre-flight


def preflight(
    sample: LoadedSample,
    *,
    tokenizer=None,
    spec: VisionSpec | None = None,
    video_token_id: int | None = None,
    pixels: torch.Tensor | None = None,
) -> None:
    """Every check one loaded sample allows; all problems in one PreflightError naming the sample.

    The record, its input_ids, frames and pixel rows go through SampleRecord.problems. tokenizer: also
    checks that the labeled span is exactly tokenizer(answer + '<|im_end|>') (the answer is not truncated).
    video_token_id: counts video pads against the grid (looked up in the tokenizer when omitted). pixels:
    the patchified rows (otherwise derived from the frame shape).
    """
    spec = spec or VisionSpec()
    r = sample.record
    ids = sample.input_ids
    problems: list[str] = []
    if tokenizer is not None:
        expected = tokenizer(r.answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        span = ids[sample.prompt_tokens:]
        if span != expected:
            if ids[-len(expected):] == expected:
                problems.append(f"labeled span has {len(span)} tokens but answer + <|im_end|> is {len(expected)}: "
                                "prompt_tokens does not mark where the answer starts")
            else:
                got = tokenizer.decode(span)
                problems.append(f"answer is truncated or altered: labeled span decodes to {got!r}, "
                                f"expected {r.answer + '<|im_end|>'!r}")
        if video_token_id is None:
            video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    f = sample.frames  # None: loaded without frames (their checks ran when they were read)
    if pixels is not None:
        rows = pixels.shape[0]
        if pixels.shape[1] != spec.patch_dim:
            problems.append(f"pixel rows have {pixels.shape[1]} values, the vision tower takes {spec.patch_dim}")
    elif f is not None:
        rows = (f.shape[0] // spec.temporal_patch_size) * (f.shape[1] // spec.patch_size) * (f.shape[2] // spec.patch_size)
    else:
        rows = None
    problems = r.problems(patch_size=spec.patch_size, temporal_patch_size=spec.temporal_patch_size,
                          merge_size=spec.merge_size, input_ids=ids, prompt_tokens=sample.prompt_tokens,
                          video_token_id=video_token_id, frames_shape=tuple(f.shape[:3]) if f is not None else None,
                          pixel_rows=rows) + problems
    if problems:
        raise PreflightError(f"sample {r.sample_id}: " + "; ".join(problems))


def preflight_records(
    records: Sequence[SampleRecord], max_input_tokens: int | None = None, spec: VisionSpec | None = None
) -> None:
    """Manifest-only checks (SampleRecord.problems) for every planned sample, before anything loads; every
    bad sample named."""
    spec = spec or VisionSpec()
    bad: list[str] = []
    for r in records:
        problems = r.problems(patch_size=spec.patch_size, temporal_patch_size=spec.temporal_patch_size,
                              merge_size=spec.merge_size, max_input_tokens=max_input_tokens)
        if problems:
            bad.append(f"{r.sample_id}: {'; '.join(problems)}")
    if bad:
        shown = "\n  ".join(bad[:20])
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise PreflightError(f"{len(bad)} of {len(records)} planned samples fail pre-flight:\n  {shown}{more}")


# ---------------------------------------------------------------------------------------------------------
# Loader


class MicroBatchDataset(torch.utils.data.Dataset):
    """Item i = the collated micro-batch i of one rank's plan. Map-style with a sequential sampler, so the
    DataLoader returns items in plan order whatever the number of workers. `cached[i][j]`: sample j of
    micro-batch i will be a vision-cache hit (VisionCache.plan), so its frames are not read: after the cache's
    first epoch a batch is a few JSON members, not 128 JPEG decodes competing with the step for the cores."""

    def __init__(self, store: SampleStore, micro_batches: Sequence[MicroBatch], spec: VisionSpec, *,
                 video_token_id: int, pad_token_id: int, tokenizer=None, pixel_dtype: torch.dtype = torch.float32,
                 pack: bool = False, cached: Sequence[Sequence[bool]] | None = None,
                 inputs: Callable[[dict, list[str]], dict] | None = None):
        self.store = store
        self.inputs = inputs  # (tensors, sample_ids) -> tensors the forward takes (train.loss.WorkerInputs), or None
        self.micro_batches = list(micro_batches)
        self.cached = [list(c) for c in cached] if cached is not None else [[False] * len(mb.sample_ids)
                                                                             for mb in self.micro_batches]
        if len(self.cached) != len(self.micro_batches) or any(
                len(c) != len(mb.sample_ids) for c, mb in zip(self.cached, self.micro_batches)):
            raise ValueError("cached: one flag per sample of every micro-batch")
        self.spec = spec
        self.video_token_id = video_token_id
        self.pad_token_id = pad_token_id
        self.tokenizer = tokenizer
        self.pixel_dtype = pixel_dtype
        self.pack = pack

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __getitem__(self, i: int) -> "tuple[dict[str, torch.Tensor], BatchMeta] | LoadFailure":
        try:
            return self._load(i)
        except (SampleError, PreflightError) as e:  # data problems leave the worker as data (see LoadFailure)
            return LoadFailure(error=e)

    def _load(self, i: int) -> tuple[dict[str, torch.Tensor], BatchMeta]:
        mb = self.micro_batches[i]
        samples = [self.store.get(sid, frames=not hit) for sid, hit in zip(mb.sample_ids, self.cached[i])]
        pixels = []
        for s in samples:
            px = patchify(s.frames, self.spec)[0] if s.frames is not None else None
            # Every sample is checked as it loads, so a bad one fails with its id, not as a shape error.
            preflight(s, tokenizer=self.tokenizer, spec=self.spec, video_token_id=self.video_token_id, pixels=px)
            pixels.append(px.to(self.pixel_dtype) if px is not None else None)
        tensors, meta = collate(samples, self.spec, video_token_id=self.video_token_id, pad_token_id=self.pad_token_id,
                                repeat=mb.repeat, pixels=pixels, pack=self.pack)
        return (self.inputs(tensors, meta.sample_ids) if self.inputs is not None else tensors), meta


@dataclasses.dataclass(kw_only=True)
class LoadFailure:
    """A micro-batch whose sample could not be read or fails pre-flight, carried out of the loader worker as
    data: DataLoader would re-raise the worker's exception as a RuntimeError around a traceback, losing its
    type and its shard, member and sample, and the trainer would crash instead of exiting with the message."""

    error: Exception  # SampleError (ShardError) or PreflightError, picklable


class PlanLoader:
    """Iterates the DataLoader and raises a LoadFailure's error in the trainer's own process, as itself."""

    def __init__(self, loader: torch.utils.data.DataLoader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        # iter(loader) now, not on the first next(): the DataLoader draws its worker seed from torch's RNG
        # when its iterator is created, and the trainer creates it before restoring a checkpoint's RNG.
        return _raise_failures(iter(self.loader))


def _raise_failures(batches):
    for item in batches:
        if isinstance(item, LoadFailure):
            raise item.error
        yield item


def rank_loader(
    store: SampleStore,
    micro_batches: Sequence[MicroBatch],
    spec: VisionSpec,
    *,
    video_token_id: int,
    pad_token_id: int,
    tokenizer=None,
    num_workers: int = 2,
    prefetch_factor: int = 4,
    pin_memory: bool | None = None,
    pixel_dtype: torch.dtype = torch.float32,
    pack: bool = False,
    cached: Sequence[Sequence[bool]] | None = None,
    inputs: Callable[[dict, list[str]], dict] | None = None,
) -> PlanLoader:
    """Loader yielding (tensors, BatchMeta) for one rank's micro-batches, exactly in the given order,
    prepared ahead by `num_workers` worker processes. With `tokenizer`, each sample's answer span is checked;
    `cached` (VisionCache.plan): the samples loaded without frames; `inputs`: a stage run on each collated batch in
    the worker (train.loss.WorkerInputs: what the forward would otherwise read on the GPU).
    A sample that cannot be read as the build wrote it (or fails pre-flight) raises its own error, naming
    shard, member and sample, when its micro-batch is next: before it reaches the model."""
    store.index_for([sid for mb in micro_batches for sid in mb.sample_ids])
    dataset = MicroBatchDataset(store, micro_batches, spec, video_token_id=video_token_id, pad_token_id=pad_token_id,
                                tokenizer=tokenizer, pixel_dtype=pixel_dtype, pack=pack, cached=cached, inputs=inputs)
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    return PlanLoader(torch.utils.data.DataLoader(
        dataset,
        batch_size=None,  # items are already micro-batches
        shuffle=False,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        pin_memory=pin_memory,
        persistent_workers=False,
        in_order=True,
    ))
