"""The data plan: layout, tail rules, determinism, length grouping and the coverage ledger."""
from __future__ import annotations

import json
import random

import pytest

from schemas import SampleRecord
from tests.records import v2_fields
from train.ledger import append_ledger, check_ledger, truncate_ledger
from train.plan import (
    MicroBatch,
    PlanConfig,
    PlanError,
    global_steps,
    locate,
    plan_epoch,
    plan_run,
)


def record(i: int, tokens: int = 100, video: str = "vid") -> SampleRecord:
    return SampleRecord(
        sample_id=f"{video}/w{i:04d}", video_id=video, source_path=f"{video}.mp4", window_index=i,
        window_start_s=float(i), window_end_s=float(i + 1), num_frames=4, frame_indices=[0, 1, 2, 3],
        frame_times_s=[0.0, 0.5, 1.0, 1.5], group_times_s=[0.0, 1.0], height=32, width=32, grid_t=2, grid_h=2,
        grid_w=2, visual_tokens=2, text_tokens=tokens - 2, supervised_tokens=5, input_tokens=tokens,
        query="q", answer="[]", segments=[], shard="shard-000000.tar", key=f"{video}__w{i:04d}", **v2_fields(4),
    )


def records(n: int, **kw) -> list[SampleRecord]:
    return [record(i, **kw) for i in range(n)]


def all_ids(plan, repeats=False):
    return plan.sample_ids(repeats=repeats)


def test_one_sample_two_ranks_is_an_error_for_every_tail():
    for tail in ("error", "pad", "drop"):
        with pytest.raises(PlanError) as e:
            plan_epoch(records(1), PlanConfig(world_size=2, tail=tail), 0)
        msg = str(e.value)
        assert "1 samples" in msg and "world size 2" in msg and "rank 1 would get no batch" in msg
        assert "fewer ranks" in msg


def test_five_on_two_ranks_error_says_numbers_and_options():
    with pytest.raises(PlanError) as e:
        plan_epoch(records(5), PlanConfig(world_size=2), 0)
    msg = str(e.value)
    for part in ("5 samples", "world size 2", "micro batch 1", "grad accum 1", "2 samples per global step",
                 "--tail pad", "--tail drop", "--micro-batch-size", "--grad-accum", "fewer ranks"):
        assert part in msg, part


def test_five_on_two_ranks_pad_repeats_one_marked():
    plan = plan_epoch(records(5), PlanConfig(world_size=2, tail="pad"), 0)
    assert plan.num_steps == 3
    assert sorted(all_ids(plan)) == [r.sample_id for r in records(5)]
    assert len(plan.repeated) == 1 and plan.dropped == []
    # the repeat sits in the last step, marked, and is a real sample trained earlier in the epoch
    last = plan.steps[-1]
    flags = [rep for rank in last for mb in rank for rep in mb.repeat]
    assert flags == [False, True]
    rep_id = last[1][0].sample_ids[0]
    assert plan.repeated == [rep_id] and rep_id in all_ids(plan)
    assert "1 pad repeats" in plan.describe() and rep_id in plan.describe()


def test_five_on_two_ranks_drop_lists_dropped():
    plan = plan_epoch(records(5), PlanConfig(world_size=2, tail="drop"), 0)
    assert plan.num_steps == 2
    assert len(plan.dropped) == 1 and plan.repeated == []
    assert sorted(all_ids(plan) + plan.dropped) == [r.sample_id for r in records(5)]
    assert plan.dropped[0] not in all_ids(plan)
    assert f"dropped (tail=drop): {plan.dropped[0]}" in plan.describe()


def test_drop_that_empties_every_rank_is_an_error():
    with pytest.raises(PlanError, match="drop all 3 samples"):
        plan_epoch(records(3), PlanConfig(world_size=2, micro_batch_size=2, tail="drop"), 0)


