"""Stage 6: decode each video once and turn the planned frames into JPEG bytes at their final size.

Three small stages, composed by the build per video file:
    decode_windows  one reader (prep/decoders.py: decord, torchcodec or PyAV) walks the windows in time order;
                    each window fetches only the frames the previous window did not have (overlapping windows
                    share decoded frames)
    read_ahead      runs the decoder in a thread of its own, one window ahead, so it keeps decoding while the
                    caller writes the tar, hashes frames and builds records (measured on the 2-core box: the
                    main thread's part of a 2-window 640x360 shard is ~0.1 s next to ~0.36 s of decoding)
    encode_windows  resize + JPEG of each window's frames in a thread pool, up to `ahead` windows behind the
                    decoder; results come out in window order, so the tar bytes do not depend on threads.
                    Raw RGB of at most ahead + 3 windows is alive (5 by default: ahead + 1 waiting for or in
                    the encoder, one queued by read_ahead, one being decoded), whatever the video's length
The decoders (C/C++ calls), torch's resize and PIL's JPEG encoder all release the GIL, so on a worker with
two cores the decoder and the encoder run at the same time; decoding one window at a time is what lets the
encoder start before the whole video is decoded.

Resize (RESIZE): torch's uint8 bicubic with antialias=True straight to the planned (height, width), one
intra-op thread per worker. That is the rule qwen-vl-utils applies (torchvision's resize of the decoded
uint8 frames, bicubic, antialias=True), computed by torch's vectorized uint8 kernel: 7-10x less CPU than PIL's
bicubic (CPU ms per frame, medians on the 2-core bench box: 640x360 -> 640x352 0.12 vs 1.25, 640x272 -> 640x256
0.11 vs 0.84, 1280x720 -> 640x352 0.82 vs 6.48, 1280x720 -> 1280x704 0.61 vs 5.22). Tolerance, tested (tests/test_decoders.py): within 1 level (max absolute
difference; mean <= 0.01) of PIL's bicubic, which the build used before and `prep verify` re-decodes with,
and within 3 levels (mean <= 0.2; measured 0.13 on a 2x downscale) of qwen-vl-utils' torchvision path,
exactly as close as PIL was (torchvision rounds its own way on downscales).
JPEG quality is --jpeg-quality (95), PIL (libjpeg-turbo).
"""
from __future__ import annotations

import contextvars
import io
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Executor

import numpy as np
from PIL import Image

from prep import faults
from prep.decoders import REFERENCE_BACKEND, DecodeError, open_reader

RESIZE = ("torch uint8 bicubic, antialias=True, to the planned size (within 1 level of PIL bicubic; within 3 "
          "levels of qwen-vl-utils' torchvision bicubic antialias, as PIL)")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
__all__ = ["DecodeError", "RESIZE", "decode_windows", "encode_frame", "encode_windows", "keep_freed_buffers", "read_ahead",
           "resize_frame"]


