"""Learnability, ci profile: the whole pipeline (synthetic videos -> prep build -> train.main -> predict ->
evaluate) must teach a small random Qwen3-VL to find the visible events on held-out videos.

The slowest test of the suite (about 2 minutes on 2 idle CPU cores, several under load): marked `slow` and `learnability`, so
`pytest -m "not learnability"` skips it. The full profile (GPU) and its numbers live in BENCHMARKS.md.
"""
from __future__ import annotations

import json

import pytest

from scripts.learnability import PROFILES, run_learnability


@pytest.mark.slow
@pytest.mark.learnability
@pytest.mark.timeout(1800)  # minutes on a loaded 2-core box (592 s seen with 4 other jobs); the suite default is 600 s
def test_ci_profile_learns_held_out_events(tmp_path):
    profile = PROFILES["ci"]
    result = run_learnability(tmp_path / "learn", "ci", device="cpu", log=lambda _: None)
    before = result["before"]
    tests = result["tests"]
    summary = json.dumps({"before": {k: v for k, v in before.items() if k != "examples"},
                          "after": {n: {k: v for k, v in t["after"].items() if k != "examples"} for n, t in tests.items()},
                          "examples_after": {n: t["after"]["examples"] for n, t in tests.items()}}, indent=1)

    # the untrained model cannot do the task: it must not already pass
    assert before["miou"] < 0.1, summary
    assert before["valid_rate"] < 0.5, summary
    # trained on other videos, it answers in the training format and finds the events in every held-out set
    # (one per video length; 40 s is longer than any training video)
    assert set(tests) == {f"{d:g}s" for d in profile.test_durations}, summary
    for t in tests.values():
        after = t["after"]
        assert after["valid_rate"] >= profile.min_valid_rate, summary
        assert after["degenerate_rate"] <= 1 - profile.min_valid_rate, summary
        assert after["miou"] >= profile.min_miou, summary
        assert after["miou"] >= before["miou"] + 0.2, summary
    assert result["loss_last10"] < result["loss_first"] / 3, summary
    assert (tmp_path / "learn" / "learnability.json").is_file()
