"""Stage 3: cut a video's duration into windows.

Windows start at 0, stride_s apart, each window_s long; the sequence stops at the first window that reaches
the end of the video, so no window lies inside another one's tail. The last window is usually partial:
- keep: keep it when it is at least min_last_s long (default 2 s), drop it otherwise;
- drop: keep only full-length windows;
- extend: shift it back so it ends at the video's end and is full length (it then overlaps its
  predecessor); a video shorter than one window keeps its single window as it is.
"""
from __future__ import annotations

import dataclasses

LAST_WINDOW = ("keep", "drop", "extend")
MIN_LAST_S = 2.0
_EPS = 1e-6


@dataclasses.dataclass(frozen=True, kw_only=True)
class Window:
    index: int  # 0-based position in the video
    start_s: float  # source time, inclusive
    end_s: float  # source time, exclusive

    @property
    def length_s(self) -> float:
        return self.end_s - self.start_s


def make_windows(
    duration_s: float, window_s: float, stride_s: float | None = None, last: str = "keep", min_last_s: float = MIN_LAST_S
) -> list[Window]:
    """The windows of a video of duration_s seconds (see the module doc for the last-window policy)."""
    stride_s = window_s if stride_s is None else stride_s
    if window_s <= 0 or stride_s <= 0:
        raise ValueError(f"window and stride must be > 0, got {window_s}, {stride_s}")
    if last not in LAST_WINDOW:
        raise ValueError(f"last-window policy must be one of {LAST_WINDOW}, got {last!r}")
    spans: list[tuple[float, float]] = []
    k = 0
    while True:
        start = k * stride_s
        if start >= duration_s - _EPS:
            break
        end = min(start + window_s, duration_s)
        spans.append((start, end))
        if end >= duration_s - _EPS:
            break
        k += 1
    if spans and spans[-1][1] - spans[-1][0] < window_s - _EPS:
        start, end = spans.pop()
        if last == "keep" and end - start >= min_last_s - _EPS:
            spans.append((start, end))
        elif last == "extend":
            new_start = max(0.0, duration_s - window_s)
            if not spans or new_start > spans[-1][0] + _EPS:
                if duration_s - new_start >= min(min_last_s, window_s) - _EPS:
                    spans.append((new_start, duration_s))
    return [Window(index=i, start_s=s, end_s=e) for i, (s, e) in enumerate(spans)]
