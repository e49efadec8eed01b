"""scripts/compare_runs.py end to end on CPU (tiny model, smallest setting) and the GPU bench's plumbing."""
from __future__ import annotations

import json

from tests.train_helpers import subset_shards

FOUR = ["vid_a/w0002", "vid_b/w0002", "vid_c/w0002", "vid_d/w0002"]


def test_compare_runs_prints_two_equal_work_configurations_side_by_side(tiny_cache, built_shards, tmp_path, capsys):
    from scripts.compare_runs import main

    shards = subset_shards(built_shards, tmp_path / "shards", FOUR)
    args = ["--model", str(tiny_cache / "tiny_qwen3_vl"), "--shards", str(shards), "--steps", "1", "--nproc", "0",
            "--num-workers", "0", "--common", "--zero-stage 2 --dtype fp32 --lora-dropout 0", "--out", str(tmp_path / "out")]
    assert main(args + ["--a", "--micro-batch-size 2 --grad-accum 2", "--b", "--micro-batch-size 1 --grad-accum 3"]) == 2
    assert "not equal work: A trains 4 samples per rank and step, B 3" in capsys.readouterr().err
    assert main(args + ["--a", "--micro-batch-size 2 --grad-accum 2", "--b", "--micro-batch-size 1 --grad-accum 4"]) == 0
    out = capsys.readouterr().out
    for label in ("step s (median)", "samples / s", "peak alloc GiB", "predicted peak GiB", "backward alloc/reserved",
                  "CPU run: memory is the process RSS stand-in"):
        assert label in out, out
    got = json.loads((tmp_path / "out" / "compare.json").read_text())
    a, b = got["A"], got["B"]
    assert a["rc"] == b["rc"] == 0 and a["steps"] == b["steps"] == 1
    assert a["resolved"]["zero_stage"] == b["resolved"]["zero_stage"] == 2
    assert a["tokens_per_step"] == b["tokens_per_step"] > 0  # the same samples in one step
    assert a["loss_last"] == b["loss_last"] or abs(a["loss_last"] / b["loss_last"] - 1) < 0.05  # same work, seed


def test_issue9_matrix_covers_the_targets_and_legs_exist():
    from scripts.bench_train import LEGS, issue9_matrix, table

    legs = issue9_matrix()
    names = [leg.name for leg in legs]
    assert len(set(names)) == len(names)
    assert all(leg.config == "anchor" or leg.config in LEGS for leg in legs)
    first = names[:5]
    assert first == ["qwen3_vl_4b-64f-anchor", "qwen3_vl_4b-64f-auto", "qwen3_vl_4b-64f-zero2",
                     "qwen3_vl_4b-64f-zero3", "qwen3_vl_4b-64f-zero3-partitioned"]
    for wanted in ("qwen3_vl_4b-64f-plain", "qwen3_vl_4b-128f-auto-cap12", "qwen3_vl_4b-256f-auto-cap12", "qwen3_vl_4b-1024f-auto",
                   "qwen3_vl_8b-64f-auto", "qwen3_5_9b-64f-auto", "qwen3_5_9b-64f-linear-torch"):
        assert wanted in names
    rows = [{"leg": "x-64f-anchor", "config": "anchor", "size": "x", "frames": 64, "cap_gib": None, "step_s": 3.0},
            {"leg": "x-64f-auto", "config": "auto", "size": "x", "frames": 64, "cap_gib": None, "step_s": 0.5,
             "rc": 0, "predicted_peak_gib": 9.0, "prediction_error": -0.05, "resolved": {"zero_stage": 2}},
            {"leg": "x-64f-zero3", "config": "zero3", "size": "x", "frames": 64, "cap_gib": None,
             "skipped": "time budget"},
            {"leg": "x-64f-zero2", "config": "zero2", "size": "x", "frames": 64, "cap_gib": None, "step_s": 0.6,
             "rc": 0, "losses": [12.0, 11.0, 10.0]},
            {"leg": "x-64f-liger", "config": "zero2-liger-kernels", "size": "x", "frames": 64, "cap_gib": None,
             "step_s": 0.55, "rc": 0, "losses": [12.0, 11.11, 10.0]}]
    text = table(rows)
    assert "| x-64f-auto | 0 | 0.5 | 6.00x |" in text and "9.0 (-5.0%)" in text and "| x-64f-zero3 | skipped |" in text
    # per-step losses against the zero2 leg's: the largest relative difference (0.11 / 11), none without losses
    assert "| 1.0e-02 |" in text.splitlines()[-1] and "| 0.0e+00 |" in text.splitlines()[-2]
    assert "e-0" not in text.splitlines()[3] and "e+0" not in text.splitlines()[3]


def test_lora_host_bench_times_every_arm_and_its_nodes_match_peft():
    """scripts/bench_lora_host.py (BENCHMARKS.md session 11's host figures): one short round of every arm in its
    own process (it starts a one-rank gloo group); the one-node branch's gradients equal PEFT's, and the sibling
    group's (q/k/v as one node) PEFT's, or it stops."""
    import re
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "scripts.bench_lora_host", "--rounds", "1", "--calls", "3",
                           "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^branch: peft [\d.]+ us, lever [\d.]+ us, node [\d.]+ us", proc.stdout, re.M), proc.stdout
    assert re.search(r"^siblings: peft [\d.]+ us, lever [\d.]+ us, grouped [\d.]+ us", proc.stdout, re.M), proc.stdout
    assert re.search(r"^reduction: hooks [\d.]+ ms, coalesced [\d.]+ ms, plain [\d.]+ ms, torch [\d.]+ ms", proc.stdout, re.M), proc.stdout


def test_bench_attention_times_every_backend_and_checks_them_against_each_other(tmp_path):
    """scripts/bench_attention.py on CPU: sdpa's own pick and the math kernel, GQA given to the kernel and
    repeated first, each checked against the first (equal to float rounding), rows written as JSON. In its own
    process: torch's CPU thread pools must not start in this one, which later tests fork build workers from."""
    import subprocess
    import sys

    from scripts.bench_attention import causal_tflop

    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_attention", "--heads", "4", "2", "16", "--tokens", "48",
                           "80", "--repeats", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {(r["tokens"], r["backend"], r["gqa"]) for r in rows} == {
        (t, b, g) for t in (48, 80) for b in ("default", "math") for g in ("enable_gqa", "repeat_kv")}
    assert all("error" not in r and r["max_rel_diff"] < 1e-5 and r["forward_backward_ms"] > 0 for r in rows), rows
    assert result["env"]["heads"] == 4 and result["env"]["kv_heads"] == 2
    assert causal_tflop(1000, 32, 128, backward=True) == 3 * causal_tflop(1000, 32, 128, backward=False)