def test_pad_with_larger_micro_batches_spreads_repeats_over_ranks():
    plan = plan_epoch(records(5), PlanConfig(world_size=2, micro_batch_size=2, grad_accum=2, tail="pad"), 0)
    assert plan.num_steps == 1 and len(plan.repeated) == 3
    for r in range(2):
        assert any(not rep for mbs in plan.for_rank(r) for mb in mbs for rep in mb.repeat)
    shapes = [[len(mb.sample_ids) for mb in rank] for rank in plan.steps[0]]
    assert shapes == [[2, 2], [2, 2]]


def test_exact_fit_layout_and_describe():
    cfg = PlanConfig(world_size=2, micro_batch_size=2, grad_accum=3, tail="error")
    plan = plan_epoch(records(24), cfg, 0)
    assert plan.num_steps == 2
    assert all(len(step) == 2 and all(len(rank) == 3 for rank in step) for step in plan.steps)
    assert len(plan.for_rank(1)) == 2 and len(plan.for_rank(1)[0]) == 3
    assert sorted(all_ids(plan)) == sorted(r.sample_id for r in records(24))
    assert "effective batch = 2 micro x 2 ranks x 3 accum = 12 samples per step" in plan.describe()
    json.dumps(plan.to_json())  # serializable


def test_same_plan_for_every_rank_and_any_manifest_order():
    recs = records(37)
    cfg = PlanConfig(world_size=4, micro_batch_size=2, tail="pad", seed=7)
    reference = plan_epoch(recs, cfg, 3).to_json()
    shuffled = list(recs)
    random.Random(1).shuffle(shuffled)
    assert plan_epoch(shuffled, cfg, 3).to_json() == reference
    assert plan_epoch(list(reversed(recs)), cfg, 3).to_json() == reference


def test_epochs_and_seeds_shuffle_differently():
    recs = records(40)
    cfg = PlanConfig(world_size=2)
    e0, e1 = all_ids(plan_epoch(recs, cfg, 0)), all_ids(plan_epoch(recs, cfg, 1))
    assert e0 != e1 and sorted(e0) == sorted(e1)
    other_seed = all_ids(plan_epoch(recs, PlanConfig(world_size=2, seed=1), 0))
    assert other_seed != e0


def test_duplicate_sample_ids_are_refused():
    with pytest.raises(PlanError, match="duplicate sample ids.*vid/w0001"):
        plan_epoch(records(4) + [record(1)], PlanConfig(world_size=1), 0)


def test_config_rejects_bad_combinations():
    with pytest.raises(PlanError, match="tail must be one of"):
        PlanConfig(world_size=1, tail="wrap")
    with pytest.raises(PlanError, match="exclusive"):
        PlanConfig(world_size=1, micro_batch_size=2, max_tokens_per_batch=100)


def token_records() -> list[SampleRecord]:
    rng = random.Random(0)
    return [record(i, tokens=rng.choice([100, 110, 400, 420, 900, 1000])) for i in range(60)]


def test_token_budget_groups_by_length_and_respects_budget():
    recs = token_records()
    tokens = {r.sample_id: r.input_tokens for r in recs}
    cfg = PlanConfig(world_size=2, grad_accum=2, max_tokens_per_batch=1000, tail="pad")
    plan = plan_epoch(recs, cfg, 0)
    mbs = [mb for step in plan.steps for rank in step for mb in rank]
    assert sorted(set(all_ids(plan))) == sorted(tokens)
    padded = 0
    for mb in mbs:
        lens = [tokens[s] for s in mb.sample_ids]
        assert max(lens) * len(lens) <= 1000
        padded += max(lens) * len(lens) - sum(lens)
    # length grouping keeps padding small: well under what random packing of the same sizes would add
    assert padded < 0.05 * sum(tokens.values())
    # the 100-token samples share micro-batches (variable sizes), the 1000-token ones are alone
    assert max(len(mb.sample_ids) for mb in mbs) >= 9 and min(len(mb.sample_ids) for mb in mbs) == 1
    # whole global steps of world_size x grad_accum micro-batches
    assert all(len(step) == 2 and all(len(rank) == 2 for rank in step) for step in plan.steps)
    assert "padded size <= 1000 tokens" in plan.describe()


