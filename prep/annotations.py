"""Stage 1: match annotation rows to video files, check segments against the probed duration.

What a row means (the input formats, `read_rows`, `parse_row`, the jsonl line bounds) is the contract in
schemas/annotations.py, shared with train.evaluate's `--gold`. Every problem becomes a RejectRecord (stage
"annotations") with a reason a script can count and a detail a person can act on; nothing is dropped
silently.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from schemas.annotations import FORMATS, Annotation, parse_row, read_rows, reject
from schemas.manifest import RejectRecord, Segment

VIDEO_EXTS = (".mp4", ".mkv", ".webm", ".mov", ".avi", ".mpg", ".mpeg")
DURATION_TOLERANCE_S = 0.5  # segments ending at most this far past the probed duration are clipped to it


def find_videos(videos_dir: str | Path) -> list[str]:
    """Video files under videos_dir (recursive, by extension), as sorted posix paths relative to it."""
    root = Path(videos_dir)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.suffix.lower() in VIDEO_EXTS)


def load_annotations(
    path: str | Path, videos_dir: str | Path, fmt: str = "default", allow_outside: bool = False
) -> tuple[list[Annotation], list[RejectRecord]]:
    """Read the annotations and match them to the files under videos_dir.

    Rejects: unreadable rows (bad_annotation, not_utf8, line_too_long, too_deeply_nested), a later row
    reusing an id (duplicate_id; the first one wins), a path that resolves (symlinks followed) outside
    videos_dir unless allow_outside (path_outside_videos: `../x.mp4`, `/elsewhere/x.mp4`, a link leading
    out), an annotation whose file does not exist (missing_video), a video file that no annotation names
    (video_without_annotation). Segments are checked later, against the probe (check_segments).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown annotation format {fmt!r}; known: {FORMATS}")
    videos_dir = Path(videos_dir)
    root = videos_dir.resolve()
    files = find_videos(videos_dir)
    by_stem = {}
    for rel in files:
        by_stem.setdefault(Path(rel).with_suffix("").as_posix(), rel)
    kept: list[Annotation] = []
    rejects: list[RejectRecord] = []
    first_row: dict[str, Annotation] = {}
    named: set[str] = set()  # files some row names: its fate is that row's, never "without annotation"
    for n, row in enumerate(read_rows(path), 1):
        ann = parse_row(row, n, fmt, videos_dir, by_stem)
        named.add(ann.source_path)
        if isinstance(ann, RejectRecord):
            rejects.append(ann)
            continue
        if ann.video_id in first_row:
            first = first_row[ann.video_id]
            rejects.append(reject(ann.video_id, ann.source_path, "duplicate_id",
                                  f"row {n}: id {ann.video_id!r} already used by row {first.row} "
                                  f"({first.source_path}); the first row is kept"))
            continue
        first_row[ann.video_id] = ann
        target = (videos_dir / ann.source_path).resolve()
        if not allow_outside and not target.is_relative_to(root):
            rejects.append(reject(ann.video_id, ann.source_path, "path_outside_videos",
                                  f"row {n}: {ann.source_path} resolves to {target}, outside --videos {root} "
                                  f"(--allow-outside-videos reads it anyway)"))
            continue
        if not (videos_dir / ann.source_path).is_file():
            rejects.append(reject(ann.video_id, ann.source_path, "missing_video",
                                  f"row {n}: {videos_dir / ann.source_path} does not exist"))
            continue
        kept.append(ann)
    for rel in files:
        if rel not in named:
            rejects.append(reject(Path(rel).with_suffix("").as_posix(), rel, "video_without_annotation",
                                  f"{rel} is under --videos but no annotation row names it"))
    return kept, rejects


def check_segments(ann: Annotation, duration_s: float, tolerance_s: float = DURATION_TOLERANCE_S) -> Annotation | RejectRecord:
    """Validate gold segments against the probed duration; return them sorted and merged where they overlap.

    end <= start, a negative start, or an end more than tolerance_s past the duration rejects the whole
    video (its labels cannot be trusted); an end within tolerance_s past the duration is clipped.
    """
    for seg in ann.segments:
        where = f"row {ann.row}: segment [{seg.start_s:g}, {seg.end_s:g}]"
        if seg.end_s <= seg.start_s:
            return reject(ann.video_id, ann.source_path, "segment_end_before_start", f"{where} has end <= start")
        if seg.start_s < 0:
            return reject(ann.video_id, ann.source_path, "segment_negative", f"{where} starts before 0 s")
        if seg.end_s > duration_s + tolerance_s:
            return reject(ann.video_id, ann.source_path, "segment_past_duration",
                          f"{where} ends {seg.end_s - duration_s:.2f} s past the video's probed duration "
                          f"{duration_s:.2f} s (tolerance {tolerance_s:g} s)")
    spans = sorted((s.start_s, min(s.end_s, duration_s)) for s in ann.segments)
    merged: list[list[float]] = []
    for s, e in spans:
        if s >= e:  # started inside the tolerance band past the end: nothing left after clipping
            continue
        if merged and s < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return dataclasses.replace(ann, segments=tuple(Segment(start_s=s, end_s=e) for s, e in merged))
