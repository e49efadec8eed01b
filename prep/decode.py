"""Stage 6: decode each video once and turn the planned frames into JPEG bytes at their final size.

All windows of a video are served from one decord reader, walking the windows in time order and fetching
the union of their frame indices in chunks (bounded by chunk_bytes of raw RGB), so overlapping windows
share decoded frames and memory stays bounded on long videos.

Resize: PIL BICUBIC straight to the planned (height, width). qwen-vl-utils resizes with torchvision's
bicubic with antialias=True; PIL's bicubic also widens its kernel when downscaling, so the sizes are
identical and the pixel values differ slightly (a few levels). JPEG quality is --jpeg-quality (95).
"""
from __future__ import annotations

import io
from collections.abc import Iterator, Sequence

import numpy as np
from PIL import Image

DEFAULT_CHUNK_BYTES = 256 * 2**20


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


def _chunks(windows: Sequence[Sequence[int]], frame_bytes: int, chunk_bytes: int) -> list[list[int]]:
    """Consecutive runs of window positions whose union of frames fits chunk_bytes (at least one window)."""
    runs, run, frames = [], [], set()
    for i, idx in enumerate(windows):
        grown = frames | set(idx)
        if run and len(grown) * frame_bytes > chunk_bytes:
            runs.append(run)
            run, grown = [], set(idx)
        run.append(i)
        frames = grown
    if run:
        runs.append(run)
    return runs


def decode_windows(
    path: str,
    frame_indices: Sequence[Sequence[int]],
    *,
    width: int,
    height: int,
    num_threads: int = 1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[tuple[int, list[np.ndarray]]]:
    """Yield (window position, its frames as HxWx3 uint8 arrays at source size) in window order.

    width/height are the probed (displayed) source size, used only to size the chunks. Raises DecodeError
    when decord fails; frames already yielded stay valid.
    """
    import decord

    try:
        reader = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=num_threads)
    except (decord.DECORDError, RuntimeError) as e:
        raise DecodeError(f"decord cannot reopen {path}: {str(e).strip()[-300:]}") from e
    cache: dict[int, np.ndarray] = {}
    for run in _chunks(frame_indices, width * height * 3, chunk_bytes):
        needed = sorted({i for w in run for i in frame_indices[w]})
        missing = [i for i in needed if i not in cache]
        try:
            batch = reader.get_batch(missing).asnumpy() if missing else []
        except (decord.DECORDError, RuntimeError) as e:
            raise DecodeError(f"decord failed on frames {missing[0]}..{missing[-1]} of {path}: {str(e).strip()[-300:]}") from e
        cache = {i: cache[i] for i in needed if i in cache} | dict(zip(missing, batch))
        for w in run:
            yield w, [cache[i] for i in frame_indices[w]]