def test_token_budget_cap_and_determinism():
    recs = token_records()
    cfg = PlanConfig(world_size=2, max_tokens_per_batch=1000, max_samples_per_batch=3, tail="drop")
    plan = plan_epoch(recs, cfg, 0)
    assert max(len(mb.sample_ids) for step in plan.steps for rank in step for mb in rank) == 3
    shuffled = list(recs)
    random.Random(5).shuffle(shuffled)
    assert plan_epoch(shuffled, cfg, 0).to_json() == plan.to_json()
    assert set(all_ids(plan)) | set(plan.dropped) == {r.sample_id for r in recs}


def test_token_budget_tail_applies_to_micro_batches():
    # 3 samples of 600 tokens under a 1000 budget: 3 micro-batches, 2 per global step
    recs = records(3, tokens=600)
    with pytest.raises(PlanError, match="3 micro-batches do not fill whole global steps of 2"):
        plan_epoch(recs, PlanConfig(world_size=2, max_tokens_per_batch=1000), 0)
    pad = plan_epoch(recs, PlanConfig(world_size=2, max_tokens_per_batch=1000, tail="pad"), 0)
    assert pad.num_steps == 2 and len(pad.repeated) == 1
    drop = plan_epoch(recs, PlanConfig(world_size=2, max_tokens_per_batch=1000, tail="drop"), 0)
    assert drop.num_steps == 1 and len(drop.dropped) == 1


def test_sample_over_token_budget_is_named():
    recs = records(4, tokens=100) + [record(9, tokens=5000, video="long")]
    with pytest.raises(PlanError) as e:
        plan_epoch(recs, PlanConfig(world_size=1, max_tokens_per_batch=1000), 0)
    assert "long/w0009 (5000 tokens)" in str(e.value) and "1000" in str(e.value)


def test_plan_run_max_steps_and_locate():
    recs = records(6)
    cfg = PlanConfig(world_size=2)
    plans = plan_run(recs, cfg, epochs=None, max_steps=7)
    assert [p.num_steps for p in plans] == [3, 3, 1]
    assert [p.first_global_step for p in plans] == [0, 3, 6]
    assert len(plans[2].unreached) == 4 and "not reached" in plans[2].describe()
    assert locate(plans, 0) == (0, 0) and locate(plans, 4) == (1, 1) and locate(plans, 6) == (2, 0)
    with pytest.raises(PlanError):
        locate(plans, 7)
    resumed = list(global_steps(plans, rank=1, start=4))
    assert [(g, e, s) for g, e, s, _ in resumed] == [(4, 1, 1), (5, 1, 2), (6, 2, 0)]
    assert resumed[0][3] == plans[1].steps[1][1]
    assert [p.num_steps for p in plan_run(recs, cfg, epochs=2, max_steps=None)] == [3, 3]
    assert [p.num_steps for p in plan_run(recs, cfg, epochs=2, max_steps=4)] == [3, 1]


def write_faithful_ledger(run_dir, plans, skip=None, extra=None):
    for g, e, s, _ in global_steps(plans, rank=0):
        step = plans[e].steps[s]
        for r, mbs in enumerate(step):
            if skip == (g, r):
                continue
            append_ledger(run_dir, g, r, mbs)
            if extra == (g, r):
                append_ledger(run_dir, g, r, mbs)


def test_ledger_faithful_passes(tmp_path):
    plans = plan_run(records(5), PlanConfig(world_size=2, tail="pad"), epochs=2)
    write_faithful_ledger(tmp_path, plans)
    report = check_ledger(tmp_path, plans)
    assert report.ok, report.message()
    assert report.message().splitlines() == [
        "epoch 0: 5/5 planned samples consumed exactly once (1 pad repeats, 0 dropped)",
        "epoch 1: 5/5 planned samples consumed exactly once (1 pad repeats, 0 dropped)",
    ]
    assert (tmp_path / "ledger" / "rank1.jsonl").exists()
    # one epoch at a time, as rank 0 does at epoch end
    assert check_ledger(tmp_path, plans[1:]).ok


