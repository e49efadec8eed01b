"""The coverage ledger and the tail rules at 3 and 4 ranks: real torchrun runs of train.main (DeepSpeed ZeRO-3 on
CPU, gloo), the tiny Qwen3-VL, sample counts that do not divide the world size.

Two runs only (one per world size), each checked several ways: the ledger event says exactly-once per epoch,
the ledger files themselves are re-checked against plan.json, the pad repeats / dropped ids are the documented
ones, and the ranks trained disjoint real samples at every step.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.train_helpers import events, explain, launch, steps, subset_shards

SEVEN = ["vid_a/w0000", "vid_a/w0001", "vid_a/w0002", "vid_b/w0000", "vid_b/w0001", "vid_c/w0000", "vid_d/w0000"]
FIVE = SEVEN[:5]
# One epoch each would prove less than two: the second epoch reshuffles, so another sample is repeated/dropped.
COMMON = ("--model-family", "qwen3_vl", "--epochs", "2", "--num-workers", "0", "--lr", "1e-3")


def _run(built_shards, cache, tmp_path_factory, ids, nproc, tail):
    root = tmp_path_factory.mktemp(f"rank{nproc}_{tail}")
    shards = subset_shards(built_shards, root / "shards", ids)
    run = root / "run"
    args = ["--shards", str(shards), "--output-dir", str(run), "--cache-dir", str(cache), "--tail", tail, *COMMON]
    return launch(args, nproc=nproc, timeout=240), run


def _check(proc, run: Path, nproc: int, ids: list[str], *, per_epoch_repeats: int, per_epoch_dropped: int):
    assert proc.returncode == 0, explain(proc)
    plans = json.loads((run / "plan.json").read_text())["plans"]
    assert len(plans) == 2
    ledger = events(run, 0, "ledger")
    assert [e["epoch"] for e in ledger] == [0, 1] and all(e["ok"] for e in ledger), ledger
    trained = len(ids) - per_epoch_dropped
    want = (f"{trained}/{trained} planned samples consumed exactly once "
            f"({per_epoch_repeats} pad repeats, {per_epoch_dropped} dropped)")
    assert all(want in e["message"] for e in ledger), (want, ledger)
    # The ledger files, re-read here: per epoch every real sample exactly once, repeats/drops as planned.
    lines = [json.loads(x) for r in range(nproc) for x in (run / "ledger" / f"rank{r}.jsonl").read_text().splitlines()]
    assert sorted({(x["step"], x["rank"]) for x in lines}) == sorted(
        (s, r) for s in range(sum(len(p["steps"]) for p in plans)) for r in range(nproc))
    for p in plans:
        first, n = p["first_global_step"], len(p["steps"])
        mine = [x for x in lines if first <= x["step"] < first + n]
        real = Counter(s for x in mine for mb in x["micro_batches"] for s, rep in zip(mb["sample_ids"], mb["repeat"]) if not rep)
        reps = [s for x in mine for mb in x["micro_batches"] for s, rep in zip(mb["sample_ids"], mb["repeat"]) if rep]
        assert set(real.values()) == {1} and set(real) | set(p["dropped"]) == set(ids), (p["epoch"], real, p["dropped"])
        assert not set(real) & set(p["dropped"])
        assert len(p["dropped"]) == per_epoch_dropped and sorted(reps) == sorted(p["repeated"])
        assert len(reps) == per_epoch_repeats and set(reps) <= set(real)  # a repeat is a sample also trained for real
    # every step: each rank trained its own planned sample; no two ranks the same real sample
    rows = {r: steps(run, r) for r in range(nproc)}
    total = sum(len(p["steps"]) for p in plans)
    for s in range(total):
        real = [sid for r in range(nproc) for sid, rep in zip(rows[r][s]["sample_ids"], rows[r][s]["repeat"]) if not rep]
        assert len(real) == len(set(real)), (s, real)
        assert all(rows[r][s]["loss"] > 0 for r in range(nproc))
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "completed" and rec["world_size"] == nproc and rec["config"]["tail"] == ("pad" if per_epoch_repeats else "drop")
    return plans


@pytest.fixture(scope="module")
def three_pad(built_shards, tiny_cache, tmp_path_factory):
    """5 samples on 3 ranks, --tail pad: 2 steps per epoch, one pad repeat per epoch."""
    return _run(built_shards, tiny_cache, tmp_path_factory, FIVE, 3, "pad")


@pytest.fixture(scope="module")
def four_drop(built_shards, tiny_cache, tmp_path_factory):
    """7 samples on 4 ranks, --tail drop: 1 step per epoch, 3 samples dropped per epoch."""
    return _run(built_shards, tiny_cache, tmp_path_factory, SEVEN, 4, "drop")


def test_three_ranks_tail_pad_trains_every_sample_once_per_epoch_plus_the_documented_repeat(three_pad):
    proc, run = three_pad
    plans = _check(proc, run, 3, FIVE, per_epoch_repeats=1, per_epoch_dropped=0)
    assert all(len(p["steps"]) == 2 for p in plans)
    assert "effective batch = 1 micro x 3 ranks x 1 accum = 3 samples per step" in proc.stdout
    # the pad repeat is the first sample of the epoch's shuffled order, marked as a repeat in the plan
    for p in plans:
        (rep,) = p["repeated"]
        assert p["steps"][0][0][0]["sample_ids"] == [rep] and p["steps"][-1][-1][0]["repeat"] == [True]


def test_four_ranks_tail_drop_trains_one_full_step_and_names_the_dropped(four_drop):
    proc, run = four_drop
    plans = _check(proc, run, 4, SEVEN, per_epoch_repeats=0, per_epoch_dropped=3)
    assert all(len(p["steps"]) == 1 for p in plans)
    assert "dropped (tail=drop): " in proc.stdout
    assert plans[0]["dropped"] != plans[1]["dropped"]  # reshuffled per epoch: not always the same samples left out
