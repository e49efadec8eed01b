"""Stage 2: probe a video file once, before anything is planned.

decord is the decoder the build uses, so decord's frame count and average fps are the truth (duration =
frames / fps, the same rule qwen-vl-utils' decord backend uses). PyAV is the second opinion: it names the
codec when decord cannot open a file, reads the display rotation, and gives the container duration.

Rotation: decord 0.6 applies the display matrix for multiples of 90 degrees (a portrait phone clip stored
as 1280x720 with rotation 90 decodes as 720x1280), so width/height here are the DISPLAYED size, taken from
a decoded frame and cross-checked against PyAV's coded size and rotation. Any other angle is rejected
(unsupported_rotation): decord would return the frames unrotated.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from prep import faults
from prep.budget import MAX_RATIO

STAGE = "probe"

# First bytes of containers we accept: an unreadable file that starts like one is corrupt (truncated),
# anything else is not a video at all.
_SIGNATURES = {
    "mp4/mov": lambda b: b[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"),
    "matroska/webm": lambda b: b[:4] == b"\x1a\x45\xdf\xa3",
    "avi": lambda b: b[:4] == b"RIFF" and b[8:12] == b"AVI ",
    "mpeg-ps/ts": lambda b: b[:4] == b"\x00\x00\x01\xba" or b[:1] == b"\x47",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """What the planner needs to know about a video file."""

    path: str  # absolute path that was probed
    size_bytes: int
    frames: int  # decord's frame count
    fps: float  # decord's average fps
    duration_s: float  # frames / fps
    width: int  # displayed width (rotation applied)
    height: int  # displayed height
    codec: str  # PyAV codec name, e.g. h264
    rotation: int  # display rotation in degrees (PyAV, counter-clockwise), 0 when none
    container_duration_s: float | None  # PyAV's container duration, a second opinion


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeFailure:
    """Why a file cannot be used; becomes a RejectRecord per annotation that names the file."""

    path: str
    reason: str
    detail: str
    stage: str = STAGE


def _container_kind(path: Path) -> str | None:
    with open(path, "rb") as f:
        head = f.read(16)
    return next((name for name, test in _SIGNATURES.items() if len(head) >= 12 and test(head)), None)


def _pyav_probe(path: Path) -> dict:
    """Codec, coded size, rotation and container duration from PyAV; {'error': ...} when it cannot."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                return {"error": "no video stream", "no_video": True}
            stream = container.streams.video[0]
            info = {
                "codec": stream.codec_context.name,
                "coded_width": stream.codec_context.width,
                "coded_height": stream.codec_context.height,
                "container_duration_s": container.duration / 1e6 if container.duration else None,
                "rotation": 0,
            }
            try:
                frame = next(container.decode(stream))
                info["rotation"] = int(round(frame.rotation or 0))
            except (StopIteration, av.FFmpegError) as e:
                info["decode_error"] = str(e) or type(e).__name__
            return info
    except av.FFmpegError as e:
        return {"error": str(e)}


def probe_video(path: str | Path, num_threads: int = 1) -> ProbeResult | ProbeFailure:
    """Probe one file; never raises for a bad file (a bad file is data), only for a code error."""
    import decord

    path = Path(path)
    p = str(path)
    faults.maybe_hang("probe", p)
    size = path.stat().st_size
    if size == 0:
        return ProbeFailure(path=p, reason="zero_byte_file", detail=f"{path.name} is empty (0 bytes)")
    av_info = _pyav_probe(path)
    try:
        reader = decord.VideoReader(p, ctx=decord.cpu(0), num_threads=num_threads)
        frames = len(reader)
        fps = float(reader.get_avg_fps())
        first = reader[0].shape if frames else None
        if frames >= 2:
            reader.get_batch([frames - 1])  # the last frame must decode too: catches cut-off streams
    except (decord.DECORDError, RuntimeError) as e:
        message = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
        if "error" not in av_info:
            if av_info.get("no_video"):
                return ProbeFailure(path=p, reason="no_video_stream", detail=f"{path.name}: no video stream in the file")
            if "cannot find video stream" in message:  # decord's ffmpeg has no decoder for the codec
                return ProbeFailure(path=p, reason="unsupported_codec",
                                    detail=f"{path.name}: codec {av_info['codec']} ({av_info['coded_width']}x"
                                           f"{av_info['coded_height']}) opens in PyAV but decord has no decoder: {message}")
            return ProbeFailure(path=p, reason="corrupt_video",
                                detail=f"{path.name} ({size} bytes): the {av_info['codec']} header reads but decord "
                                       f"fails on the stream (truncated?): {message}")
        kind = _container_kind(path)
        if kind is None:
            return ProbeFailure(path=p, reason="not_a_video",
                                detail=f"{path.name} ({size} bytes) is not a video container: {av_info['error']}")
        return ProbeFailure(path=p, reason="corrupt_video",
                            detail=f"{path.name} ({size} bytes) starts like {kind} but cannot be read (truncated?): "
                                   f"{av_info['error']}")
    if av_info.get("no_video"):
        return ProbeFailure(path=p, reason="no_video_stream", detail=f"{path.name}: PyAV finds no video stream")
    if frames < 2:
        return ProbeFailure(path=p, reason="too_few_frames", detail=f"{path.name} has {frames} frame(s); a window needs >= 2")
    if not (math.isfinite(fps) and fps > 0):
        return ProbeFailure(path=p, reason="bad_fps", detail=f"{path.name}: decord reports fps={fps}")
    height, width = int(first[0]), int(first[1])
    rotation = av_info.get("rotation", 0) % 360
    if rotation % 90:
        return ProbeFailure(path=p, reason="unsupported_rotation",
                            detail=f"{path.name}: display rotation {rotation} degrees is not a multiple of 90")
    coded = (av_info.get("coded_width"), av_info.get("coded_height"))
    expected = (coded[1], coded[0]) if rotation in (90, 270) else coded
    if None not in coded and (width, height) != expected:
        return ProbeFailure(path=p, reason="rotation_not_applied",
                            detail=f"{path.name}: coded {coded[0]}x{coded[1]} with rotation {rotation} should display "
                                   f"as {expected[0]}x{expected[1]}, decord decodes {width}x{height}")
    ratio = max(width, height) / max(1, min(width, height))
    if ratio > MAX_RATIO:
        return ProbeFailure(path=p, reason="extreme_aspect_ratio",
                            detail=f"{path.name}: {width}x{height} has aspect ratio {ratio:.1f} > {MAX_RATIO}")
    return ProbeResult(
        path=p,
        size_bytes=size,
        frames=frames,
        fps=fps,
        duration_s=frames / fps,
        width=width,
        height=height,
        codec=av_info.get("codec", "unknown"),
        rotation=rotation,
        container_duration_s=av_info.get("container_duration_s"),
    )
