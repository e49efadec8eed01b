"""Synthetic videos with known event times, written with PyAV.

An "event" is a bright colored square that moves over a textured, slowly drifting background while it is
on (across the frame once per event, or bouncing at constant speed: VideoSpec.motion); outside events only
the background shows. The annotation of a video is its list of event spans, so a
model that learns the task must learn to see the square. Used by the tests (codecs, sizes, fps, portrait,
odd sizes) and by the learnability dataset.

Run: python -m scripts.synth_videos --out DIR [--videos N --seed S]   (writes DIR/*.mp4 + annotations.jsonl)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
from fractions import Fraction
from pathlib import Path

import numpy as np

BOUNCE_PX_S = 40.0  # square speed of motion="bounce", pixels per second
COLORS = ((255, 40, 40), (40, 255, 40), (40, 80, 255))  # event k of a video is COLORS[(color_offset + k) % 3]

CONTAINER = {"libx264": "mp4", "h264": "mp4", "mpeg4": "mp4", "hevc": "mp4", "libx265": "mp4",
             "libvpx-vp9": "webm", "libvpx": "webm", "mjpeg": "avi", "libsvtav1": "mkv"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class VideoSpec:
    name: str
    duration_s: float = 8.0
    fps: float = 10.0
    width: int = 160
    height: int = 96
    codec: str = "libx264"
    events: tuple[tuple[float, float], ...] = ()  # [start_s, end_s) spans where the square is visible
    seed: int = 0
    square_frac: float = 1 / 3  # square side as a fraction of the shorter frame side
    # how the square moves during an event: "sweep" = left edge to right edge over the event (its position
    # tells how far the event has run, so the first and last frames look unlike the rest); "bounce" = back
    # and forth at BOUNCE_PX_S from a start position of its own, so any frame of an event looks like any other
    motion: str = "sweep"
    # the first event's color (index into COLORS); later events take the next ones. With 0..3 events per video
    # and 0 everywhere, the third color is rare (only videos with three events show it)
    color_offset: int = 0

    @property
    def filename(self) -> str:
        return f"{self.name}.{CONTAINER[self.codec]}"


def render_frame(spec: VideoSpec, i: int, texture: np.ndarray) -> np.ndarray:
    """Frame i as HxWx3 uint8: drifting texture, plus the moving square while an event is on."""
    t = i / spec.fps
    h, w = spec.height, spec.width
    shift = int(t * 7) % texture.shape[1]
    frame = np.roll(texture, shift, axis=1)[:h, :w].copy()
    for k, (start, end) in enumerate(spec.events):
        if start <= t < end:
            side = max(4, int(min(h, w) * spec.square_frac + 1e-9))  # + 1e-9: 1/3 gives exactly // 3
            travel = max(1, w - side)
            if spec.motion == "bounce":
                offset = (spec.seed * 7919 + k * 104729) % (2 * travel) + BOUNCE_PX_S * (t - start)
                x = int(travel - abs(offset % (2 * travel) - travel))
            else:
                x = int((t - start) / max(end - start, 1e-6) * travel)
            y = (h - side) // 2
            color = COLORS[(spec.color_offset + k) % len(COLORS)]
            frame[y:y + side, x:x + side] = color
    return frame


def write_video(spec: VideoSpec, out_dir: str | Path) -> Path:
    """Encode spec into out_dir/spec.filename and return the path."""
    import av

    path = Path(out_dir) / spec.filename
    rng = np.random.default_rng(spec.seed)
    texture = (rng.integers(40, 110, size=(spec.height + 8, spec.width * 2 + 8, 3))).astype(np.uint8)
    n = int(round(spec.duration_s * spec.fps))
    rate = int(spec.fps) if float(spec.fps).is_integer() else Fraction(spec.fps).limit_denominator(1001)
    if spec.codec.startswith("libvpx") and not isinstance(rate, int):
        raise ValueError(f"{spec.name}: libvpx needs an integer fps here, got {spec.fps}")
    with av.open(str(path), "w") as container:
        stream = container.add_stream(spec.codec, rate=rate)
        stream.width, stream.height = spec.width, spec.height
        stream.pix_fmt = "yuvj420p" if spec.codec == "mjpeg" else "yuv420p"
        stream.options = {"libx264": {"preset": "ultrafast"}, "libx265": {"x265-params": "log-level=error"},
                          "hevc": {"x265-params": "log-level=error"}}.get(spec.codec, {})
        if spec.codec.startswith("libvpx"):
            stream.bit_rate = 400_000  # libvpx refuses a fractional rate without one
        for i in range(n):
            img = render_frame(spec, i, texture)
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def random_events(rng: random.Random, duration_s: float, max_events: int = 3, min_len: float = 1.0) -> tuple:
    """Non-overlapping event spans at random times, rounded to 0.1 s."""
    events, t = [], rng.uniform(0, duration_s / 4)
    for _ in range(rng.randint(0, max_events)):
        length = rng.uniform(min_len, max(min_len, duration_s / 3))
        if t + length > duration_s:
            break
        events.append((round(t, 1), round(t + length, 1)))
        t += length + rng.uniform(1.0, duration_s / 3)
    return tuple(events)


def write_dataset(out_dir: str | Path, specs: list[VideoSpec], query: str | None = None) -> Path:
    """Write every spec's video plus annotations.jsonl (the `prep build` input format); return out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "annotations.jsonl", "w") as f:
        for spec in specs:
            write_video(spec, out_dir)
            row = {"id": spec.name, "video": spec.filename, "segments": [list(e) for e in spec.events]}
            if query:
                row["query"] = query
            f.write(json.dumps(row) + "\n")
    return out_dir


def event_specs(n: int, seed: int = 0, duration_s: float = 24.0, duration_range: tuple[float, float] | None = None,
                rotate_colors: bool = False, **kw) -> list[VideoSpec]:
    """n videos with random events; all duration_s long, or each a whole number of seconds drawn from
    duration_range (its own generator, so the events of a fixed-length set do not change with it).
    rotate_colors: video i starts at color i % 3, so each color opens a third of the videos and the third one
    is no longer rare (default: every video starts red)."""
    rng = random.Random(seed)
    lengths = random.Random(seed * 7919 + 1)
    specs = []
    for i in range(n):
        d = float(round(lengths.uniform(*duration_range))) if duration_range else duration_s
        specs.append(VideoSpec(name=f"synth_{seed}_{i:04d}", duration_s=d, events=random_events(rng, d),
                               seed=seed * 100003 + i, color_offset=i % len(COLORS) if rotate_colors else 0, **kw))
    return specs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--videos", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=24.0)
    args = ap.parse_args()
    write_dataset(args.out, event_specs(args.videos, args.seed, args.duration))
    print(f"wrote {args.videos} videos and annotations.jsonl to {args.out}")


if __name__ == "__main__":
    main()
