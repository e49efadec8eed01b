"""Stage 4: the answer a window is trained to produce.

Gold segments (source seconds) are rebased to window-local time (t - window_start), clipped to
[0, window length], and pieces shorter than min_segment_s after clipping are dropped; the survivors are
rendered in the one answer format of schemas/answer.py (`format_answer`, strict inverse `parse_answer`).
"""
from __future__ import annotations

from collections.abc import Iterable

from schemas.manifest import Segment

MIN_SEGMENT_S = 0.5


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
