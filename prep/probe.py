"""Stage 2: probe a video file once, before anything is planned.

decord is the decoder the build uses, so decord's frame count and average fps are the truth (duration =
frames / fps, the same rule qwen-vl-utils' decord backend uses). PyAV is the second opinion: it names the
codec when decord cannot open a file, reads the coded size and the display rotation, and gives the container
duration.

Cut-off files: decord counts the packets it can demux, so a file cut at a packet boundary is a shorter video;
one cut inside a packet is rejected (corrupt_video) because that packet, the stream's last, comes out of the
demuxer flagged corrupt. PyAV reads only the last GOP's packets for that (~1 ms a clip): decoding the last
frame instead, as earlier versions did, cost ~50 of the probe's ~70 ms on a 30 s 640x360 clip (BENCHMARKS.md,
Prep, session 16).

Rotation: decord 0.6 applies the display matrix for multiples of 90 degrees (a portrait phone clip stored
as 1280x720 with rotation 90 decodes as 720x1280), so width/height here are the DISPLAYED size: PyAV's coded
size with its rotation applied. For 90 and 270 degrees decord's first frame is decoded to check that decord
turns it too; without a quarter turn there is nothing to check, and that decode was half the probe's CPU (27 ->
12 ms CPU a 640x360 clip, BENCHMARKS.md, Prep, session 20). Any other angle is rejected (unsupported_rotation):
decord would return the frames unrotated. A stream whose frames do not decode is rejected where the build
decodes it (decode_error), with the frames it names.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from prep import faults
from prep.budget import MAX_RATIO
from prep.decoders import last_line

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


def _pyav_probe(path: Path, frames: int | None = None, fps: float | None = None) -> dict:
    """Codec, coded size, rotation and container duration from PyAV; {'error': ...} when it cannot. Given decord's
    frame count and fps, also 'cut_off': why the stream's last packets are not whole ('' when they are)."""
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
            if frames and fps:
                info["cut_off"] = _cut_off(container, stream, frames, fps)
            return info
    except av.FFmpegError as e:
        return {"error": str(e)}


def _cut_off(container, stream, frames: int, fps: float) -> str:
    """Why the last GOP's packets are not whole ('' when they are): demuxed from the keyframe before the last
    frame's time, none may come out flagged corrupt (cut short by the end of the file) or fail to read."""
    import av

    start = stream.start_time or 0
    last_s = (frames - 1) / fps
    try:
        container.seek(start + int(last_s / stream.time_base), stream=stream, backward=True, any_frame=False)
    except av.FFmpegError:
        pass  # a file FFmpeg cannot seek in is read from where it is (after its first frame) to its end
    try:
        for packet in container.demux(stream):
            if packet.size and packet.is_corrupt:
                at = f"{float((packet.pts - start) * stream.time_base):.2f} s" if packet.pts is not None else "the end"
                return f"its packet at {at} is cut short ({packet.size} bytes left)"
    except av.FFmpegError as e:
        return f"reading its last packets fails: {e}"
    return ""


def probe_video(path: str | Path, num_threads: int = 1) -> ProbeResult | ProbeFailure:
    """Probe one file; never raises for a bad file (a bad file is data), only for a code error."""
    import decord

    path = Path(path)
    p = str(path)
    faults.maybe_hang("probe", p)
    size = path.stat().st_size
    if size == 0:
        return ProbeFailure(path=p, reason="zero_byte_file", detail=f"{path.name} is empty (0 bytes)")
    try:
        reader = decord.VideoReader(p, ctx=decord.cpu(0), num_threads=num_threads)
        frames = len(reader)
        fps = float(reader.get_avg_fps())
    except (decord.DECORDError, RuntimeError) as e:
        message = last_line(e)
        av_info = _pyav_probe(path)
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
    av_info = _pyav_probe(path, frames, fps if math.isfinite(fps) and fps > 0 else None)
    if av_info.get("no_video"):
        return ProbeFailure(path=p, reason="no_video_stream", detail=f"{path.name}: PyAV finds no video stream")
    if av_info.get("cut_off"):
        return ProbeFailure(path=p, reason="corrupt_video",
                            detail=f"{path.name} ({size} bytes) is cut off: {av_info['cut_off']} (truncated?)")
    if frames < 2:
        return ProbeFailure(path=p, reason="too_few_frames", detail=f"{path.name} has {frames} frame(s); a window needs >= 2")
    if not (math.isfinite(fps) and fps > 0):
        return ProbeFailure(path=p, reason="bad_fps", detail=f"{path.name}: decord reports fps={fps}")
    rotation = av_info.get("rotation", 0) % 360
    if rotation % 90:
        return ProbeFailure(path=p, reason="unsupported_rotation",
                            detail=f"{path.name}: display rotation {rotation} degrees is not a multiple of 90")
    coded = (av_info.get("coded_width"), av_info.get("coded_height"))
    width, height = (coded[1], coded[0]) if rotation in (90, 270) else coded
    # decord's first frame: the quarter turn it must apply, or the size PyAV could not tell (no coded size, or
    # no decoded frame to read the rotation from)
    if rotation in (90, 270) or None in coded or "decode_error" in av_info:
        try:
            decoded = reader[0].shape
        except (decord.DECORDError, RuntimeError) as e:
            return ProbeFailure(path=p, reason="corrupt_video",
                                detail=f"{path.name}: decord cannot decode its first frame: {last_line(e)}")
        if None in coded:
            width, height = int(decoded[1]), int(decoded[0])
        elif (decoded[1], decoded[0]) != (width, height):
            return ProbeFailure(path=p, reason="rotation_not_applied",
                                detail=f"{path.name}: coded {coded[0]}x{coded[1]} with rotation {rotation} should "
                                       f"display as {width}x{height}, decord decodes {decoded[1]}x{decoded[0]}")
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
