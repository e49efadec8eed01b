"""Hand the keep list per video to the program that cuts: `python -m train.export preds.jsonl --format json|edl|ffmpeg`.

- json: one object per video with its merged source-time keep list.
- edl: a CMX3600 EDL per video (one cut event per keep segment, source timecodes from the video's fps,
  record timecodes back to back from 00:00:00:00). Non-drop-frame timecode with a base of round(fps)
  frames per second (29.97 -> 30, the usual NDF convention); frame numbers are seconds * fps rounded half up.
- ffmpeg: a bash script, one command per video: trim (+atrim when the source has audio) per segment and
  a concat filter, every argument shell-quoted.

--videos DIR resolves the manifest's relative paths and lets export probe each file (fps, audio) with PyAV;
without it the fps stored in preds.jsonl is used (--fps overrides both).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import shlex
import sys
from pathlib import Path

from schemas.manifest import Segment
from schemas.predictions import PredictionRow, read_predictions
from train import segments as seg

FORMATS = ("json", "edl", "ffmpeg")


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


def to_edl(video: VideoKeep, reel: str = "AX") -> str:
    """CMX3600 EDL: one V cut event per keep segment; out points are exclusive, as CMX3600 has them."""
    if not video.fps:
        raise ValueError(f"{video.video_id}: no fps known for the EDL; pass --videos DIR or --fps")
    title = re.sub(r"[\r\n]", " ", video.video_id)[:70]
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
        lines.append(f"* FROM CLIP NAME: {Path(video.source_path).name}")
        rec += length
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- ffmpeg

def _safe_path(path: str) -> str:
    """A path ffmpeg cannot take for an option ('-x') or a protocol ('a:b')."""
    if path.startswith("-") or (":" in Path(path).parts[0] if Path(path).parts else False):
        return "file:" + path
    return path


def ffmpeg_args(video: VideoKeep, out_path: str, *, ffmpeg: str = "ffmpeg") -> list[str] | None:
    """argv of one ffmpeg run that keeps video.keep and concatenates it; None when nothing is kept."""
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


def output_name(video: VideoKeep) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", video.video_id).strip("._") or "video"
    return f"{stem}.keep{Path(video.source_path).suffix or '.mp4'}"


def ffmpeg_script(videos: list[VideoKeep], cut_dir: str = "cut", *, ffmpeg: str = "ffmpeg") -> str:
    """A bash script with one quoted ffmpeg command per video (a comment for a video with nothing kept)."""
    lines = ["#!/usr/bin/env bash", "set -euo pipefail", f"mkdir -p {shlex.quote(cut_dir)}"]
    for v in videos:
        argv = ffmpeg_args(v, str(Path(cut_dir) / output_name(v)), ffmpeg=ffmpeg)
        safe_id = re.sub(r"[\r\n]", " ", v.video_id)
        if argv is None:
            lines.append(f"# {safe_id}: nothing to keep")
            continue
        note = "" if v.has_audio is not None else " (not probed: video only; pass --videos to detect audio)"
        lines.append(f"# {safe_id}: {len(v.keep)} segments, {seg.total_s(v.keep):.1f} s kept{note}")
        lines.append(shlex.join(argv))
    return "\n".join(lines) + "\n"


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
    args = ap.parse_args(argv)

    videos = collect(read_predictions(args.preds), videos_dir=args.videos, fps=args.fps, gap_s=args.merge_gap)
    if args.format == "json":
        text = json.dumps(to_json(videos, args.merge_gap), indent=1) + "\n"
    elif args.format == "ffmpeg":
        text = ffmpeg_script(videos, args.cut_dir, ffmpeg=args.ffmpeg)
    else:
        edls = {output_name(v).rsplit(".keep", 1)[0] + ".edl": to_edl(v) for v in videos}
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            for name, body in edls.items():
                (out / name).write_text(body)
            print(f"wrote {len(edls)} EDL files to {out}")
            return 0
        text = "".join(f"# ---- {name}\n{body}\n" for name, body in edls.items())
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.format} for {len(videos)} videos to {args.out}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
