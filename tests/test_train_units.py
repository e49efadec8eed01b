"""In-process trainer pieces: config validation, DeepSpeed config filling, the supervised-only loss, load
verification (prefix mapping, planted renamed key), memory helper, run record. No DeepSpeed engine here."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from train.config import (
    ConfigError,
    TrainConfig,
    default_deepspeed_config,
    lr_factor,
    parse_config,
    resolve_deepspeed_config,
)


def test_config_reports_every_problem_at_once(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_config(["--shards", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "run"), "--lr", "0",
                      "--grad-accum", "0", "--max-tokens-per-batch", "100", "--micro-batch-size", "2",
                      "--lora-targets", "(", "--warmup-ratio", "1.5"])
    msg = str(e.value)
    for part in ("--shards", "--lr must be > 0", "--grad-accum must be >= 1", "exclusive", "--lora-targets",
                 "--warmup-ratio"):
        assert part in msg, msg


def test_an_output_dir_holding_an_earlier_run_is_refused_unless_resumed(built_shards, tmp_path):
    """A second run into the same --output-dir would append to the first one's ledger and fail the coverage
    check after all its training (seen on the H200 when a bench leg ran twice): refused before anything runs."""
    run = tmp_path / "run"
    args = ["--shards", str(built_shards), "--output-dir", str(run)]
    parse_config(args)  # a new directory
    (run / "ledger").mkdir(parents=True)
    parse_config(args)  # an empty ledger/: nothing trained yet
    (run / "ledger" / "rank0.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=f"--output-dir {run}: holds an earlier run.*--resume {run}"):
        parse_config(args)
    (run / "checkpoints").mkdir()
    parse_config(args + ["--resume", str(run)])  # continuing it is what --resume is for


def test_config_help_explains_flags(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    out = capsys.readouterr().out
    for flag in ("--tail", "--zero-stage", "--offload-optimizer", "--resume", "--verify-load", "--lora-targets",
                 "--gradient-checkpointing", "--save-every", "--max-tokens-per-batch"):
        assert flag in out


def test_deepspeed_config_default_is_video_ora_and_autos_are_filled(built_shards, tmp_path):
    cfg = TrainConfig(shards=built_shards, output_dir=tmp_path, micro_batch_size=2, grad_accum=3, lr=3e-4,
                      zero_stage=2, reduce_bucket_size=1e7)
    ds = resolve_deepspeed_config(cfg, world_size=4, total_steps=10)
    assert ds["train_batch_size"] == 24 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 3 and ds["optimizer"]["params"]["lr"] == 3e-4
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["reduce_bucket_size"] == 1e7
    assert "stage3_prefetch_bucket_size" not in ds["zero_optimization"]
    z3 = default_deepspeed_config(TrainConfig(shards=built_shards, output_dir=tmp_path))["zero_optimization"]
    assert z3["stage"] == 3 and z3["reduce_bucket_size"] == 5e6 and z3["stage3_prefetch_bucket_size"] == 5e6
    assert z3["stage3_gather_16bit_weights_on_model_save"] and "offload_optimizer" not in z3

    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": "auto"},
                                "zero_optimization": {"stage": 3, "mystery": "auto"}}))
    with pytest.raises(ConfigError) as e:
        resolve_deepspeed_config(TrainConfig(shards=built_shards, output_dir=tmp_path, deepspeed=user), 2, 5)
    assert "zero_optimization.mystery is still \"auto\"" in str(e.value)
    assert "train_micro_batch_size_per_gpu=8" in str(e.value)


def test_lr_schedule_trains_at_step_zero_and_decays():
    f = [lr_factor(s, warmup=2, total=10, min_ratio=0.0) for s in range(10)]
    assert 0 < f[0] < f[1] < f[2] == 1.0
    assert all(a >= b for a, b in zip(f[2:], f[3:])) and f[-1] > 0


def test_lr_schedule_holds_the_peak_before_the_decay_fraction():
    f = [lr_factor(s, warmup=2, total=20, min_ratio=0.1, decay_ratio=0.25) for s in range(20)]
    assert 0 < f[0] < f[1] < 1.0
    assert f[2:15] == [1.0] * 13  # warmup-stable: the peak holds until the last 5 steps
    assert all(a > b for a, b in zip(f[15:], f[16:])) and 0.1 < f[-1] < 0.2
    assert [lr_factor(s, warmup=2, total=20, min_ratio=0.1) for s in range(20)] == \
        [lr_factor(s, warmup=2, total=20, min_ratio=0.1, decay_ratio=1.0) for s in range(20)]
    with pytest.raises(ConfigError, match="--decay-ratio"):
        TrainConfig(shards=Path("."), output_dir=Path("."), decay_ratio=0.0).validate()


def _batch(model_dir: Path, built_shards: Path, ids: list[str]):
    from schemas.prompt import load_tokenizer
    from train.data import SampleStore, VisionSpec, collate
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    store = SampleStore(built_shards)
    tok = load_tokenizer(str(model_dir))
    tensors, _ = collate([store.get(i) for i in ids], VisionSpec.from_model_config(config),
                         video_token_id=config.video_token_id, pad_token_id=tok.pad_token_id)
    return tensors


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_supervised_only_loss_equals_model_loss(tiny_cache, built_shards, family):
    """The loss from logits at supervised positions only is the model's own full-logits loss."""
    from transformers import AutoModelForImageTextToText

    from train.loss import causal_lm_loss

    model_dir = tiny_cache / f"tiny_{family}"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = _batch(model_dir, built_shards, ["vid_a/w0002", "vid_b/w0000"])  # different lengths: padding
    with torch.no_grad():
        ours = causal_lm_loss(model, batch)
        theirs = causal_lm_loss(model, batch, full_logits=True)
    assert torch.isfinite(ours)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def _rewrite_checkpoint(src: Path, dst: Path, rename) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file({rename(k): v for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_load_check_reports_prefix_mapping_and_verifies_values(tiny_cache, tmp_path):
    """A checkpoint laid out as `language_model.*` / `visual.*` (no `model.` prefix) loads through
    transformers' key mapping; the check reports the mapping and every value matches."""
    from transformers import AutoModelForImageTextToText

    from train.load_check import check_load, verify_values

    planted = _rewrite_checkpoint(tiny_cache / "tiny_qwen3_vl", tmp_path / "m", lambda k: k.removeprefix("model."))
    model, info = AutoModelForImageTextToText.from_pretrained(planted, output_loading_info=True)
    report, entries = check_load(model, planted, info)
    assert report.prefix_changes.get("language_model.* -> model.language_model.*", 0) > 0, report.prefix_changes
    assert report.prefix_changes.get("visual.* -> model.visual.*", 0) > 0, report.prefix_changes
    assert "language_model.* -> model.language_model.*" in report.message()
    assert verify_values(model, planted, report, entries) == report.entries
    # one altered value is caught and named
    with torch.no_grad():
        dict(model.named_parameters())["model.visual.blocks.0.mlp.linear_fc1.bias"][0] += 1.0
    with pytest.raises(Exception, match=r"visual\.blocks\.0\.mlp\.linear_fc1\.bias"):
        verify_values(model, planted, report, entries)


def test_load_check_names_a_renamed_key(tiny_cache, tmp_path):
    from transformers import AutoModelForImageTextToText

    from train.load_check import LoadError, check_load

    bad = "model.language_model.layers.1.mlp.up_proj.weight"
    planted = _rewrite_checkpoint(tiny_cache / "tiny_qwen3_vl", tmp_path / "m",
                                  lambda k: k.replace("mlp.up_proj", "mlp.upp_proj") if k == bad else k)
    model, info = AutoModelForImageTextToText.from_pretrained(planted, output_loading_info=True)
    with pytest.raises(LoadError) as e:
        check_load(model, planted, info)
    assert "model.language_model.layers.1.mlp.upp_proj.weight" in str(e.value)  # the unexpected key
    assert f"model parameter {bad} has no checkpoint key" in str(e.value)  # the parameter left at random init


def test_memory_helper_and_simulated_oom(tmp_path, monkeypatch):
    from train.memory import FAIL_ENV, PhaseTracker, all_ranks_memory, maybe_fail, peak_memory

    stat = peak_memory()
    assert stat.kind in ("cuda", "cpu_rss") and stat.alloc_gib > 0 and stat.reserved_gib >= stat.alloc_gib * 0.5
    tracker = PhaseTracker(tmp_path, rank=1)
    with tracker.phase("load", 0):
        pass
    assert all_ranks_memory(tmp_path)[0]["phase"] == "load" and tracker.latest is not None
    monkeypatch.setenv(FAIL_ENV, "backward:3:1")
    maybe_fail("backward", 3, 0)  # other rank: nothing
    maybe_fail("forward", 3, 1)  # other phase: nothing
    with pytest.raises(torch.OutOfMemoryError):
        maybe_fail("backward", 3, 1)
    with pytest.raises(torch.OutOfMemoryError):  # the tracker's phase is where the hook fires
        with tracker.phase("backward", 3):
            raise AssertionError("the simulated OOM comes before the phase's body")
    assert tracker.current == "backward"


def test_phase_tracker_writes_the_memory_file_once_per_step(tmp_path, monkeypatch):
    from train import memory

    tracker = memory.PhaseTracker(tmp_path, rank=0)
    stats = iter([memory.MemStat(a, a + 1, "cpu_rss") for a in (1.0, 5.0, 2.0, 3.0, 1.0, 4.0)])
    monkeypatch.setattr(memory, "peak_memory", lambda reset=True: next(stats))
    writes = []
    real_write = tracker._write
    monkeypatch.setattr(tracker, "_write", lambda *a: (writes.append(a[:2]), real_write(*a)))
    tracker.begin_step(7)
    for _ in range(3):  # three micro-batches
        with tracker.phase("forward", 7):
            pass
        with tracker.phase("backward", 7):
            pass
    assert writes == []  # nothing written during the step
    peaks = tracker.end_step()
    assert writes == [("backward", 7)]
    assert peaks == {"forward": {"alloc_gib": 2.0, "reserved_gib": 3.0, "kind": "cpu_rss"},
                     "backward": {"alloc_gib": 5.0, "reserved_gib": 6.0, "kind": "cpu_rss"}}
    assert memory.all_ranks_memory(tmp_path)[0]["phases"]["backward"]["alloc_gib"] == 5.0


def test_deepspeed_file_with_a_flag_it_overrides_is_an_error_naming_both(built_shards, tmp_path):
    from train.config import parse_config, resolved

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}))
    base = ["--shards", str(built_shards), "--output-dir", str(tmp_path / "run"), "--deepspeed", str(ds)]
    with pytest.raises(ConfigError) as e:
        parse_config(base + ["--zero-stage", "3", "--offload-optimizer", "--offload-params", "--prefetch-bucket-size", "1e7"])
    msg = str(e.value)
    assert f"--zero-stage 3 but --deepspeed {ds} has zero_optimization.stage = 2" in msg
    assert f"--offload-optimizer is set but --deepspeed {ds} has zero_optimization.offload_optimizer = None" in msg
    assert f"--offload-params is set but --deepspeed {ds} has zero_optimization.offload_param = None" in msg
    assert f"--prefetch-bucket-size 1e+07 but --deepspeed {ds} has no zero_optimization.stage3_prefetch_bucket_size" in msg
    # a flag the file asks for ("auto"), or one that agrees with it, is fine; the file's stage is the run's
    cfg = parse_config(base + ["--zero-stage", "2", "--reduce-bucket-size", "2e6"])
    ds_config = resolve_deepspeed_config(cfg, world_size=1, total_steps=4)
    got = resolved(cfg, ds_config)
    assert (got.zero_stage, got.reduce_bucket_size, got.offload_optimizer) == (2, 2e6, False)
    plain = parse_config(base)  # no stage flag: the file's 2, not the default 3, is what run.json records
    assert resolved(plain, resolve_deepspeed_config(plain, 1, 4)).zero_stage == 2
    assert resolved(plain, resolve_deepspeed_config(plain, 1, 4)).to_json()["zero_stage"] == 2


