"""Stage 4: the answer a window is trained to produce.

Gold segments (source seconds) are rebased to window-local time (t - window_start), clipped to
[0, window length], and pieces shorter than min_segment_s after clipping are dropped. The answer text is ONE
format, a JSON list of [start, end] pairs in window-local seconds with one decimal, sorted by start:

    [[1.0, 12.5], [20.0, 31.2]]        a positive window
    []                                 a negative window (no segment)

The structured segments stored in the manifest are exactly the rendered numbers, so
parse_answer(record.answer) == record.segments always holds.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

from schemas.manifest import Segment

MIN_SEGMENT_S = 0.5
_PAIR = r"\[(\d+\.\d), (\d+\.\d)\]"
_STRICT = re.compile(rf"\[(?:{_PAIR}(?:, {_PAIR})*)?\]")


def rebase_segments(segments: Iterable[Segment], start_s: float, end_s: float, min_segment_s: float = MIN_SEGMENT_S) -> list[Segment]:
    """Gold segments clipped to [start_s, end_s) and shifted to window-local time, rounded to 0.1 s.

    The min-length rule applies to the exact clipped piece; rounding comes last and a piece that rounds
    to zero length is dropped too.
    """
    length = end_s - start_s
    out = []
    for seg in sorted(segments, key=lambda s: (s.start_s, s.end_s)):
        s = max(seg.start_s - start_s, 0.0)
        e = min(seg.end_s - start_s, length)
        if e - s < min_segment_s or e <= s:
            continue
        rs, re_ = round(s, 1), round(e, 1)
        if re_ > rs:
            out.append(Segment(start_s=rs, end_s=re_))
    return out


def format_answer(segments: Iterable[Segment]) -> str:
    """`[[s, e], ...]` with one decimal; `[]` when there is none."""
    return "[" + ", ".join(f"[{s.start_s:.1f}, {s.end_s:.1f}]" for s in segments) + "]"


def parse_answer(text: str) -> list[Segment]:
    """Inverse of format_answer, strict: exactly that format, each end > start, sorted by start.

    Raises ValueError on anything else (a lenient parser for model output lives with prediction).
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
