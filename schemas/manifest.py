"""Manifest and reject records.

The dataclasses below are the single definition; the pyarrow schema is derived from their type hints, so
`pyarrow.parquet.read_table("SHARDS/manifest.parquet")` shows exactly these fields, and `read_records`
turns rows back into the same dataclasses. The schema version lives in the parquet metadata.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import typing
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = "2"  # 2: source facts, prompt layout and member sha256 per sample
_VERSION_KEY = b"video_ora.schema_version"
_KIND_KEY = b"video_ora.record"
TIME_TOL = 1e-6  # seconds: frame times are recomputed from indices and fps


class SchemaError(ValueError):
    """A file of a build is of another schema version or kind; the message says how to rebuild it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Segment:
    """A time span in seconds; window-local in the manifest, source time once exported."""

    start_s: float
    end_s: float


@dataclasses.dataclass(kw_only=True)
class SampleRecord:
    """One training sample: a window of one video, exactly as the model will receive it."""

    sample_id: str  # "<video_id>/w<window index, 4 digits>", unique in a build
    video_id: str  # annotation id (or the file stem when the annotation has none)
    source_path: str  # video path relative to the build's --videos directory
    source_fps: float  # the source's average frame rate as probed (decord): frame_times_s = frame_indices / this
    source_frames: int  # frames in the source (decord's count)
    source_width: int  # displayed source width in pixels (rotation applied)
    source_height: int  # displayed source height in pixels
    source_codec: str  # codec name (PyAV), e.g. h264
    source_rotation: int  # display rotation of the source in degrees (0 when none; already applied to the frames)
    window_index: int  # 0-based position of the window in its video
    window_start_s: float  # source time where the window starts
    window_end_s: float  # source time where the window ends (a frame exactly here is sampled, as qwen-vl-utils does)
    num_frames: int  # frames fed to the model (even: temporal patch 2)
    frame_indices: list[int]  # source frame numbers decoded for this sample
    frame_times_s: list[float]  # source timestamps of those frames
    group_times_s: list[float]  # window-local time written in the prompt for each temporal group
    height: int  # frame height after the budget resize (pixels, multiple of the patch factor)
    width: int  # frame width after the budget resize
    grid_t: int  # video_grid_thw[0]: temporal patches = num_frames / 2
    grid_h: int  # video_grid_thw[1]: patch rows = height / patch_size
    grid_w: int  # video_grid_thw[2]: patch columns = width / patch_size
    visual_tokens: int  # video pad tokens in input_ids = grid_t * grid_h * grid_w / 4
    text_tokens: int  # every other input token (template, timestamps, query, answer)
    supervised_tokens: int  # tokens with a label: the answer plus the closing <|im_end|>
    input_tokens: int  # visual_tokens + text_tokens: the sequence length of this sample
    prompt_layout: str  # how the video item expands in input_ids: nested | flat (schemas/prompt.py)
    query: str  # the instruction the user turn carries
    answer: str  # the rendered answer text the model is trained to produce
    segments: list[Segment]  # the answer as structured window-local segments ([] for a negative)
    shard: str  # tar file name holding the sample, relative to the shards directory
    key: str  # WebDataset key of the sample inside its tar
    frame_sha256: list[str]  # sha256 of each frame's JPEG member, in order; readers check them before decoding
    input_ids_sha256: str  # sha256 of the input_ids stored in `<key>.json` (schemas.shard.ids_sha256)

    def problems(
        self,
        *,
        patch_size: int,
        temporal_patch_size: int = 2,
        merge_size: int = 2,
        max_input_tokens: int | None = None,
        input_ids: list[int] | None = None,
        prompt_tokens: int | None = None,
        video_token_id: int | None = None,
        frames_shape: tuple[int, int, int] | None = None,
        pixel_rows: int | None = None,
    ) -> list[str]:
        """Everything that makes this record inconsistent, with the numbers ([] when it is consistent).

        The one definition of a consistent sample, called by prep verify, the trainer's pre-flight and
        predict. The record alone is always checked (frames = 2 x grid_t, size = grid x patch, video pads =
        grid / merge^2, token sums, times inside the window and equal to frame index / source fps); the
        keyword evidence adds checks when a caller has it: the sample's input_ids and prompt_tokens (with
        the video pad id, the pad count), the decoded frames' (T, H, W), the patchified pixel rows.
        """
        p: list[str] = []
        grid = [self.grid_t, self.grid_h, self.grid_w]
        pads = self.grid_t * self.grid_h * self.grid_w // (merge_size * merge_size)
        rows = self.grid_t * self.grid_h * self.grid_w
        if not self.num_frames == len(self.frame_indices) == len(self.frame_times_s) == len(self.frame_sha256):
            p.append(f"num_frames {self.num_frames}, {len(self.frame_indices)} frame_indices, "
                     f"{len(self.frame_times_s)} frame_times_s, {len(self.frame_sha256)} frame_sha256")
        if self.num_frames != temporal_patch_size * self.grid_t or len(self.group_times_s) != self.grid_t:
            p.append(f"num_frames {self.num_frames}, grid_t {self.grid_t} (x{temporal_patch_size}), "
                     f"{len(self.group_times_s)} group_times_s")
        if (self.height, self.width) != (self.grid_h * patch_size, self.grid_w * patch_size):
            p.append(f"size {self.height}x{self.width} does not match grid {self.grid_h}x{self.grid_w} of patch {patch_size}")
        if self.grid_h % merge_size or self.grid_w % merge_size:
            p.append(f"grid {self.grid_h}x{self.grid_w} is not divisible by merge size {merge_size}")
        if self.visual_tokens != pads:
            p.append(f"visual_tokens {self.visual_tokens}, grid needs {pads}")
        if self.input_tokens != self.visual_tokens + self.text_tokens:
            p.append(f"input_tokens {self.input_tokens} != visual {self.visual_tokens} + text {self.text_tokens}")
        if self.supervised_tokens <= 0:
            p.append("no supervised tokens")
        elif self.supervised_tokens >= self.text_tokens:
            p.append(f"supervised_tokens {self.supervised_tokens} leaves no prompt text ({self.text_tokens} text tokens)")
        if max_input_tokens is not None and self.input_tokens > max_input_tokens:
            p.append(f"{self.input_tokens} input tokens > limit {max_input_tokens}")
        if not (self.window_start_s < self.window_end_s and all(
                self.window_start_s - TIME_TOL <= t < self.window_end_s + TIME_TOL for t in self.frame_times_s)):
            p.append(f"frame times {self.frame_times_s[:1]}..{self.frame_times_s[-1:]} outside the window "
                     f"{self.window_start_s}-{self.window_end_s}")
        if not self.source_fps > 0:
            p.append(f"source_fps {self.source_fps} is not > 0")
        elif any(abs(t - i / self.source_fps) > TIME_TOL for i, t in zip(self.frame_indices, self.frame_times_s)):
            p.append(f"frame_times_s are not frame_indices / source_fps {self.source_fps:.4f}")
        elif self.frame_indices and not 0 <= min(self.frame_indices) <= max(self.frame_indices) < self.source_frames:
            p.append(f"frame_indices {min(self.frame_indices)}..{max(self.frame_indices)} outside the source's "
                     f"{self.source_frames} frames")
        if input_ids is not None:
            if len(input_ids) != self.input_tokens:
                p.append(f"{len(input_ids)} input ids, the manifest says input_tokens={self.input_tokens}")
            if prompt_tokens is not None:
                supervised = len(input_ids) - prompt_tokens
                if supervised <= 0:
                    p.append(f"no supervised tokens (prompt_tokens {prompt_tokens} >= {len(input_ids)} input ids)")
                elif supervised != self.supervised_tokens:
                    p.append(f"{supervised} supervised tokens, the manifest says {self.supervised_tokens}")
            if video_token_id is not None and input_ids.count(video_token_id) != pads:
                p.append(f"{input_ids.count(video_token_id)} video pad tokens in input_ids, grid {grid} needs "
                         f"{self.grid_t}*{self.grid_h}*{self.grid_w}/{merge_size * merge_size} = {pads}")
        if frames_shape is not None:
            if frames_shape[0] != self.num_frames:
                p.append(f"{frames_shape[0]} frames in the shard, the record says num_frames={self.num_frames}")
            if tuple(frames_shape[1:3]) != (self.height, self.width):
                p.append(f"frames are {frames_shape[1]}x{frames_shape[2]}, the record says {self.height}x{self.width}")
        if pixel_rows is not None and pixel_rows != rows:
            p.append(f"{pixel_rows} pixel rows, grid {grid} needs {self.grid_t}*{self.grid_h}*{self.grid_w} = {rows}")
        return p


