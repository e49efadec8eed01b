"""Manifest and reject records.

The dataclasses below are the single definition; the pyarrow schema is derived from their type hints, so
`pyarrow.parquet.read_table("SHARDS/manifest.parquet")` shows exactly these fields, and `read_records`
turns rows back into the same dataclasses. The schema version lives in the parquet metadata.
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import typing
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = "1"
_VERSION_KEY = b"video_ora.schema_version"
_KIND_KEY = b"video_ora.record"


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
    query: str  # the instruction the user turn carries
    answer: str  # the rendered answer text the model is trained to produce
    segments: list[Segment]  # the answer as structured window-local segments ([] for a negative)
    shard: str  # tar file name holding the sample, relative to the shards directory
    key: str  # WebDataset key of the sample inside its tar


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


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


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
        raise ValueError(
            f"{path}: holds {kind} records of schema version {version}; this package reads "
            f"{cls.__name__} version {SCHEMA_VERSION}. Rebuild with `python -m prep build --overwrite`."
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