def test_ledger_missing_sample_is_named(tmp_path):
    plans = plan_run(records(6), PlanConfig(world_size=2, tail="drop"), epochs=1)
    write_faithful_ledger(tmp_path, plans, skip=(1, 1))
    lost = plans[0].steps[1][1][0].sample_ids[0]
    report = check_ledger(tmp_path, plans)
    assert not report.ok
    assert f"missing: {lost}" in report.message() and "step 1 rank 1: no ledger line" in report.message()
    with pytest.raises(PlanError, match="coverage FAILED"):
        report.raise_if_failed()


def test_ledger_duplicate_sample_is_named(tmp_path):
    plans = plan_run(records(6), PlanConfig(world_size=2), epochs=1)
    write_faithful_ledger(tmp_path, plans, extra=(2, 0))
    twice = plans[0].steps[2][0][0].sample_ids[0]
    report = check_ledger(tmp_path, plans)
    assert not report.ok and f"duplicated: {twice}" in report.message()


def test_ledger_wrong_sample_and_missing_repeat(tmp_path):
    plans = plan_run(records(5), PlanConfig(world_size=2, tail="pad"), epochs=1)
    for g, _, s, _ in global_steps(plans, rank=0):
        for r, mbs in enumerate(plans[0].steps[s]):
            if mbs[0].repeat[0]:
                mbs = [MicroBatch(sample_ids=["vid/w0099"], repeat=[False])]  # trained something else
            append_ledger(tmp_path, g, r, mbs)
    msg = check_ledger(tmp_path, plans).message()
    assert "unexpected: vid/w0099" in msg and "pad repeats: planned 1, consumed 0" in msg


def test_truncate_ledger_on_resume(tmp_path):
    plans = plan_run(records(6), PlanConfig(world_size=2), epochs=1)
    write_faithful_ledger(tmp_path, plans)
    # resumed from step 1: steps 1 and 2 are trained again and logged again
    assert truncate_ledger(tmp_path, 0, 1) == 2 and truncate_ledger(tmp_path, 1, 1) == 2
    assert not check_ledger(tmp_path, plans).ok
    for g, e, s, _ in global_steps(plans, rank=0, start=1):
        for r, mbs in enumerate(plans[e].steps[s]):
            append_ledger(tmp_path, g, r, mbs)
    assert check_ledger(tmp_path, plans).ok


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 40), world=st.integers(1, 4), micro=st.integers(1, 3), accum=st.integers(1, 3),
       tail=st.sampled_from(["error", "pad", "drop"]), budget=st.sampled_from([None, 300, 1000]))
def test_every_sample_is_trained_once_dropped_or_refused(n, world, micro, accum, tail, budget):
    """Whatever the numbers: a PlanError, or a plan where each sample is trained exactly once or listed as
    dropped, repeats are marked, and every rank has whole steps with at least one real sample."""
    rng = random.Random(n * 1000 + world)
    recs = [record(i, tokens=rng.choice([100, 150, 290])) for i in range(n)]
    try:
        cfg = PlanConfig(world_size=world, micro_batch_size=1 if budget else micro, grad_accum=accum, tail=tail,
                         max_tokens_per_batch=budget)
        plan = plan_epoch(recs, cfg, 0)
    except PlanError:
        return
    trained = all_ids(plan)
    assert len(trained) == len(set(trained))
    assert sorted(trained + plan.dropped) == sorted(r.sample_id for r in recs)
    repeats = [s for s, rep in zip(all_ids(plan, repeats=True), [r for step in plan.steps for rank in step
                                                                  for mb in rank for r in mb.repeat]) if rep]
    assert repeats == plan.repeated and set(repeats) <= set(trained)
    assert (not plan.repeated or tail == "pad") and (not plan.dropped or tail == "drop")
    for step in plan.steps:
        assert len(step) == world and all(len(rank) == accum for rank in step)
        assert all(mb.sample_ids for rank in step for mb in rank)
    for r in range(world):
        assert any(not rep for mbs in plan.for_rank(r) for mb in mbs for rep in mb.repeat)
