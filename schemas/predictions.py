"""One row of preds.jsonl: what `train.predict` writes and `train.evaluate` / `train.export` read.

A row is one window (one manifest sample). It keeps the raw generated text next to its parsed form, so a
report can always show what the model actually said, and evaluation never re-parses. Segments are
`schemas.manifest.Segment` objects in both window-local and source time.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterable

from schemas.manifest import Segment

STATUSES = ("valid", "repaired", "failed")
# Degenerate-output flags (train.answer_parse decides them):
#   empty          nothing but whitespace / end tokens was generated
#   repetition     a short unit repeats back to back (e.g. `<1.0><1.0><1.0>...`)
#   unknown_tag    markup the answer format never contains (e.g. `<argmax>11</argmax>`, stray special tokens)
#   out_of_window  a number lies outside [0, window length] (beyond rounding)
#   truncated      generation hit --max-new-tokens without the end token
DEGENERATE_FLAGS = ("empty", "repetition", "unknown_tag", "out_of_window", "truncated")


@dataclasses.dataclass(kw_only=True)
class PredictionRow:
    """A window's generated answer, parsed."""

    sample_id: str  # manifest sample id ("<video_id>/w0003")
    video_id: str  # manifest video id
    source_path: str  # video path relative to the build's --videos directory (export needs it)
    window_index: int  # position of the window in its video
    window_start_s: float  # source time of the window start
    window_end_s: float  # source time of the window end (exclusive)
    raw_output: str  # generated text up to (not including) the end token, special tokens kept
    status: str  # valid (strict training format) | repaired (lenient parse) | failed (no usable answer)
    degenerate: list[str]  # subset of DEGENERATE_FLAGS, [] for a clean output
    repairs: list[str]  # what the lenient parser changed (lenient_syntax, swapped, clamped, dropped_empty)
    segments: list[Segment]  # window-local keep segments ([] for failed or a "nothing to keep" answer)
    segments_source: list[Segment]  # the same segments in source time (+ window_start_s)
    scores: list[float] | None = None  # optional confidence per segment (same order); enables mAP
    source_fps: float | None = None  # source frame rate if known (EDL timecodes)
    generated_tokens: int = 0  # new tokens produced, end token included

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"{self.sample_id}: status {self.status!r} not in {STATUSES}")
        unknown = set(self.degenerate) - set(DEGENERATE_FLAGS)
        if unknown:
            raise ValueError(f"{self.sample_id}: unknown degenerate flags {sorted(unknown)}")
        if self.scores is not None and len(self.scores) != len(self.segments):
            raise ValueError(f"{self.sample_id}: {len(self.scores)} scores for {len(self.segments)} segments")

    @property
    def window_s(self) -> float:
        return self.window_end_s - self.window_start_s

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "PredictionRow":
        known = {f.name for f in dataclasses.fields(cls)}
        extra = set(data) - known
        if extra:
            raise ValueError(f"prediction row has unknown fields {sorted(extra)}")
        values = dict(data)
        for key in ("segments", "segments_source"):
            values[key] = [Segment(**s) for s in data[key]]
        return cls(**values)


def write_predictions(path: str | Path, rows: Iterable[PredictionRow]) -> int:
    """Write rows as JSON lines atomically (temporary name, then rename); return the count."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row.to_json()) + "\n")
            n += 1
    tmp.replace(path)
    return n


def read_predictions(path: str | Path) -> list[PredictionRow]:
    """Read preds.jsonl; a malformed line is an error naming the line."""
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(PredictionRow.from_json(json.loads(line)))
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}:{lineno}: not a prediction row: {e}") from e
    return rows