def test_run_record_fields(built_shards, tmp_path):
    from train.run_record import build_run_record

    rec = build_run_record(config={"a": 1}, ds_config={"zero_optimization": {"stage": 3}}, shards=built_shards,
                           world_size=2, devices=[], model_dir="m", family="qwen3_vl", plan_summary="p")
    for key in ("interpreter", "python", "packages", "git", "source_sha256", "argv", "env", "config",
                "deepspeed_config", "manifest", "devices"):
        assert key in rec
    assert rec["packages"]["deepspeed"] and rec["packages"]["transformers"]
    assert len(rec["manifest"]["build_json_sha256"]) == 64
    assert "commit" in rec["git"] and "dirty" in rec["git"]


def test_load_check_accepts_keys_the_model_class_ignores(tiny_cache, tmp_path):
    """Qwen3.5 checkpoints carry a multi-token-prediction head (`mtp.*`) the model class ignores on purpose;
    the same extra key in a Qwen3-VL checkpoint is an unexpected key."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    from train.load_check import LoadError, check_load

    for family, ok in (("qwen3_5", True), ("qwen3_vl", False)):
        model_dir = tmp_path / family
        shutil.copytree(tiny_cache / f"tiny_{family}", model_dir)
        tensors = load_file(str(model_dir / "model.safetensors"))
        tensors["mtp.fc.weight"] = torch.zeros(4, 4)
        save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        model, info = AutoModelForImageTextToText.from_pretrained(model_dir, output_loading_info=True)
        if ok:
            report, _ = check_load(model, model_dir, info)
            assert sum(report.ignored.values()) == 1 and "not loaded on purpose" in report.message()
        else:
            with pytest.raises(LoadError, match=r"mtp\.fc\.weight"):
                check_load(model, model_dir, info)


def _fake_checkpoint(root, step, *, world_size=2, plan="a" * 64, marker=True):
    """A checkpoint directory as save_checkpoint leaves it, without DeepSpeed: one model file + trainer states."""
    from train.checkpoint import MARKER, CheckpointMarker, TrainerState, rng_state, tag_for, trainer_state_name

    ckpt = root / "checkpoints" / tag_for(step)
    ckpt.mkdir(parents=True)
    (ckpt / "mp_rank_00_model_states.pt").write_bytes(b"x" * 100)
    for r in range(world_size):
        state = TrainerState(global_step=step, plan_sha256=plan, world_size=world_size, rng=rng_state())
        torch.save(dataclasses.asdict(state), ckpt / trainer_state_name(r))
    if marker:
        files = {p.name: p.stat().st_size for p in ckpt.iterdir()}
        m = CheckpointMarker(tag=ckpt.name, global_step=step, world_size=world_size, plan_sha256=plan, files=files)
        (ckpt / MARKER).write_text(json.dumps(dataclasses.asdict(m)))
    return ckpt


def test_resume_takes_the_newest_complete_checkpoint_and_says_why_it_skipped_newer_ones(tmp_path):
    from train.checkpoint import ResumeError, find_checkpoint

    _fake_checkpoint(tmp_path, 2)
    (_fake_checkpoint(tmp_path, 4) / "trainer_state_rank1.pt").unlink()  # killed between `latest` and our state
    _fake_checkpoint(tmp_path, 6, marker=False)  # killed before checkpoint.json
    with open(_fake_checkpoint(tmp_path, 8) / "mp_rank_00_model_states.pt", "ab") as f:
        f.write(b"more")  # a file changed after the marker vouched for it
    (_fake_checkpoint(tmp_path, 10) / "checkpoint.json").write_text("{not json")
    (tmp_path / "checkpoints" / "latest").write_text("")  # emptied
    choice = find_checkpoint(tmp_path)
    assert choice.tag == "step000002" and choice.latest == ""
    assert [s["tag"] for s in choice.skipped] == ["step000010", "step000008", "step000006", "step000004"]
    reasons = [s["reason"] for s in choice.skipped]
    assert reasons[0].startswith("checkpoint.json is unreadable (JSONDecodeError")
    assert reasons[1] == "mp_rank_00_model_states.pt is 104 bytes, checkpoint.json says 100"
    assert reasons[2].startswith("no checkpoint.json (the save did not finish")
    assert reasons[3] == "trainer_state_rank1.pt is missing"

    (tmp_path / "checkpoints" / "step000002" / "checkpoint.json").unlink()
    with pytest.raises(ResumeError, match=r"no complete checkpoint \(step000010: .*step000002: no checkpoint.json"):
        find_checkpoint(tmp_path)
    with pytest.raises(ResumeError, match="has no checkpoint"):
        find_checkpoint(tmp_path / "elsewhere")


def test_resume_refuses_a_checkpoint_with_another_plan_or_world_size(tmp_path):
    """Checked before DeepSpeed touches the checkpoint: a different plan would not train the same samples."""
    from train.checkpoint import ResumeError, find_checkpoint, load_checkpoint

    _fake_checkpoint(tmp_path, 3)
    with pytest.raises(ResumeError) as e:
        load_checkpoint(None, find_checkpoint(tmp_path), rank=0, world_size=4, plan_sha256="b" * 64)
    assert "written by 2 ranks, this run has 4" in str(e.value) and "data plan differs" in str(e.value)



def test_oom_report_groups_live_cuda_blocks_by_the_first_frames_outside_torch():
    """The grouping an OOM report applies to torch.cuda.memory._snapshot() (the CUDA side is not run in CI)."""
    from train.memory import GIB, live_allocations_by_site

    def block(size, state, *frames):
        return {"size": size, "requested_size": size, "state": state,
                "frames": [{"filename": f, "line": n, "name": fn} for f, n, fn in frames]}

    torch_frame = ("/x/site-packages/torch/nn/modules/linear.py", 125, "forward")
    layer = ("/x/transformers/models/qwen3_vl/modeling_qwen3_vl.py", 400, "forward")
    ds = ("/x/deepspeed/runtime/zero/parameter_offload.py", 470, "forward")
    snap = {"segments": [{"blocks": [block(2 * GIB, "active_allocated", torch_frame, layer, ds),
                                     block(GIB, "active_allocated", torch_frame, layer, ds),
                                     block(5 * GIB, "inactive", layer),
                                     block(GIB // 2, "active_allocated", ds)]},
                         {"blocks": [block(GIB // 4, "active_allocated")]}]}
    got = live_allocations_by_site(snap)
    assert got == [{"site": "modeling_qwen3_vl.py:400 forward < parameter_offload.py:470 forward", "gib": 3.0, "blocks": 2},
                   {"site": "parameter_offload.py:470 forward", "gib": 0.5, "blocks": 1},
                   {"site": "unrecorded", "gib": 0.25, "blocks": 1}]


def test_values_to_host_reads_tensors_floats_and_a_missing_norm():
    """The step record's values (losses, then the gradient norm) as the loop hands them over: device scalars of
    any shape-() or one-element form, DeepSpeed's float norm, or None where an optimizer reports none (nan)."""
    import math

    from train.readback import values_to_host

    got = values_to_host([torch.tensor(1.5), torch.tensor([2.25], dtype=torch.bfloat16), 3.0, None]).read()
    assert got[:3] == [1.5, 2.25, 3.0] and math.isnan(got[3])