@dataclasses.dataclass(kw_only=True)
class RejectRecord:
    """Something that produced no sample, and why. Every input lands either in the manifest or here."""

    video_id: str  # annotation id or file stem ("" when unknown)
    source_path: str  # path relative to --videos ("" when the annotation names no file)
    stage: str  # where it was rejected: annotations, probe, decode, windows, answers, budget, tokens
    reason: str  # short machine-readable reason, e.g. "zero_byte_file", "missing_video"
    detail: str  # human sentence with the numbers involved


R = TypeVar("R", SampleRecord, RejectRecord)


def _arrow_type(hint: Any) -> pa.DataType:
    origin = typing.get_origin(hint)
    if origin is list:
        (inner,) = typing.get_args(hint)
        return pa.list_(_arrow_type(inner))
    if dataclasses.is_dataclass(hint):
        return pa.struct([pa.field(f.name, _arrow_type(t), nullable=False) for f, t in _fields(hint)])
    simple = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}
    if hint in simple:
        return simple[hint]
    raise TypeError(f"no arrow type for {hint!r}")


@functools.cache  # per class: get_type_hints evaluates every annotation again (2 ms a sample in the loader)
def _fields(cls: type) -> tuple[tuple[dataclasses.Field, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


def arrow_schema(cls: type) -> pa.Schema:
    """The parquet schema of a record class, with the schema version in its metadata."""
    fields = [pa.field(f.name, _arrow_type(t), nullable=False) for f, t in _fields(cls)]
    return pa.schema(fields, metadata={_VERSION_KEY: SCHEMA_VERSION.encode(), _KIND_KEY: cls.__name__.encode()})


def write_records(path: str | Path, records: list[R], cls: type[R]) -> None:
    """Write records to parquet atomically (a temporary name of this writer's own, then rename)."""
    path = Path(path)
    rows = [dataclasses.asdict(r) for r in records]
    table = pa.Table.from_pylist(rows, schema=arrow_schema(cls))
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")  # this writer's own name
    pq.write_table(table, tmp)
    tmp.replace(path)


def read_records(path: str | Path, cls: type[R]) -> list[R]:
    """Read records back, refusing a file written with another schema version or record kind."""
    table = pq.read_table(path)
    meta = table.schema.metadata or {}
    version = meta.get(_VERSION_KEY, b"?").decode()
    kind = meta.get(_KIND_KEY, b"?").decode()
    if version != SCHEMA_VERSION or kind != cls.__name__:
        from schemas.build import rebuild_command

        raise SchemaError(
            f"{path}: holds {kind} records of schema version {version}; this package reads "
            f"{cls.__name__} version {SCHEMA_VERSION}. Rebuild the shards: {rebuild_command(Path(path).parent)}"
        )
    return [from_dict(cls, row) for row in table.to_pylist()]


def from_dict(cls: type[R], row: dict) -> R:
    """Build a record from a plain dict (a parquet row or a sample's JSON), nested segments included."""
    values = {}
    for f, hint in _fields(cls):
        v = row[f.name]
        if typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            inner = typing.get_args(hint)[0]
            v = [inner(**x) for x in v]
        values[f.name] = v
    return cls(**values)