def keep_freed_buffers() -> None:
    """Keep the memory of freed frame buffers in this process for the next window. glibc hands a freed large buffer
    back to the kernel (munmap, heap trim), so every window's frames faulted their pages in again, zeroed: ~130,000
    page faults and 5-8% of a shard's CPU on the 2-core box, with decord and torchcodec alike (BENCHMARKS.md, Prep,
    session 17). After this, buffers up to 32 MiB (glibc's largest mmap threshold) come from the heap and up to
    512 MiB of free heap is kept; the peak memory is the same. For worker processes (glibc's settings are
    process-wide); a no-op where libc has no mallopt."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 512 << 20)
    except (OSError, AttributeError):
        pass


def resize_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """HxWx3 uint8 -> (height, width, 3) uint8 by RESIZE (the frame itself when it already has that size)."""
    if frame.shape[:2] == (height, width):
        return frame
    import torch
    import torch.nn.functional as F

    # (1, 3, H, W), channels last, with the canonical batch stride H*W*3 (a view, no copy): unsqueeze or
    # frame[None] give batch strides 3 or 0, which the kernel takes 2-3x slower
    h, w = frame.shape[:2]
    x = torch.from_numpy(frame).reshape(1, h, w, 3).permute(0, 3, 1, 2)
    out = F.interpolate(x, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    return out[0].permute(1, 2, 0).contiguous().numpy()


def encode_frame(frame: np.ndarray, height: int, width: int, quality: int) -> bytes:
    """HxWx3 uint8 -> JPEG bytes of exactly (height, width)."""
    buf = io.BytesIO()
    Image.fromarray(resize_frame(frame, height, width)).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def decode_windows(path: str, frame_indices: Sequence[Sequence[int]], *, backend: str = REFERENCE_BACKEND,
                   num_threads: int = 1, rotation: int = 0) -> Iterator[tuple[int, list[np.ndarray]]]:
    """Yield (window position, its frames as HxWx3 uint8 arrays at source size) in window order.

    Raises DecodeError when the decoder fails; frames already yielded stay valid.
    """
    yield from read_windows(open_reader(backend, path, num_threads=num_threads, rotation=rotation), path,
                            frame_indices)


def read_windows(reader, path: str, frame_indices: Sequence[Sequence[int]]) -> Iterator[tuple[int, list]]:
    """Yield (window position, its frames) from `reader` (any backend's get_batch, CPU or GPU), decoding only
    the frames the previous window did not have; closes the reader at the end."""
    try:
        cache: dict = {}  # the previous window's frames
        for pos, indices in enumerate(frame_indices):
            if pos:
                faults.maybe_hang("decode", path)
                faults.maybe_kill("decode", path)
            missing = sorted(set(indices) - cache.keys())
            batch = reader.get_batch(missing) if missing else []
            cache = {i: cache[i] for i in indices if i in cache} | dict(zip(missing, batch))
            yield pos, [cache[i] for i in indices]
    finally:
        reader.close()


def read_ahead(items: Iterator, depth: int = 1) -> Iterator:
    """The items of `items`, produced in a thread of its own up to `depth` ahead of the caller (in a copy of the
    caller's context). An exception of `items` is raised here after the items before it; leaving early closes
    `items` in its thread."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def put(entry) -> bool:
        while not stop.is_set():  # the caller may have left: never block on a queue nobody reads
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    break
            else:
                put((end, None))
        except BaseException as e:  # handed to the caller, who raises it
            put((end, e))
        finally:
            if stop.is_set():
                items.close()  # e.g. the reader's close() in decode_windows' finally

    # in a copy of the caller's context: the decoder's heartbeats count for the caller's task (prep/workers.py)
    thread = threading.Thread(target=contextvars.copy_context().run, args=(produce,), name="decode", daemon=True)
    thread.start()
    try:
        while True:
            item, error = q.get()
            if item is end:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
        thread.join()


def _encode_timed(frame: np.ndarray, height: int, width: int, quality: int) -> tuple[bytes, float]:
    t0 = time.perf_counter()
    return encode_frame(frame, height, width, quality), time.perf_counter() - t0


def encode_windows(decoded: Iterable[tuple[int, list[np.ndarray]]], sizes: Sequence[tuple[int, int]], quality: int,
                   pool: Executor, ahead: int = 2) -> Iterator[tuple[int, list[bytes], float]]:
    """(pos, frames) -> (pos, JPEG bytes, seconds spent encoding them), in the input order.

    sizes[pos] is the (height, width) of window pos. While a window is encoded in the pool, the next ones
    are decoded; at most `ahead` windows wait for their JPEGs (memory stays bounded). A DecodeError from
    `decoded` is re-raised after the windows decoded before it have been yielded.
    """
    pending: deque = deque()

    def finish():
        pos, futures = pending.popleft()
        done = [f.result() for f in futures]
        return pos, [b for b, _ in done], sum(s for _, s in done)

    try:
        for pos, frames in decoded:
            height, width = sizes[pos]
            pending.append((pos, [pool.submit(_encode_timed, f, height, width, quality) for f in frames]))
            if len(pending) > ahead:
                yield finish()
    except DecodeError:
        while pending:
            yield finish()
        raise
    while pending:
        yield finish()
