"""The answer format: what a window is trained to produce, rendered and parsed strictly.

ONE format, a JSON list of [start, end] pairs in window-local seconds with one decimal, sorted by start:

    [[1.0, 12.5], [20.0, 31.2]]        a positive window
    []                                 a negative window (no segment)

prep renders it (`format_answer`), the manifest stores the rendered numbers as structured segments, so
`parse_answer(record.answer) == record.segments` always holds; prediction tries `parse_answer` first and
only then the lenient reading in train/answer_parse.py.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

from schemas.manifest import Segment

DESCRIPTION = "JSON list of [start, end] window-local seconds with one decimal, e.g. [[1.0, 12.5]]; [] = negative"
_PAIR = r"\[(\d+\.\d), (\d+\.\d)\]"
_STRICT = re.compile(rf"\[(?:{_PAIR}(?:, {_PAIR})*)?\]")


def format_answer(segments: Iterable[Segment]) -> str:
    """`[[s, e], ...]` with one decimal; `[]` when there is none."""
    return "[" + ", ".join(f"[{s.start_s:.1f}, {s.end_s:.1f}]" for s in segments) + "]"


def parse_answer(text: str) -> list[Segment]:
    """Inverse of format_answer, strict: exactly that format, each end > start, sorted by start.

    Raises ValueError on anything else (the lenient parser for model output is train/answer_parse.py).
    """
    if not _STRICT.fullmatch(text):
        raise ValueError(f"not an answer in the [[s, e], ...] one-decimal format: {text[:120]!r}")
    pairs = [(float(a), float(b)) for a, b in re.findall(_PAIR, text)]
    for i, (s, e) in enumerate(pairs):
        if e <= s:
            raise ValueError(f"segment {i} [{s}, {e}] has end <= start")
        if i and s < pairs[i - 1][0]:
            raise ValueError(f"segments are not sorted by start at position {i}")
    return [Segment(start_s=s, end_s=e) for s, e in pairs]
