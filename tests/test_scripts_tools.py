"""Offline parts of scripts/bench_prep.py and scripts/build_wheelhouse.py (the runs themselves are not CI:
the bench takes minutes, the wheelhouse needs the package registry), and scripts/cpu_timeline.py and
scripts/ab_build.py on small inputs."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from scripts.bench_prep import _rounds, ratio_lines, write_annotations, write_markdown
from scripts.build_wheelhouse import applies, pin, target_env, wheel_requirements


def test_markdown_replaces_only_the_benchs_own_lines(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    write_markdown(md, "first\n")
    assert md.read_text().startswith("# Benchmarks") and "## Prep\n\n" in md.read_text() and "first" in md.read_text()
    md.write_text(md.read_text() + "\nhand-written reading\n\n### 16 cores, an earlier run\n\nits table\n"
                  "\n## Train\n\ntrain numbers\n")
    write_markdown(md, "second\n")
    text = md.read_text()
    assert "second" in text and "first" not in text and text.count("## Prep") == 1
    assert text.index("second") < text.index("hand-written reading") < text.index("### 16 cores, an earlier run\n\nits table")
    assert "## Train\n\ntrain numbers" in text
    # a Prep section written before the marks existed keeps all it had; the bench's lines go first
    old = tmp_path / "old.md"
    old.write_text("# Benchmarks\n\n## Prep\n\nCommand: old\n\n### 2 cores, session 16\n\nhistory\n\n## Train\n\nt\n")
    write_markdown(old, "new run\n")
    text = old.read_text()
    assert text.index("## Prep") < text.index("new run") < text.index("Command: old") < text.index("history")
    assert text.endswith("## Train\n\nt\n")


def test_bench_annotates_every_video(tmp_path):
    (tmp_path / "a").mkdir()
    for name in ("a/x.mp4", "y.mkv", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert write_annotations(tmp_path, tmp_path / "ann.jsonl") == 2
    assert '"video": "a/x.mp4"' in (tmp_path / "ann.jsonl").read_text()


def test_bench_warm_up_choice_and_every_ratio_at_every_worker_count():
    calls = []
    legs = {leg: (lambda w, leg=leg: calls.append((leg, w)) or (10, 1.0)) for leg in ("build", "fetch", "floor")}
    for warm_up, untimed in (("each", 6), ("once", 3), ("none", 0)):
        calls.clear()
        runs = {leg: {1: [], 4: []} for leg in legs}
        cpu = {leg: {1: [], 4: []} for leg in legs}
        _rounds(legs, list(legs), dict.fromkeys(legs, 10), [1, 4], 2, runs, cpu, warm_up)
        assert len(calls) == untimed + 12 and all(len(r) == 2 for by_w in runs.values() for r in by_w.values())
        if warm_up == "once":
            assert {w for _, w in calls[:3]} == {4}
    res = {"median_s": {"build": {1: 8.0, 16: 2.0}, "floor": {16: 1.5}},
           "median_cpu_s": {"build": {16: 24.0}, "floor": {16: 21.0}},
           "ratios": {"build_over_fetch": {1: 0.5, 16: 0.25}, "fetch_over_build": {1: 2.0, 16: 4.0},
                      "build_over_floor": {1: 1.1, 16: 1.25}, "cpu_build_over_floor": {1: 1.2, 16: 1.3},
                      "cpu_fetch_over_build": {1: 2.5, 16: 4.5}},
           "realtime": {"build": {1: {"machine": 120.0, "per_core": 40.0}, 16: {"machine": 480.0, "per_core": 39.0}}}}
    lines = ratio_lines(res)
    assert lines[2] == "| 1 | 0.50x | 2.00x | 1.10x | 1.20x | 2.50x | 120.0 | 40.0 | - / - |"
    assert lines[3].startswith("| 16 | 0.25x | 4.00x | 1.25x | 1.30x |") and lines[3].endswith("| 12.0 / 14.0 |")
    assert len(lines) == 4


def test_a_leg_helper_that_dies_is_an_error_at_once_not_a_wait():
    """Session 23: a helper whose Ray could not start died before answering and the bench waited its whole timeout
    (600 s of device time). A leg the helper does not know kills it the same way, after its "ready"."""
    from scripts.bench_prep import LegHelper

    helper = LegHelper("no-such-leg", timeout_s=300)
    try:
        with pytest.raises(RuntimeError, match="no-such-leg leg's helper exited with code 1"):
            helper()
    finally:
        helper.close()


def test_wheelhouse_markers_follow_the_target_python(tmp_path):
    env = target_env("3.12")
    assert applies(Requirement('tomli; python_version < "3.11"'), set(), target_env("3.10"))
    assert not applies(Requirement('tomli; python_version < "3.11"'), set(), env)
    assert not applies(Requirement('pywin32; sys_platform == "win32"'), set(), env)
    assert applies(Requirement('aiohttp; extra == "http"'), {"http"}, env)
    assert not applies(Requirement('aiohttp; extra == "http"'), set(), env)
    assert pin("packaging", SpecifierSet(">=1")).startswith("packaging==")  # installed here: pinned
    assert pin("no-such-package-xyz", SpecifierSet(">=2")) == "no-such-package-xyz>=2"

    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n"
                                                  "Requires-Dist: numpy>=1.20\nRequires-Dist: torch\n")
    assert [str(r) for r in wheel_requirements(wheel)] == ["numpy>=1.20", "torch"]


def test_bench_prep_names_missing_packages_before_it_starts_a_pool():
    """A worker initializer that raises makes multiprocessing.Pool respawn workers forever (seen on the device:
    qwen-vl-utils absent, the fetch leg spun until the call's timeout), so imports are checked up front."""
    import argparse

    from scripts.bench_prep import missing_packages

    assert missing_packages(argparse.Namespace(decoder="decord", ray=False)) == []  # the test environment has them
    got = missing_packages(argparse.Namespace(decoder="no_such_decoder_pkg", ray=False))
    assert got == ["no_such_decoder_pkg for --decoder no_such_decoder_pkg"]


def test_cpu_timeline_counts_the_cores_a_command_keeps_busy(capsys):
    import json
    import sys

    from scripts.cpu_timeline import main

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\nraise SystemExit(3)"
    assert main(["--every", "0.02", "--", sys.executable, "-c", spin]) == 3  # the command's own exit status
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    summary = lines[-1]["summary"]
    assert summary["rc"] == 3 and summary["machine_cpu_s"] >= 0.4  # whole machine: at least the spin's CPU
    assert len(lines) > 10 and max(s["busy_cores"] for s in lines[:-1]) >= 0.5


def test_ab_build_alternates_the_trees_and_the_floor_and_reports_every_stage(synth_videos_dir):
    """Two sides (the same tree twice) and the floor, one untimed and two timed rounds each (the floor needs a
    build's frames, so it runs after the first); every build's stages and its shard commits (timed in the forked
    workers) come back."""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "scripts.ab_build", "--tree", f"a={repo}", "--tree", f"b={repo}",
                           "--videos", str(synth_videos_dir), "--rounds", "2", "--workers", "1"],
                          cwd=repo, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    rows, result = lines[:-1], lines[-1]
    assert sorted((r["side"], r["round"]) for r in rows) == sorted(
        [(side, r) for side in ("a", "b", "floor") for r in (0, 1, 2)])
    medians = result["medians"]
    assert list(medians) == ["a", "b", "floor"] and medians["a"]["vs_a"] == 1.0
    for side in ("a", "b"):
        assert all(medians[side][k] > 0 for k in ("wall_s", "cpu_s", "probe", "shards", "total", "commits_s"))
        assert medians[side]["total"] <= medians[side]["wall_s"]
        wall = {(x["side"], x["round"]): x["wall_s"] for x in rows}  # each round's build over that round's floor
        paired = statistics.median(round(wall[side, r] / wall["floor", r], 3) for r in (1, 2))
        assert medians[side]["paired_vs_floor"] == round(paired, 4)
    for row in rows:  # the machine's CPU during a run holds at least the run's own
        assert row["machine_cpu_s"] >= 0.8 * row["cpu_s"] and 0 <= row["steal_pct"] < 100


def test_frame_costs_prices_decode_resize_and_jpeg_per_sampled_frame(synth_videos_dir):
    """Every decoder asked is timed over the same sampled frames, and the headline ratio is resize + JPEG over
    each decoder's own decode."""
    from scripts.frame_costs import measure, windows_of

    clip = sorted(synth_videos_dir.glob("*.mp4"))[0]
    windows = windows_of(clip)
    assert windows and all(w == sorted(set(w)) for w in windows)
    assert all(b[0] > a[-1] for a, b in zip(windows, windows[1:]))  # consecutive windows, in time order
    res = measure(synth_videos_dir, clips=1, rounds=1, decoders=["decord", "pyav"], size=(64, 96), quality=90)
    assert res["sampled_frames"] == sum(len(w) for w in windows) and set(res["decode_ms"]) == {"decord", "pyav"}
    for d, ms in res["decode_ms"].items():
        assert ms > 0 and res["runs"]["decode_ms"][d] == [ms]
        assert res["resize_jpeg_over_decode"][d] == round((res["resize_ms"] + res["jpeg_ms"]) / ms, 3)
