"""Hand the keep list per video to the program that cuts: `python -m train.export preds.jsonl --format json|edl|ffmpeg`.

- json: one object per video with its merged source-time keep list.
- edl: a CMX3600 EDL per video (one cut event per keep segment, source timecodes from the video's fps,
  record timecodes back to back from 00:00:00:00). Non-drop-frame timecode with a base of round(fps)
  frames per second (29.97 -> 30, the usual NDF convention); frame numbers are seconds * fps rounded half up.
- ffmpeg: a bash script, one command per video: trim (+atrim when the source has audio) per segment and
  a concat filter, every argument shell-quoted.

--videos DIR resolves the manifest's relative paths and lets export probe each file (fps, audio) with PyAV;
without it the fps stored in preds.jsonl is used (--fps overrides both).

Output names are unique per video: the id with every character outside [A-Za-z0-9._-] replaced, plus a short
hash of the id where that name is empty or collides (case-insensitively) with another video's (東京, 大阪 ->
video-<hash>). Nothing that exists is overwritten without --overwrite: export refuses its own output files,
and the ffmpeg script refuses, before cutting anything, when a cut it would write exists (each cut goes to
a .partial file first and is renamed when ffmpeg succeeds). Free text written into an EDL (title, clip
name) has control and line-break characters replaced, so no file name can add or break an event.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import shlex
import sys
import unicodedata
from collections import Counter
from pathlib import Path

from schemas.manifest import Segment
from schemas.predictions import PredictionRow, read_predictions
from train import segments as seg

FORMATS = ("json", "edl", "ffmpeg")
EXIT_EXISTS = 2  # an output exists and --overwrite was not given


class ExportError(RuntimeError):
    """The export cannot be written as asked (an output exists, names collide); the message names the file."""


@dataclasses.dataclass(kw_only=True)
class VideoKeep:
    """The keep list of one video and what a cutter needs to apply it."""

    video_id: str
    source_path: str  # as in the manifest (relative to --videos)
    path: str  # the file to cut: --videos/source_path, or source_path when --videos is not given
    fps: float | None  # source frame rate (probe, else preds.jsonl, else --fps)
    has_audio: bool | None  # None when the file could not be probed
    keep: list[Segment]  # merged, source time
    windows: int  # windows predicted for this video
    failed_windows: int  # of which the answer was unusable (they contribute no segment)


def probe(path: str | Path) -> tuple[float | None, bool | None]:
    """(fps, has_audio) of a file via PyAV; (None, None) when the file does not exist."""
    import av

    if not Path(path).is_file():
        return None, None
    with av.open(str(path)) as c:
        if not c.streams.video:
            raise ValueError(f"{path}: no video stream")
        rate = c.streams.video[0].average_rate or c.streams.video[0].guessed_rate
        return (float(rate) if rate else None), bool(c.streams.audio)


def collect(
    rows: list[PredictionRow], *, videos_dir: str | None = None, fps: float | None = None, gap_s: float = seg.MERGE_GAP_S
) -> list[VideoKeep]:
    """One VideoKeep per video, in preds.jsonl order."""
    keeps = seg.keep_lists(rows, gap_s)
    by_video: dict[str, list[PredictionRow]] = {}
    for r in rows:
        by_video.setdefault(r.video_id, []).append(r)
    out = []
    for vid, vrows in by_video.items():
        src = vrows[0].source_path
        path = str(Path(videos_dir) / src) if videos_dir else src
        probed_fps, audio = probe(path) if videos_dir else (None, None)
        row_fps = next((r.source_fps for r in vrows if r.source_fps), None)
        out.append(VideoKeep(
            video_id=vid, source_path=src, path=path, fps=fps or probed_fps or row_fps, has_audio=audio,
            keep=keeps[vid], windows=len(vrows), failed_windows=sum(r.status == "failed" for r in vrows),
        ))
    return out


# ---------------------------------------------------------------- JSON

def to_json(videos: list[VideoKeep], gap_s: float) -> dict:
    return {
        "merge_gap_s": gap_s,
        "videos": [
            {
                "video_id": v.video_id, "source_path": v.source_path, "path": v.path, "fps": v.fps,
                "keep": [[s.start_s, s.end_s] for s in v.keep], "kept_s": round(seg.total_s(v.keep), 3),
                "windows": v.windows, "failed_windows": v.failed_windows,
            }
            for v in videos
        ],
    }


# ---------------------------------------------------------------- EDL

def timecode(frames: int, fps: float) -> str:
    """hh:mm:ss:ff, non-drop-frame with round(fps) frames per timecode second."""
    base = max(1, round(fps))
    ff = frames % base
    secs = frames // base
    return f"{secs // 3600:02d}:{secs // 60 % 60:02d}:{secs % 60:02d}:{ff:02d}"


def frame_number(t: float, fps: float) -> int:
    """Nearest frame, halves rounded up (Python's round() would round 62.5 to 62)."""
    return math.floor(t * fps + 0.5)


def edl_text(text: str) -> str:
    """Free text safe for one EDL line: control, format and line/paragraph separator characters (every
    character Python's splitlines() breaks on among them) become spaces; runs of spaces collapse."""
    cleaned = "".join(" " if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") else c for c in text)
    return " ".join(cleaned.split())


def to_edl(video: VideoKeep, reel: str = "AX") -> str:
    """CMX3600 EDL: one V cut event per keep segment; out points are exclusive, as CMX3600 has them."""
    if not video.fps:
        raise ValueError(f"{video.video_id}: no fps known for the EDL; pass --videos DIR or --fps")
    title = edl_text(video.video_id)[:70]
    clip_name = edl_text(Path(video.source_path).name)
    lines = [f"TITLE: {title}", "FCM: NON-DROP FRAME", ""]
    rec = 0
    n = 0
    for s in video.keep:
        src_in, src_out = frame_number(s.start_s, video.fps), frame_number(s.end_s, video.fps)
        if src_out <= src_in:
            continue  # shorter than one frame at this fps
        n += 1
        length = src_out - src_in
        lines.append(
            f"{n:03d}  {reel:<8} V     C        "
            f"{timecode(src_in, video.fps)} {timecode(src_out, video.fps)} "
            f"{timecode(rec, video.fps)} {timecode(rec + length, video.fps)}"
        )
        lines.append(f"* FROM CLIP NAME: {clip_name}")
        rec += length
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- ffmpeg

def _safe_path(path: str) -> str:
    """A path ffmpeg cannot take for an option ('-x') or a protocol ('a:b')."""
    if path.startswith("-") or (":" in Path(path).parts[0] if Path(path).parts else False):
        return "file:" + path
    return path


def ffmpeg_args(video: VideoKeep, out_path: str, *, ffmpeg: str = "ffmpeg") -> list[str] | None:
    """argv of one ffmpeg run that keeps video.keep and concatenates it into out_path (replaced if it exists:
    the script points it at its own .partial file); None when nothing is kept."""
    if not video.keep:
        return None
    audio = bool(video.has_audio)
    graph, concat_in = [], []
    for i, s in enumerate(video.keep):
        graph.append(f"[0:v]trim=start={s.start_s:.3f}:end={s.end_s:.3f},setpts=PTS-STARTPTS[v{i}]")
        concat_in.append(f"[v{i}]")
        if audio:
            graph.append(f"[0:a]atrim=start={s.start_s:.3f}:end={s.end_s:.3f},asetpts=PTS-STARTPTS[a{i}]")
            concat_in.append(f"[a{i}]")
    outs = "[outv][outa]" if audio else "[outv]"
    graph.append("".join(concat_in) + f"concat=n={len(video.keep)}:v=1:a={int(audio)}{outs}")
    argv = [ffmpeg, "-hide_banner", "-nostdin", "-y", "-i", _safe_path(video.path),
            "-filter_complex", ";".join(graph), "-map", "[outv]"]
    if audio:
        argv += ["-map", "[outa]"]
    return argv + [_safe_path(out_path)]


def short_hash(video_id: str) -> str:
    return hashlib.sha256(video_id.encode("utf-8")).hexdigest()[:8]


def output_stems(videos: list[VideoKeep]) -> dict[str, str]:
    """video_id -> file stem, unique within this export (see the module doc for the rule)."""
    plain = {v.video_id: re.sub(r"[^A-Za-z0-9._-]+", "_", v.video_id).strip("._-")[:100] for v in videos}
    taken = Counter(s.casefold() for s in plain.values())
    stems = {vid: s if s and taken[s.casefold()] == 1 else f"{s or 'video'}-{short_hash(vid)}" for vid, s in plain.items()}
    clash = [s for s, n in Counter(s.casefold() for s in stems.values()).items() if n > 1]
    if clash:  # only an id that spells another's hashed name can get here
        raise ExportError(f"video ids give the same output name even with their hash: {clash}")
    return stems


def cut_suffix(video: VideoKeep) -> str:
    """The source's container extension when it is a plain one, else .mp4."""
    suffix = Path(video.source_path).suffix
    return suffix if re.fullmatch(r"\.[A-Za-z0-9]{1,10}", suffix) else ".mp4"


def ffmpeg_script(videos: list[VideoKeep], cut_dir: str = "cut", *, ffmpeg: str = "ffmpeg",
                  overwrite: bool = False) -> str:
    """A bash script with one quoted ffmpeg command per video (a comment for a video with nothing kept).
    Without `overwrite` it stops before cutting anything when one of its outputs exists."""
    stems = output_stems(videos)
    jobs = []
    for v in videos:
        out = str(Path(cut_dir) / f"{stems[v.video_id]}.keep{cut_suffix(v)}")
        partial = str(Path(cut_dir) / f"{stems[v.video_id]}.keep.partial{cut_suffix(v)}")
        jobs.append((v, out, partial, ffmpeg_args(v, partial, ffmpeg=ffmpeg)))
    lines = ["#!/usr/bin/env bash", "set -euo pipefail"]
    outs = [out for _, out, _, argv in jobs if argv is not None]
    if outs and not overwrite:
        lines += [f"for out in {' '.join(shlex.quote(o) for o in outs)}; do",
                  '  if [ -e "$out" ]; then',
                  '    echo "error: $out exists; nothing was cut (export with --overwrite to replace it)" >&2',
                  "    exit 1",
                  "  fi",
                  "done"]
    lines.append(f"mkdir -p -- {shlex.quote(cut_dir)}")
    for v, out, partial, argv in jobs:
        safe_id = edl_text(v.video_id)
        if argv is None:
            lines.append(f"# {safe_id}: nothing to keep")
            continue
        note = "" if v.has_audio is not None else " (not probed: video only; pass --videos to detect audio)"
        lines.append(f"# {safe_id}: {len(v.keep)} segments, {seg.total_s(v.keep):.1f} s kept{note}")
        lines.append(shlex.join(argv))
        lines.append(shlex.join(["mv", "-f", "--", partial, out]))
    return "\n".join(lines) + "\n"


def write_outputs(files: dict[Path, str], *, overwrite: bool) -> None:
    """Write every file, or none when one exists and `overwrite` is off (checked for all before writing)."""
    existing = [str(p) for p in files if p.exists()]
    if existing and not overwrite:
        raise ExportError(f"{', '.join(existing)} exists; pass --overwrite to replace "
                          f"{'it' if len(existing) == 1 else 'them'} (nothing was written)")
    for path, text in files.items():
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)


# ---------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preds", help="preds.jsonl written by train.predict")
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--videos", help="directory the manifest's source paths are relative to")
    ap.add_argument("--out", help="json/ffmpeg: output file; edl: output directory (one .edl per video)")
    ap.add_argument("--fps", type=float, help="frame rate for EDL timecodes (overrides probe and preds)")
    ap.add_argument("--merge-gap", type=float, default=seg.MERGE_GAP_S, help="seconds; pieces this close merge")
    ap.add_argument("--cut-dir", default="cut", help="ffmpeg: where the cut videos go")
    ap.add_argument("--ffmpeg", default="ffmpeg", help="ffmpeg executable written into the commands")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace existing output files (and let the ffmpeg script replace existing cuts)")
    args = ap.parse_args(argv)
    try:
        return _export(args)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_EXISTS


def _export(args: argparse.Namespace) -> int:
    videos = collect(read_predictions(args.preds), videos_dir=args.videos, fps=args.fps, gap_s=args.merge_gap)
    if args.format == "json":
        text = json.dumps(to_json(videos, args.merge_gap), indent=1) + "\n"
    elif args.format == "ffmpeg":
        text = ffmpeg_script(videos, args.cut_dir, ffmpeg=args.ffmpeg, overwrite=args.overwrite)
    else:
        stems = output_stems(videos)
        edls = {f"{stems[v.video_id]}.edl": to_edl(v) for v in videos}
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            write_outputs({out / name: body for name, body in edls.items()}, overwrite=args.overwrite)
            print(f"wrote {len(edls)} EDL files to {out}")
            return 0
        text = "".join(f"# ---- {name}\n{body}\n" for name, body in edls.items())
    if args.out:
        write_outputs({Path(args.out): text}, overwrite=args.overwrite)
        print(f"wrote {args.format} for {len(videos)} videos to {args.out}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
