"""Window-local segments -> source time -> one merged keep list per video.

Windows are answered independently, so an event crossing a window border comes back as two pieces
(`[.., window end]` and `[0.0, ..]` of the next window). Merging pieces whose gap is at most `gap_s`
(default: one answer decimal, 0.1 s) rebuilds the event; overlapping windows merge the same way.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from schemas.manifest import SampleRecord, Segment
from schemas.predictions import PredictionRow

MERGE_GAP_S = 0.1  # answers have one decimal: pieces this close are one event
_EPS = 1e-6  # float slack so that a gap of exactly gap_s merges


def to_source(segments: Iterable[Segment], window_start_s: float) -> list[Segment]:
    """Shift window-local segments by the window's source start."""
    return [
        Segment(start_s=round(s.start_s + window_start_s, 3), end_s=round(s.end_s + window_start_s, 3))
        for s in segments
    ]


def merge(segments: Iterable[Segment], gap_s: float = MERGE_GAP_S) -> list[Segment]:
    """Sorted, with overlapping or touching (gap <= gap_s) segments joined into one."""
    if gap_s < 0:
        raise ValueError(f"gap_s must be >= 0, got {gap_s}")
    out: list[Segment] = []
    for s in sorted(segments, key=lambda s: (s.start_s, s.end_s)):
        if out and s.start_s <= out[-1].end_s + gap_s + _EPS:
            if s.end_s > out[-1].end_s:
                out[-1] = Segment(start_s=out[-1].start_s, end_s=s.end_s)
        else:
            out.append(s)
    return out


def keep_lists(rows: Iterable[PredictionRow], gap_s: float = MERGE_GAP_S) -> dict[str, list[Segment]]:
    """Predicted keep list per video (source time, merged), videos in order of first appearance.

    A failed window contributes nothing (its segments are already []).
    """
    pieces: dict[str, list[Segment]] = defaultdict(list)
    for row in rows:
        pieces[row.video_id].extend(row.segments_source)
    return {vid: merge(segs, gap_s) for vid, segs in pieces.items()}


def gold_keep_lists(records: Iterable[SampleRecord], gap_s: float = MERGE_GAP_S) -> dict[str, list[Segment]]:
    """Gold keep list per video from the manifest's window-local answers, mapped and merged the same way."""
    pieces: dict[str, list[Segment]] = defaultdict(list)
    for rec in records:
        pieces[rec.video_id].extend(to_source(rec.segments, rec.window_start_s))
    return {vid: merge(segs, gap_s) for vid, segs in pieces.items()}


def total_s(segments: Iterable[Segment]) -> float:
    """Summed length of (already merged) segments."""
    return sum(s.end_s - s.start_s for s in segments)
