"""Manifest v2 fields for records that tests build by hand (the source facts, layout and member digests)."""
from __future__ import annotations

from schemas.shard import ids_sha256


def v2_fields(num_frames: int, *, fps: float = 2.0, frames: int = 10_000, width: int = 64, height: int = 64,
              layout: str = "nested", input_ids: list[int] | None = None, frame_sha256: list[str] | None = None) -> dict:
    """The SampleRecord fields schema v2 added, with plausible values (digests of nothing in particular
    unless the real ones are given)."""
    return dict(source_fps=fps, source_frames=frames, source_width=width, source_height=height, source_codec="h264",
                source_rotation=0, prompt_layout=layout,
                frame_sha256=frame_sha256 if frame_sha256 is not None else ["0" * 64] * num_frames,
                input_ids_sha256=ids_sha256(input_ids) if input_ids is not None else "0" * 64)
