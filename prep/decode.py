"""Stage 6: decode each video once and turn the planned frames into JPEG bytes at their final size.

Two small stages, composed by the build per video file:
    decode_windows  one decord reader walks the windows in time order; each window fetches only the frames
                    the previous window did not have (overlapping windows share decoded frames)
    encode_windows  resize + JPEG of each window's frames in a thread pool, up to `ahead` windows behind the
                    decoder; results come out in window order, so the tar bytes do not depend on threads.
                    Raw RGB of at most ahead + 1 windows is alive (3 by default), whatever the video's length
Both decord (its C++ calls, made through ctypes) and PIL (resize, JPEG encode) release the GIL, so on a
worker with two cores the decoder and the encoder run at the same time; decoding one window at a time is
what lets the encoder start before the whole video is decoded.

Resize: PIL BICUBIC straight to the planned (height, width). qwen-vl-utils resizes with torchvision's
bicubic with antialias=True; PIL's bicubic also widens its kernel when downscaling, so the sizes are
identical and the pixel values differ slightly (a few levels). JPEG quality is --jpeg-quality (95).
"""
from __future__ import annotations

import io
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Executor

import numpy as np
from PIL import Image

from prep import faults


class DecodeError(RuntimeError):
    """decord failed on frames the probe said exist; the remaining windows of that video are rejected."""


def encode_frame(frame: np.ndarray, height: int, width: int, quality: int) -> bytes:
    """HxWx3 uint8 -> JPEG bytes of exactly (height, width)."""
    img = Image.fromarray(frame)
    if img.size != (width, height):
        img = img.resize((width, height), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def decode_windows(path: str, frame_indices: Sequence[Sequence[int]], *, num_threads: int = 1) -> Iterator[tuple[int, list[np.ndarray]]]:
    """Yield (window position, its frames as HxWx3 uint8 arrays at source size) in window order.

    Raises DecodeError when decord fails; frames already yielded stay valid.
    """
    import decord

    try:
        reader = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=num_threads)
    except (decord.DECORDError, RuntimeError) as e:
        raise DecodeError(f"decord cannot reopen {path}: {str(e).strip()[-300:]}") from e
    cache: dict[int, np.ndarray] = {}  # the previous window's frames
    for pos, indices in enumerate(frame_indices):
        if pos:
            faults.maybe_hang("decode", path)
        missing = sorted(set(indices) - cache.keys())
        try:
            batch = reader.get_batch(missing).asnumpy() if missing else []
        except (decord.DECORDError, RuntimeError) as e:
            raise DecodeError(f"decord failed on frames {missing[0]}..{missing[-1]} of {path}: {str(e).strip()[-300:]}") from e
        cache = {i: cache[i] for i in indices if i in cache} | dict(zip(missing, batch))
        yield pos, [cache[i] for i in indices]


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
