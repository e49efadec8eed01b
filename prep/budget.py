"""The one place that decides how many frames a window gets and what size they are.

The rule is qwen-vl-utils 0.0.14 (`smart_nframes`, `calculate_video_frame_range`, `fetch_video`'s pixel
bounds), because that is what ms-swift, and therefore the original Video-ORA model, fed the model. Above the
per-frame minimum, transformers' `Qwen3VLVideoProcessor(cap_pixels_per_frame=True,
max_video_tokens=VIDEO_MAX_TOKEN_NUM)` gives the same grid. Below it they differ (a 480x270 source: this
rule upsamples to 512x288, the HF processor keeps 480x256); tests pin both facts.

prep, train, predict and the tests all call these functions; nothing else computes a grid.
"""
from __future__ import annotations

import dataclasses
import math
import os

FRAME_FACTOR = 2  # temporal patch size: frames per temporal group
SPATIAL_MERGE = 2  # 2x2 patches become one LLM token
MAX_RATIO = 200
DEFAULT_VIDEO_MIN_TOKENS = 128
DEFAULT_VIDEO_MAX_TOKENS = 768
DEFAULT_MODEL_SEQ_LEN = 128000
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768

PATCH_SIZE = {"qwen3_vl": 16, "qwen3_5": 16, "qwen2_5_vl": 14}


@dataclasses.dataclass(frozen=True, kw_only=True)
class VideoBudget:
    """Per-frame token bounds and the family's patch geometry; goes into build.json verbatim."""

    model_family: str = "qwen3_vl"
    video_min_tokens: int = DEFAULT_VIDEO_MIN_TOKENS  # VIDEO_MIN_TOKEN_NUM
    video_max_tokens: int = DEFAULT_VIDEO_MAX_TOKENS  # VIDEO_MAX_TOKEN_NUM
    model_seq_len: int = DEFAULT_MODEL_SEQ_LEN  # MODEL_SEQ_LEN: qwen-vl-utils' whole-video pixel cap
    fps: float = 2.0
    min_frames: int = FPS_MIN_FRAMES
    max_frames: int = FPS_MAX_FRAMES

    def __post_init__(self) -> None:
        if self.model_family not in PATCH_SIZE:
            raise ValueError(f"unknown model family {self.model_family!r}; known: {sorted(PATCH_SIZE)}")
        if not 0 < self.video_min_tokens <= self.video_max_tokens:
            raise ValueError(
                f"need 0 < video_min_tokens <= video_max_tokens, got {self.video_min_tokens}, {self.video_max_tokens}"
            )

    @property
    def patch_size(self) -> int:
        return PATCH_SIZE[self.model_family]

    @property
    def factor(self) -> int:
        return self.patch_size * SPATIAL_MERGE

    @classmethod
    def from_env(cls, **overrides) -> "VideoBudget":
        """Read VIDEO_MIN_TOKEN_NUM / VIDEO_MAX_TOKEN_NUM / MODEL_SEQ_LEN like ms-swift; explicit values win."""
        env = {
            "video_min_tokens": os.environ.get("VIDEO_MIN_TOKEN_NUM"),
            "video_max_tokens": os.environ.get("VIDEO_MAX_TOKEN_NUM"),
            "model_seq_len": os.environ.get("MODEL_SEQ_LEN"),
        }
        values = {k: int(float(v)) for k, v in env.items() if v not in (None, "")}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FramePlan:
    """What one window feeds the model: which source frames, at which size, as which grid."""

    frame_indices: list[int]
    height: int
    width: int
    grid_t: int
    grid_h: int
    grid_w: int

    @property
    def visual_tokens(self) -> int:
        return self.grid_t * self.grid_h * self.grid_w // (SPATIAL_MERGE**2)

    @property
    def tokens_per_group(self) -> int:
        return self.grid_h * self.grid_w // (SPATIAL_MERGE**2)


def round_by_factor(x: float, factor: int) -> int:
    return round(x / factor) * factor


def ceil_by_factor(x: float, factor: int) -> int:
    return math.ceil(x / factor) * factor


def floor_by_factor(x: float, factor: int) -> int:
    return math.floor(x / factor) * factor


