"""The annotation input formats: what one row of `prep build`'s annotations file means.

Shared by prep (which matches rows to video files) and train.evaluate (which reads `--gold` from the same
files), so both read a row the same way. Formats (one row per annotated video):
- default: `video` (path relative to --videos), `segments` [[start_s, end_s], ...] in source seconds,
  optional `id` (defaults to the path without extension) and `query`.
- qvhighlights: `vid`, `relevant_windows`, `query`, optional `qid` (the id; else `vid`) and `duration`;
  the file is `<videos>/<vid>.<any supported extension>`.
Either layout can come as jsonl, parquet (`*.parquet`) or a directory saved by `datasets.save_to_disk`.
A row that cannot be read becomes a RejectRecord (stage "annotations") naming the row.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

from schemas.manifest import RejectRecord, Segment

FORMATS = ("default", "qvhighlights")
STAGE = "annotations"
MAX_LINE_BYTES = 1 << 20  # a jsonl annotation line is a few hundred bytes; a longer one is a reject, not read
MAX_DEPTH = 32  # JSON nesting of an annotation row (a segment list is 3 deep)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Annotation:
    """One annotated video, as read; segments are in source seconds, sorted and merged."""

    video_id: str  # unique id of the annotation (becomes SampleRecord.video_id)
    source_path: str  # video path relative to --videos (posix)
    segments: tuple[Segment, ...]  # gold spans in source seconds
    query: str | None  # the annotation's own query, None to use --query
    row: int  # 1-based row in the annotation file, for messages


def reject(video_id: str, source_path: str, reason: str, detail: str, stage: str = STAGE) -> RejectRecord:
    return RejectRecord(video_id=video_id, source_path=source_path, stage=stage, reason=reason, detail=detail)


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a jsonl file, a parquet file or a saved HF dataset directory.

    jsonl is read as bytes, one line at a time: a line that is not UTF-8, longer than MAX_LINE_BYTES, not
    JSON, nested deeper than MAX_DEPTH, or not an object comes back as {"__error__": message with the line
    number, "__reason__": reject reason}, so it becomes a reject and the other lines are still read.
    """
    path = Path(path)
    if path.is_dir():
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if len(ds) != 1 and "train" not in ds:
                raise ValueError(f"{path}: a DatasetDict with splits {sorted(ds)}; save one split or a 'train' split")
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return list(ds)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(_lines(f), 1):
            row = _parse_line(raw, n)
            if row is not None:
                rows.append(row)
    return rows


def _lines(f) -> Iterator[bytes | int]:
    """Lines as bytes; a line over MAX_LINE_BYTES is skipped to its end (memory stays bounded) and comes
    back as its length (an int)."""
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        size = len(line)
        while line and not line.endswith(b"\n"):
            line = f.readline(1 << 20)
            size += len(line)
        yield size


def _parse_line(raw: bytes | int, n: int) -> dict | None:
    """One jsonl line -> its object, None when blank, or an {"__error__", "__reason__"} row."""
    if isinstance(raw, int):
        return {"__reason__": "line_too_long", "__error__": f"line {n} has {raw} bytes, more than the "
                f"{MAX_LINE_BYTES} an annotation line may have (MAX_LINE_BYTES)"}
    if n == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
        raw = raw[3:]
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return {"__reason__": "not_utf8",
                "__error__": f"line {n} is not UTF-8: byte 0x{raw[e.start]:02x} at column {e.start + 1}"}
    if not line.strip():
        return None
    try:
        row = json.loads(line)
        too_deep = _depth(row) > MAX_DEPTH
    except json.JSONDecodeError as e:
        return {"__error__": f"line {n} is not JSON: {e}"}
    except RecursionError:  # deeper than the interpreter's recursion limit
        too_deep = True
    if too_deep:
        return {"__reason__": "too_deeply_nested", "__error__": f"line {n} nests JSON deeper than {MAX_DEPTH} levels"}
    if not isinstance(row, dict):
        return {"__error__": f"line {n} is a JSON {type(row).__name__}, not an object"}
    return row


def _depth(value) -> int:
    """Nesting depth of a parsed JSON value, without recursion (1 for a scalar)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_DEPTH:
            break
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        stack.extend((c, d + 1) for c in children)
    return deepest


def _segments(raw) -> list[tuple[float, float]]:
    """[[s, e], ...] as float pairs; ValueError with the offending item otherwise."""
    if raw is None:
        return []
    out = []
    for item in raw:
        if isinstance(item, dict):
            item = (item.get("start_s", item.get("start")), item.get("end_s", item.get("end")))
        if len(item) != 2:
            raise ValueError(f"segment {item!r} is not a [start, end] pair")
        s, e = float(item[0]), float(item[1])
        if not (math.isfinite(s) and math.isfinite(e)):
            raise ValueError(f"segment {item!r} is not finite")
        out.append((s, e))
    return out


def parse_row(row: dict, n: int, fmt: str, videos_dir: Path, video_files: dict[str, str]) -> Annotation | RejectRecord:
    """One row -> Annotation, or a reject with the row number. video_files maps stem -> relative path
    (used by qvhighlights, whose rows name the video without extension)."""
    if "__error__" in row:
        return reject("", "", row.get("__reason__", "bad_annotation"), f"row {n}: {row['__error__']}")
    if fmt == "qvhighlights":
        vid = row.get("vid")
        if not vid:
            return reject("", "", "bad_annotation", f"row {n}: no 'vid' field (keys: {sorted(row)})")
        video_id = str(row["qid"]) if row.get("qid") is not None else str(vid)
        source_path = video_files.get(str(vid), f"{vid}.mp4")
        raw_segments = row.get("relevant_windows")
    else:
        if not row.get("video"):
            return reject(str(row.get("id") or ""), "", "bad_annotation", f"row {n}: no 'video' field (keys: {sorted(row)})")
        source_path = Path(str(row["video"])).as_posix()
        video_id = str(row["id"]) if row.get("id") not in (None, "") else str(Path(source_path).with_suffix("").as_posix())
        raw_segments = row.get("segments")
    try:
        pairs = _segments(raw_segments)
    except (TypeError, ValueError) as e:
        return reject(video_id, source_path, "bad_annotation", f"row {n}: segments unreadable: {e}")
    query = row.get("query")
    return Annotation(
        video_id=video_id,
        source_path=source_path,
        segments=tuple(Segment(start_s=s, end_s=e) for s, e in pairs),
        query=str(query) if query not in (None, "") else None,
        row=n,
    )
