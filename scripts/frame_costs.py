"""What one sampled frame costs a build, stage by stage: decode (per backend), resize, JPEG. One process, nothing else.

    python -m scripts.frame_costs --videos DIR [--clips 4] [--rounds 4] [--decoders decord torchcodec]

Why it exists: the build's target is a ratio to the decode floor (issue 10: <= 1.3x), and the build decodes exactly
what the floor decodes, then resizes and JPEG-encodes each sampled frame. So resize + JPEG over decode, per sampled
frame, is the least the build can cost over the floor, before any tar, record or process start; this measures it
on the machine at hand (BENCHMARKS.md, Prep, session 22).

The windows are the bench's: consecutive 16 s windows of each clip sampled at 2 fps (every round(fps / 2)-th frame),
read the way the build reads them (prep.decode.decode_windows). CPU seconds are the whole process's (getrusage
SELF), since decord and torchcodec decode in threads of their own; medians over --rounds after one untimed round,
backends alternating. Prints one JSON object: ms of CPU per sampled frame for each decoder, the resize to the
bench's 640x352 and JPEG at --jpeg-quality, and resize + JPEG over each decoder's decode.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path

from prep.decoders import BACKENDS


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def windows_of(path: Path, window_s: float = 16.0, fps: float = 2.0) -> list[list[int]]:
    """The frame indices of consecutive window_s windows sampled at `fps` (the bench's 2 fps of a 30 fps clip)."""
    from prep.probe import ProbeResult, probe_video

    probe = probe_video(path)
    if not isinstance(probe, ProbeResult):
        raise SystemExit(f"frame_costs: {path}: {probe.reason}: {probe.detail}")
    step, per_window = max(1, round(probe.fps / fps)), max(1, round(window_s * probe.fps))
    return [list(range(start, min(start + per_window, probe.frames), step))
            for start in range(0, probe.frames, per_window)]


def measure(videos: Path, clips: int, rounds: int, decoders: list[str], size: tuple[int, int], quality: int) -> dict:
    import torch

    from prep.annotations import find_videos
    from prep.decode import decode_windows, encode_frame, keep_freed_buffers, resize_frame

    keep_freed_buffers()  # as in a build's workers: freed frame buffers stay in the process,
    torch.set_num_threads(1)  # and the resize runs on one thread (prep.build._one_torch_thread)
    paths = [videos / rel for rel in find_videos(videos)][:clips]  # the build's own listing, in its order
    if not paths:
        raise SystemExit(f"frame_costs: no videos in {videos}")
    plans = {p: windows_of(p) for p in paths}
    sampled = sum(len(w) for ws in plans.values() for w in ws)
    decode_ms: dict[str, list[float]] = {d: [] for d in decoders}
    for r in range(rounds + 1):
        for d in decoders[r % len(decoders):] + decoders[:r % len(decoders)]:
            c = cpu_s()
            for p, ws in plans.items():
                for _ in decode_windows(str(p), ws, backend=d):
                    pass
            if r:
                decode_ms[d].append(1000 * (cpu_s() - c) / sampled)
    frames = [f for _, fs in decode_windows(str(paths[0]), plans[paths[0]]) for f in fs]
    height, width = size
    small = [resize_frame(f, height, width) for f in frames]
    resize_ms, jpeg_ms = [], []
    passes = 5  # over the first clip's frames per round: enough CPU time for getrusage's resolution
    for r in range(rounds + 1):
        c = cpu_s()
        for _ in range(passes):
            for f in frames:  # each result dropped at once, as the build's encoder does after its JPEG
                resize_frame(f, height, width)
        mid = cpu_s()
        for _ in range(passes):
            for f in small:  # already at the size: encode_frame's resize returns the frame itself
                encode_frame(f, height, width, quality)
        if r:
            resize_ms.append(1000 * (mid - c) / (passes * len(frames)))
            jpeg_ms.append(1000 * (cpu_s() - mid) / (passes * len(frames)))
    med = {d: round(statistics.median(v), 3) for d, v in decode_ms.items()}
    resize, jpeg = round(statistics.median(resize_ms), 3), round(statistics.median(jpeg_ms), 3)
    return {"clips": len(paths), "sampled_frames": sampled, "size": [height, width], "jpeg_quality": quality,
            "decode_ms": med, "resize_ms": resize, "jpeg_ms": jpeg,
            "resize_jpeg_over_decode": {d: round((resize + jpeg) / m, 3) for d, m in med.items()},
            "runs": {"decode_ms": {d: [round(x, 3) for x in v] for d, v in decode_ms.items()},
                     "resize_ms": [round(x, 3) for x in resize_ms], "jpeg_ms": [round(x, 3) for x in jpeg_ms]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.frame_costs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--videos", type=Path, required=True, help="a directory of clips (e.g. the bench's issue-32)")
    ap.add_argument("--clips", type=int, default=4, help="how many of its clips, in path order (default 4)")
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds after one untimed round (default 4)")
    ap.add_argument("--decoders", nargs="+", default=["decord", "torchcodec"], choices=BACKENDS)
    ap.add_argument("--size", type=int, nargs=2, default=[352, 640], metavar=("HEIGHT", "WIDTH"),
                    help="the resize target (default the bench's 352 640)")
    ap.add_argument("--jpeg-quality", type=int, default=95)
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.videos, args.clips, args.rounds, args.decoders, tuple(args.size), args.jpeg_quality)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