def window_frame_range(start_s: float, end_s: float, total_frames: int, fps: float) -> tuple[int, int]:
    """First and last source frame of a window (inclusive), as qwen-vl-utils' video_start/video_end."""
    if fps <= 0 or total_frames <= 0:
        raise ValueError(f"need fps > 0 and frames > 0, got fps={fps}, frames={total_frames}")
    duration = total_frames / fps
    first = math.ceil(max(0.0, min(start_s, duration)) * fps)
    last = min(math.floor(max(0.0, min(end_s, duration)) * fps), total_frames - 1)
    if first >= last:
        raise ValueError(f"window {start_s:.3f}-{end_s:.3f}s holds fewer than 2 frames at {fps:.3f} fps")
    return first, last


def num_frames(budget: VideoBudget, frame_count: int, fps: float) -> int:
    """smart_nframes: frames at budget.fps within [min_frames, max_frames], even, at most frame_count."""
    min_frames = ceil_by_factor(budget.min_frames, FRAME_FACTOR)
    max_frames = floor_by_factor(min(budget.max_frames, frame_count), FRAME_FACTOR)
    n = frame_count / fps * budget.fps
    n = floor_by_factor(min(max(n, min_frames), max_frames, frame_count), FRAME_FACTOR)
    if not FRAME_FACTOR <= n <= frame_count:
        raise ValueError(f"a window of {frame_count} frames cannot give an even count >= {FRAME_FACTOR}")
    return n


def sample_indices(first: int, last: int, n: int) -> list[int]:
    """n evenly spaced frame numbers from first to last inclusive: qwen-vl-utils' torch.linspace().round() (torch's
    float32 steps decide the ties). Imported here: `prep build --help` and `prep inspect` need no torch (1 s)."""
    import torch

    return torch.linspace(first, last, n).round().long().tolist()


def frame_size(budget: VideoBudget, height: int, width: int, n_frames: int) -> tuple[int, int]:
    """Resized (height, width): qwen-vl-utils' per-frame pixel bounds applied through smart_resize."""
    f = budget.factor
    min_pixels = budget.video_min_tokens * f * f
    total_pixels = budget.model_seq_len * f * f * 0.9
    max_pixels = max(min(budget.video_max_tokens * f * f, total_pixels / n_frames * FRAME_FACTOR), int(min_pixels * 1.05))
    return smart_resize(height, width, f, min_pixels, max_pixels)


def smart_resize(height: int, width: int, factor: int, min_pixels: float, max_pixels: float) -> tuple[int, int]:
    """Both sides divisible by factor, pixels within [min_pixels, max_pixels], aspect ratio kept."""
    if min(height, width) <= 0:
        raise ValueError(f"frame size {width}x{height} is empty")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_RATIO:
        raise ValueError(f"aspect ratio {ratio:.1f} exceeds {MAX_RATIO} ({width}x{height})")
    h = max(factor, round_by_factor(height, factor))
    w = max(factor, round_by_factor(width, factor))
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = floor_by_factor(height / beta, factor)
        w = floor_by_factor(width / beta, factor)
        if h == 0 or w == 0:
            # qwen-vl-utils computes the same 0 here and then fails inside torchvision's resize
            raise ValueError(
                f"{width}x{height} at most {max_pixels:.0f} pixels leaves a side under {factor} pixels"
            )
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = ceil_by_factor(height * beta, factor)
        w = ceil_by_factor(width * beta, factor)
    return h, w


def plan_frames(
    budget: VideoBudget,
    *,
    height: int,
    width: int,
    fps: float,
    total_frames: int,
    start_s: float,
    end_s: float,
    max_frames: int | None = None,
) -> FramePlan:
    """Frames and grid for the window [start_s, end_s) of a video; max_frames lowers the count further."""
    first, last = window_frame_range(start_s, end_s, total_frames, fps)
    n = num_frames(budget, last - first + 1, fps)
    if max_frames is not None:
        n = min(n, floor_by_factor(max_frames, FRAME_FACTOR))
        if n < FRAME_FACTOR:
            raise ValueError(f"max_frames={max_frames} leaves fewer than {FRAME_FACTOR} frames")
    h, w = frame_size(budget, height, width, n)
    p = budget.patch_size
    return FramePlan(
        frame_indices=sample_indices(first, last, n),
        height=h,
        width=w,
        grid_t=n // FRAME_FACTOR,
        grid_h=h // p,
        grid_w=w // p,
    )


def group_times(frame_times_s: list[float], window_start_s: float) -> list[float]:
    """Window-local time of each temporal group: the mean of its first and last frame, as the Qwen3-VL
    processor computes the `<t seconds>` text (there from frame index / fps)."""
    local = [t - window_start_s for t in frame_times_s]
    return [(local[i] + local[i + FRAME_FACTOR - 1]) / 2 for i in range(0, len(local), FRAME_FACTOR)]
