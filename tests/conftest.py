"""Shared fixtures: a small synthetic video dir and one real `prep build` of it, built once per session.

`built_shards` is read-only for every test (session scope): copy it to tmp_path before changing anything.
It is built in-process with BUILT_SHARDS_ARGS: 4 videos of 20 s at 8 fps, 160x96 (one portrait 96x160),
8 s windows -> 3 windows each (the last 4 s long), 12 samples in 2 shards, 16..64 tokens per frame.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from scripts.synth_videos import VideoSpec, write_dataset

SYNTH_SPECS = [
    VideoSpec(name="vid_a", duration_s=20.0, fps=8.0, width=160, height=96, events=((1.0, 5.5), (9.0, 17.2)), seed=1),
    VideoSpec(name="vid_b", duration_s=20.0, fps=8.0, width=160, height=96, events=(), seed=2),
    VideoSpec(name="vid_c", duration_s=20.0, fps=8.0, width=96, height=160, events=((15.0, 19.5),), seed=3),
    VideoSpec(name="vid_d", duration_s=20.0, fps=8.0, width=160, height=96, events=((7.8, 8.3), (3.0, 4.0)), seed=4),
]
BUILT_SHARDS_ARGS = dict(
    window_seconds=8.0,
    video_min_tokens=16,
    video_max_tokens=64,
    samples_per_shard=6,
    workers=1,
    progress=False,
)


@pytest.fixture(scope="session")
def synth_videos_dir(tmp_path_factory) -> Path:
    """Directory with SYNTH_SPECS' videos and their annotations.jsonl (the `prep build` input)."""
    return write_dataset(tmp_path_factory.mktemp("synth_videos"), SYNTH_SPECS)


@pytest.fixture(scope="session")
def built_shards(synth_videos_dir, tmp_path_factory) -> Path:
    """SHARDS directory of `prep build` over synth_videos_dir (manifest.parquet, shards, build.json)."""
    from prep.build import BuildConfig, build

    out = tmp_path_factory.mktemp("built_shards")
    summary = build(BuildConfig(videos=synth_videos_dir, out=out, **BUILT_SHARDS_ARGS))
    assert summary["samples"] == 12 and summary["rejects"] == 0, summary
    return out


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """A cache dir holding both tiny random models (tiny_qwen3_vl, tiny_qwen3_5); read-only for tests."""
    from train.models import ensure_tiny_model

    cache = tmp_path_factory.mktemp("tiny_models")
    for family in ("qwen3_vl", "qwen3_5"):
        ensure_tiny_model(family, cache)
    return cache
