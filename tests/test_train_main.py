"""End-to-end trainer runs on CPU: real DeepSpeed ZeRO-3 with 2 ranks (torchrun, and DeepSpeed's own launcher
for the full fine-tune; DS_ACCELERATOR=cpu, gloo),
the tiny random Qwen3-VL / Qwen3.5 models and copies of the `built_shards` fixture cut to N samples.

Each run is a module-scoped fixture so several tests read one run; runs are a few steps each.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.train_helpers import REPO, events, explain, launch, run_group, steps, subset_shards, train_env, verify

FIVE = ["vid_a/w0002", "vid_b/w0002", "vid_c/w0002", "vid_d/w0002", "vid_a/w0001"]
ONE = ["vid_a/w0002"]


@pytest.fixture(scope="module")
def cache(tiny_cache) -> Path:
    return tiny_cache


@pytest.fixture(scope="module")
def five(built_shards, tmp_path_factory) -> Path:
    return subset_shards(built_shards, tmp_path_factory.mktemp("five"), FIVE)


@pytest.fixture(scope="module")
def one(built_shards, tmp_path_factory) -> Path:
    return subset_shards(built_shards, tmp_path_factory.mktemp("one"), ONE)


def _args(shards: Path, run: Path, cache: Path, *extra: str) -> list[str]:
    return ["--shards", str(shards), "--output-dir", str(run), "--cache-dir", str(cache), "--num-workers", "1", *extra]


def _run_arms(shards: Path, cache: Path, tmp_path: Path, common: tuple, arms: dict[str, tuple]) -> dict[str, Path]:
    """One single-process train.main run per arm (common flags + the arm's own), each in tmp_path/NAME."""
    runs = {}
    for name, extra in arms.items():
        run = tmp_path / name
        proc = launch(_args(shards, run, cache, *common, *extra), nproc=0)
        assert proc.returncode == 0, explain(proc)
        runs[name] = run
    return runs


# LoRA on tiny Qwen3-VL, 5 samples on 2 ranks with --tail drop: 2 steps per epoch, 3 epochs, checkpoints at 2, 4.
DROP_ARGS = ("--model-family", "qwen3_vl", "--tail", "drop", "--epochs", "3", "--save-every", "2", "--lr", "1e-3")


@pytest.fixture(scope="module")
def drop_run(five, cache, tmp_path_factory):
    run = tmp_path_factory.mktemp("drop_run")
    proc = launch(_args(five, run, cache, *DROP_ARGS, "--verify-load"))
    return proc, run


def test_zero3_leaf_layers_give_the_per_submodule_hooks_numbers(drop_run, five, cache, tmp_path):
    """Leaf layers (the ZeRO-3 default) change only the hook granularity: the first step's loss and gradient
    norm equal those of DeepSpeed's per-submodule hooks, on 2 ranks, and the second step runs; also with no
    layer checkpointed."""
    proc, run = drop_run
    assert proc.returncode == 0, explain(proc)
    for r in (0, 1):
        (leaf,) = events(run, r, "zero3_leaf_layers")
        assert leaf["classes"] == ["Qwen3VLTextDecoderLayer", "Qwen3VLVisionBlock"]
    hooks = tmp_path / "per_submodule"
    one_epoch = [("1" if a == "3" else a) for a in DROP_ARGS]  # --epochs 1: the same first steps, then stop
    ref = launch(_args(five, hooks, cache, *one_epoch, "--no-zero3-leaf-layers"))
    assert ref.returncode == 0, explain(ref)
    assert not events(hooks, 0, "zero3_leaf_layers")
    # leaf layers with nothing checkpointed: their inputs must ask for gradients, or DeepSpeed never gathers
    # the first layer again for its backward (it failed on an empty LoRA weight before)
    unckpt = tmp_path / "leaf_no_checkpointing"
    plain = launch(_args(five, unckpt, cache, *one_epoch, "--gradient-checkpointing", "none"))
    assert plain.returncode == 0, explain(plain)
    for r in (0, 1):
        got, want = steps(run, r)[0], steps(hooks, r)[0]
        assert got["sample_ids"] == want["sample_ids"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-2) and got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-2)
        assert sorted(steps(hooks, r)) == [0, 1]
        flat = steps(unckpt, r)[0]
        assert flat["loss"] == pytest.approx(want["loss"], rel=1e-4) and flat["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3)


@pytest.fixture(scope="module")
def resumed_run(five, cache, tmp_path_factory):
    """The same run killed by a (simulated) OOM on rank 1 at step 4, its newest checkpoint (step 4) then damaged
    as a kill between `latest` and the trainer state would leave it (rank 1's state gone, `latest` emptied),
    then resumed in place: it must resume from the previous complete checkpoint (step 2)."""
    run = tmp_path_factory.mktemp("resumed_run")
    crashed = launch(_args(five, run, cache, *DROP_ARGS), env={"VIDEO_ORA_FAIL_AT": "forward:4:1"})
    oom = json.loads((run / "oom_rank1.json").read_text()) if (run / "oom_rank1.json").exists() else None
    crash_steps = {r: steps(run, r) for r in (0, 1)}
    newest = run / "checkpoints" / "step000004"
    if newest.is_dir():  # else the crash came too early; the tests below say so
        (newest / "trainer_state_rank1.pt").unlink()
        (run / "checkpoints" / "latest").write_text("")
    resumed = launch(_args(five, run, cache, *DROP_ARGS, "--resume", str(run)))
    return crashed, oom, crash_steps, resumed, run


def test_lora_run_plans_trains_verifies_and_saves(drop_run):
    proc, run = drop_run
    assert proc.returncode == 0, explain(proc)
    out = proc.stdout
    # plan printed before the load, with the effective batch and the dropped ids
    assert out.index("effective batch = 1 micro x 2 ranks x 1 accum = 2 samples per step") < out.index("load check")
    assert "dropped (tail=drop): " in out
    assert "69/69 checkpoint entries verified" in out
    assert "69 parameters are ZeRO-3 partitioned" in out
    # after engine init each rank holds ~1/2 of the parameters (plus the small ones kept whole): checked, not assumed
    assert "ZeRO-3 sharding, rank 0 of 2: holds " in out and "(tolerance 10%)" in out, out
    for r in (0, 1):
        (shard,) = events(run, r, "zero3_sharding")
        assert shard["ok"] and shard["unpartitioned_bytes"] == 0 and shard["resident_bytes"] < shard["total_bytes"]
        # LoRA trains in the compute dtype as under ZeRO-2 (DeepSpeed does not cast a model partitioned at load)
        assert [e["dtypes"] for e in events(run, r, "trainable_dtypes")] == [["bfloat16"]]
    assert "LoRA sanity after step 1: 14/14 lora_B changed; 14/14 lora_A unchanged (expected" in out
    # the ledger proves exactly-once per epoch, with the dropped sample accounted
    ledger = [e for e in events(run, 0, "ledger")]
    assert [e["epoch"] for e in ledger] == [0, 1, 2] and all(e["ok"] for e in ledger)
    assert all("4/4 planned samples consumed exactly once (0 pad repeats, 1 dropped)" in e["message"] for e in ledger)
    plans = json.loads((run / "plan.json").read_text())["plans"]
    for p, e in zip(plans, ledger):
        trained = {s for step in p["steps"] for rank in step for mb in rank for s in mb["sample_ids"]}
        assert len(p["dropped"]) == 1 and trained | set(p["dropped"]) == set(FIVE)
    # every rank logs fixed keys per step; the two ranks train different samples
    for r in (0, 1):
        rows = steps(run, r)
        assert sorted(rows) == list(range(6))
        for row in rows.values():
            assert row["input_tokens"] > row["visual_tokens"] > 0 and row["supervised_tokens"] > 0
            assert row["loss"] > 0 and row["grad_norm"] > 0 and row["lr"] > 0 and row["peak_alloc_gib"] > 0
            assert set(row["phase_memory"]) >= {"backward", "optimizer_step"} and row["memory_kind"] == "cpu_rss"
    assert all(steps(run, 0)[s]["sample_ids"] != steps(run, 1)[s]["sample_ids"] for s in range(6))
    # memory summary and run record
    assert "memory per rank and phase" in out and "first_forward" in out
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "completed" and rec["world_size"] == 2
    assert rec["deepspeed_config"]["zero_optimization"]["stage"] == 3
    assert rec["deepspeed_config"]["zero_optimization"]["reduce_bucket_size"] == 5e6
    assert rec["config"]["tail"] == "drop" and rec["env"]["DS_ACCELERATOR"] == "cpu"
    assert len(rec["manifest"]["build_json_sha256"]) == 64 and rec["model"]["family"] == "qwen3_vl"
    assert set(rec["memory"]) == {"rank0", "rank1"} and "load" in rec["memory"]["rank1"]
    for tag in ("step000002", "step000004"):  # complete: checkpoint.json lists both ranks' files, `latest` after it
        marker = json.loads((run / "checkpoints" / tag / "checkpoint.json").read_text())
        assert {"trainer_state_rank0.pt", "trainer_state_rank1.pt"} <= set(marker["files"]) and marker["world_size"] == 2
        assert any(name.endswith("optim_states.pt") for name in marker["files"]), marker["files"]
    assert (run / "checkpoints" / "latest").read_text() == "step000004"
    assert (run / "adapter" / "adapter_config.json").exists()


def test_verify_adapter_passes_then_fails_on_an_altered_tensor(drop_run, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    proc, run = drop_run
    assert proc.returncode == 0, explain(proc)
    ok = verify(run)
    assert ok.returncode == 0 and "28/28 tensors equal" in ok.stdout, explain(ok)

    altered = tmp_path / "altered"
    shutil.copytree(run, altered, ignore=shutil.ignore_patterns("checkpoints"))
    path = altered / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = sorted(k for k in tensors if "lora_B" in k)[3]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 0.5
    save_file(tensors, str(path), metadata={"format": "pt"})
    # the failing case runs in-process (the passing one above proved the separate-process path)
    from train.verify_adapter import main as verify_main

    assert verify_main([str(altered)]) == 1
    out, err = capsys.readouterr()
    assert "27/28 tensors equal" in out and name in err and "file altered or damaged" in err, (out, err)


def test_oom_is_reported_with_phase_samples_and_every_rank(resumed_run):
    crashed, oom, _, _, run = resumed_run
    assert crashed.returncode != 0, explain(crashed)
    assert oom is not None, explain(crashed)
    assert oom["phase"] == "forward" and oom["global_step"] == 4
    (sample,) = oom["samples"]
    assert sample["sample_id"] in FIVE and len(sample["grid_thw"]) == 3 and sample["input_tokens"] > 0
    assert sorted(m["rank"] for m in oom["ranks_memory"]) == [0, 1]
    assert "OUT OF MEMORY in phase forward at global step 4" in crashed.stderr


def test_resume_skips_a_damaged_checkpoint_and_trains_the_same_samples_with_the_same_loss(drop_run, resumed_run):
    from safetensors.torch import load_file

    proc, run_a = drop_run
    crashed, _, crash_steps, resumed, run_b = resumed_run
    assert proc.returncode == 0 and resumed.returncode == 0, explain(resumed)
    assert "resume: skipped checkpoint step000004: trainer_state_rank1.pt is missing" in resumed.stdout
    assert "/checkpoints/step000002 at global step 2 of 6" in resumed.stdout
    (resume,) = [e for e in events(run_b, 1, "resume")]
    assert resume["checkpoint"] == "step000002" and resume["latest"] == ""
    assert resume["skipped"] == [{"tag": "step000004", "reason": "trainer_state_rank1.pt is missing"}]
    for r in (0, 1):
        a, b = steps(run_a, r), steps(run_b, r)
        # the crashed attempt trained steps 0..3 (rank 1 died in step 4) exactly like the uninterrupted run
        assert [crash_steps[r][s]["loss"] for s in range(4)] == [a[s]["loss"] for s in range(4)]
        for s in (2, 3, 4, 5):
            last_b = b[s]  # the resumed run's line for step s (the log keeps the crashed attempt's lines too)
            assert last_b["sample_ids"] == a[s]["sample_ids"]
            assert last_b["loss"] == pytest.approx(a[s]["loss"], abs=1e-6), (r, s, last_b["loss"], a[s]["loss"])
            assert last_b["lr"] == pytest.approx(a[s]["lr"], rel=1e-9)
    # the ledger was cut back to the checkpoint and continued: still exactly once
    ledger = events(run_b, 0, "ledger")
    assert ledger and all(e["ok"] for e in ledger), ledger
    lines = [json.loads(x) for x in (run_b / "ledger" / "rank1.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(6))
    # the same adapter as the run that was never interrupted; the step-4 checkpoint was written anew
    adapter_a = load_file(str(run_a / "adapter" / "adapter_model.safetensors"))
    adapter_b = load_file(str(run_b / "adapter" / "adapter_model.safetensors"))
    assert adapter_a.keys() == adapter_b.keys()
    assert all(torch.allclose(adapter_a[k], adapter_b[k], rtol=0, atol=1e-6) for k in adapter_a)
    assert (run_b / "checkpoints" / "step000004" / "trainer_state_rank1.pt").exists()


def test_kill_9_of_the_whole_job_stops_every_rank_and_resumes_to_the_same_run(drop_run, five, cache, tmp_path):
    """scripts/fault_matrix.py's training point against drop_run: torchrun's process group SIGKILLed once step 2
    is logged. torchrun starts each rank in a session of its own, so without train.main's tie to its
    launcher the ranks would train on (they did: to the end, adapter saved, beside the resumed run). Then
    --resume in place must start from the newest complete checkpoint and end with drop_run's sample ids,
    losses and adapter. (The kills inside a save run in the full sweep, BENCHMARKS.md "Reliability".)"""
    from scripts.fault_matrix import TRAIN_KILLS, train_point

    proc, ref = drop_run
    assert proc.returncode == 0, explain(proc)
    kill = next(k for k in TRAIN_KILLS if k.after_step == 2)
    row = train_point(kill, shards=five, ref=ref, run=tmp_path / "run", cache=cache, logs=tmp_path / "logs",
                      args=["--num-workers", "1", *DROP_ARGS])
    assert row["problems"] == [], row  # e.g. "the killed job kept training: last steps [2, 2] at the kill, [5, 5] after"
    assert row["killed_rc"] == -9 and row["survivors"] == 0 and row["last_step_logged"][0] >= 2, row
    assert row["resumed_from"] == row["expected"] and row["resumed_from"] in ("step000002", "step000004"), row
    assert row["same_samples_and_losses"] and row["adapter_max_diff"] <= 1e-6 and row["ok"], row


def test_damaged_shard_stops_the_trainer_before_any_step_naming_shard_member_and_sample(one, cache, tmp_path):
    """Through a loader worker (--num-workers 1): one error line, exit 2, nothing trained. The damage is one
    byte flipped in the middle of frame 2 after the build (the JPEG still decodes, only the build's hash sees
    it); a truncated member takes the same path from the reader (tests/test_shard_reader.py)."""
    from schemas.manifest import SampleRecord, read_records
    from schemas.shard import ShardReader, frame_ext

    shards = Path(shutil.copytree(one, tmp_path / "shards"))
    (rec,) = read_records(shards / "manifest.parquet", SampleRecord)
    member = f"{rec.key}.{frame_ext(2)}"
    offset, size = ShardReader(shards).index(rec.shard)[member]
    data = bytearray((shards / rec.shard).read_bytes())
    data[offset + size // 2] ^= 0xFF  # inside the entropy-coded data
    (shards / rec.shard).write_bytes(bytes(data))
    run = tmp_path / "run"
    proc = launch(_args(shards, run, cache), nproc=0)
    assert proc.returncode == 2, explain(proc)
    line = (f"error (ShardError, rank 0, phase data): sample {rec.sample_id}: {rec.shard}:{member} differs from the "
            "bytes written at build time")
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error (")]
    assert len(errors) == 1 and errors[0].startswith(line), explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    assert events(run, 0, "load_done") and not steps(run, 0)  # the model loaded, no step was trained
    (error,) = events(run, 0, "error")
    assert error["kind"] == "ShardError" and error["phase"] == "data" and rec.sample_id in error["message"]
    assert json.loads((run / "run.json").read_text())["status"] == "failed"


def test_tail_error_names_the_numbers_and_options(five, cache, tmp_path):
    """A plan error (tests/test_plan.py has each message) stops every rank before the load. Printed once, by
    rank 0, even when rank 0 is the slow one: rank 1 must not exit first (the launcher would SIGTERM rank 0
    before it printed, as happened in CI)."""
    proc = launch(_args(five, tmp_path / "run", cache), env={"VIDEO_ORA_STALL_AT": "error_report:0:0"})
    assert proc.returncode != 0
    error = "5 samples, world size 2, micro batch 1, grad accum 1 -> 2 samples per global step"
    assert proc.stderr.count(error) == 1 and "error (PlanError, rank 0, phase setup)" in proc.stderr, explain(proc)
    assert "--tail pad" in proc.stderr and "--tail drop" in proc.stderr
    names = {e["event"] for r in (0, 1) for e in events(tmp_path / "run", r)}  # both ranks stopped before the load
    assert "start" in names and "load_start" not in names and "load_done" not in names


def test_full_finetune_qwen3_5_with_tail_pad_reloads_with_from_pretrained(five, cache, tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    run = tmp_path / "run"
    proc = launch(_args(five, run, cache, "--model-family", "qwen3_5", "--finetune", "full", "--tail", "pad",
                        "--lr", "1e-3"), launcher="deepspeed")
    assert proc.returncode == 0, explain(proc)
    assert "1 pad repeats" in proc.stdout
    ledger = events(run, 0, "ledger")
    assert ledger[0]["ok"] and "5/5 planned samples consumed exactly once (1 pad repeats, 0 dropped)" in ledger[0]["message"]
    repeats = [rep for r in (0, 1) for row in steps(run, r).values() for rep in row["repeat"]]
    assert len(repeats) == 6 and sum(repeats) == 1
    from train.verify_adapter import main as verify_main

    assert verify_main([str(run)]) == 0  # in-process: every tensor of RUN/model equals the save-time digest
    assert "60/60 tensors equal" in capsys.readouterr().out
    model = AutoModelForImageTextToText.from_pretrained(run / "model")
    from transformers import AutoProcessor

    assert type(AutoProcessor.from_pretrained(run / "model")).__name__ == "Qwen3VLProcessor"
    base = load_file(str(cache / "tiny_qwen3_5" / "model.safetensors"))
    got = dict(model.named_parameters())
    lm = "model.language_model.layers.1.mlp.down_proj.weight"
    vis = "model.visual.blocks.0.mlp.linear_fc1.weight"
    assert not torch.equal(got[lm].float(), base[lm].to(torch.bfloat16).float())  # trained
    assert torch.equal(got[vis].float(), base[vis].to(torch.bfloat16).float())  # frozen vision tower


@pytest.fixture(scope="module")
def single_run(one, cache, tmp_path_factory):
    """One process, LoRA, 6 epochs of one sample; --model given relative to the trainer's working directory,
    as a user types it; steps 1-2 profiled."""
    run = tmp_path_factory.mktemp("single_run")
    model = os.path.relpath(cache / "tiny_qwen3_vl", REPO)
    proc = launch(_args(one, run, cache, "--model", model, "--epochs", "6", "--lr", "3e-3", "--lora-dropout", "0",
                        "--warmup-steps", "0", "--min-lr-ratio", "1.0", "--dtype", "fp32", "--num-workers", "0",
                        "--profile-steps", "2"), nproc=0)
    return proc, run


def test_loss_goes_down_on_a_repeated_batch_single_process(single_run):
    proc, run = single_run
    assert proc.returncode == 0, explain(proc)
    losses = [steps(run, 0)[s]["loss"] for s in range(6)]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.9 * losses[0], losses
    # DeepSpeed's CPU shared-memory op (inference only) is not built or loaded: it cost 25-48 s per start
    assert "shm_comm" not in proc.stdout + proc.stderr, explain(proc)


def test_one_rank_zero3_keeps_parameters_whole_and_the_profile_names_the_ops(single_run):
    """On one rank (CPU: ZeRO-3) every parameter is persistent, so nothing is gathered per layer; and
    --profile-steps 2 leaves a Chrome trace and an op table of the profiled steps."""
    import gzip

    from train.config import ONE_RANK_PERSISTENCE

    proc, run = single_run
    assert proc.returncode == 0, explain(proc)
    zero = json.loads((run / "run.json").read_text())["deepspeed_config"]["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_param_persistence_threshold"] == ONE_RANK_PERSISTENCE
    trace = json.loads(gzip.decompress((run / "profile" / "rank0.trace.json.gz").read_bytes()))
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names)
    # nothing is released, so every linear is torch's own, not DeepSpeed's Python autograd Function
    assert any("AddmmBackward" in n or "MmBackward" in n for n in names)
    assert not any("LinearFunctionForZeroStage3" in n for n in names)
    table = (run / "profile" / "kernels_rank0.txt").read_text().splitlines()
    assert table[0].startswith("2 profiled step(s)") and len(table) > 10
    assert any("aten::mm" in line or "aten::addmm" in line or "aten::linear" in line for line in table[2:])


OPEN_ADAPTER = """
import json, sys
from peft import AutoPeftModel
from transformers import AutoProcessor
model = AutoPeftModel.from_pretrained(sys.argv[1])
processor = AutoProcessor.from_pretrained(sys.argv[1])
print(json.dumps({"model": type(model.get_base_model()).__name__, "processor": type(processor).__name__,
                  "lora": sum("lora_B" in n for n, _ in model.named_parameters())}))
"""


def test_saved_adapter_opens_in_its_own_loaders_from_another_working_directory(single_run, cache, tmp_path):
    proc, run = single_run
    assert proc.returncode == 0, explain(proc)
    base = str((cache / "tiny_qwen3_vl").resolve())
    adapter_config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == base
    assert json.loads((run / "run.json").read_text())["model"]["dir"] == base
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    opened = subprocess.run([sys.executable, "-c", OPEN_ADAPTER, str(run / "adapter")], cwd=elsewhere, env=train_env(),
                            capture_output=True, text=True, timeout=300)
    assert opened.returncode == 0, opened.stderr[-3000:]
    got = json.loads(opened.stdout.strip().splitlines()[-1])
    assert got["model"] == "Qwen3VLForConditionalGeneration" and got["processor"] == "Qwen3VLProcessor" and got["lora"] > 0
    verified = subprocess.run([sys.executable, "-m", "train.verify_adapter", str(run)], cwd=elsewhere, env=train_env(),
                              capture_output=True, text=True, timeout=300)
    assert verified.returncode == 0, verified.stderr[-3000:]
    assert " tensors equal" in verified.stdout


def test_renamed_checkpoint_key_fails_load_verification(cache, one, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(cache / "tiny_qwen3_vl", model)
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.visual.blocks.1.attn.proj.weight_renamed"] = tensors.pop("model.visual.blocks.1.attn.proj.weight")
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    proc = launch(_args(one, tmp_path / "run", cache, "--model", str(model)), nproc=0)
    assert proc.returncode == 2, explain(proc)
    assert "model.visual.blocks.1.attn.proj.weight_renamed" in proc.stderr
    assert "model parameter model.visual.blocks.1.attn.proj.weight has no checkpoint key" in proc.stderr
    assert not any(e["event"] == "step" for e in events(tmp_path / "run", 0))


def test_a_killed_cpu_adam_build_fails_the_run_in_seconds_instead_of_waiting_forever(cache, one, tmp_path, monkeypatch):
    """A build of DeepSpeed's CPU Adam op killed mid-way leaves torch's lock file; torch then waits on it without
    a word. train.main names the file before loading anything; a fresh lock (a build under way) is left alone."""
    from train.zero import STALE_BUILD_LOCK_S, stale_build_lock

    ext = tmp_path / "torch_extensions"
    env = {"TORCH_EXTENSIONS_DIR": str(ext)}
    lock = ext / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    assert stale_build_lock() is None  # fresh: another process may be building
    old = lock.stat().st_mtime - STALE_BUILD_LOCK_S - 60
    os.utime(lock, (old, old))
    assert stale_build_lock() == lock
    proc = launch(_args(one, tmp_path / "run", cache, "--model-family", "qwen3_vl", "--zero-stage", "3",
                        "--offload-optimizer"), nproc=0, env=env, timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert str(lock) in proc.stderr and "delete that file" in proc.stderr, explain(proc)
    assert not any(e["event"] == "load_start" for e in events(tmp_path / "run", 0))


def test_one_rank_zero3_levers_keep_the_numbers_of_deepspeeds_own_path(cache, one, tmp_path):
    """One rank, every parameter whole: torch's linear instead of DeepSpeed's memory-efficient one, and the frozen
    base kept resident between steps (only the trainable parameters released and gathered back). An explicit
    persistence threshold above every parameter keeps both of DeepSpeed's own ways: the losses and gradient norms
    must be the same, and the LoRA weights must still train (the gathered-back updates reach the model)."""
    common = ("--model-family", "qwen3_vl", "--zero-stage", "3", "--epochs", "4", "--lr", "3e-3", "--lora-dropout", "0",
              "--warmup-steps", "0", "--num-workers", "0")
    runs = _run_arms(one, cache, tmp_path, common,
                     {"levers": (), "deepspeed": ("--param-persistence-threshold", "1e14")})
    levers, deepspeed = (list(steps(runs[n], 0).values()) for n in ("levers", "deepspeed"))
    assert [e["replaced"] for e in events(runs["levers"], 0, "frozen_kept_resident")] == [True]
    assert events(runs["deepspeed"], 0, "frozen_kept_resident") == []
    for a, b in zip(levers, deepspeed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-2)
    losses = [s["loss"] for s in levers]
    assert len(losses) == 4 and losses[-1] < losses[0], losses  # the updates reached the model


def test_recomputed_lora_dropout_trains_like_peft_dropout_below_zero3(cache, one, tmp_path):
    """Below ZeRO-3 train.main routes LoRA through train/lora_dropout.py by default; the run's losses equal
    PEFT's own dropout path (--no-recompute-lora-dropout) step for step, with dropout on."""
    common = ("--model-family", "qwen3_vl", "--zero-stage", "0", "--dtype", "fp32", "--epochs", "3", "--lr", "3e-3",
              "--lora-dropout", "0.3", "--warmup-steps", "0", "--num-workers", "0")
    runs = _run_arms(one, cache, tmp_path, common, {"lever": (), "peft": ("--no-recompute-lora-dropout",)})
    # checkpointed (CPU auto: all), so the down projections keep gate and up too
    assert [(e["projections"], e["mlps"], e["sibling_groups"], e["single_groups"])
            for e in events(runs["lever"], 0, "lora_dropout_recomputed")
            ] == [(14, 2, 4, 2)]  # q/k/v, gate/up and o_proj each as one node (--sibling-lora, on by default)
    assert events(runs["peft"], 0, "lora_dropout_recomputed") == []
    lever, peft = (list(steps(runs[n], 0).values()) for n in ("lever", "peft"))
    assert len(lever) == len(peft) == 3
    # steps 1-2 follow step 0's update of lora_B, whose gradient goes through the dropout masks
    assert [a["loss"] for a in lever] == pytest.approx([b["loss"] for b in peft], rel=1e-5)
    assert lever[2]["loss"] != lever[0]["loss"]


def test_plain_adamw_at_stage_0_steps_like_deepspeeds_zero2_and_resumes_exactly(cache, one, tmp_path):
    """One rank: stage 0 with the trainer's AdamW (train/adamw.py, the default there; what auto picks on one GPU)
    gives the losses and gradient norms of DeepSpeed's ZeRO-2 (what auto picked before), in bf16 with clipping
    active; DeepSpeed must not wrap it (its bf16 mode and clipping off in the config it ran), and a run resumed
    from its step-2 checkpoint continues with the same losses (the fp32 masters travel in DeepSpeed's checkpoint)."""
    common = ("--model-family", "qwen3_vl", "--epochs", "4", "--lr", "3e-3", "--lora-dropout", "0",
              "--warmup-steps", "0", "--num-workers", "0", "--max-grad-norm", "0.05")
    runs = _run_arms(one, cache, tmp_path, common, {"plain": ("--zero-stage", "0", "--save-every", "2"),
                                                    "zero2": ("--zero-stage", "2")})
    assert [e["tensors"] for e in events(runs["plain"], 0, "plain_adamw")] == [28]
    assert events(runs["zero2"], 0, "plain_adamw") == []
    ds = json.loads((runs["plain"] / "run.json").read_text())["deepspeed_config"]
    assert ds["bf16"]["enabled"] is False and ds["gradient_clipping"] == 0 and "optimizer" not in ds
    plain, zero2 = (list(steps(runs[n], 0).values()) for n in ("plain", "zero2"))
    assert len(plain) == 4 and plain[-1]["loss"] < plain[0]["loss"]
    assert all(s["grad_norm"] > 0.05 for s in plain)  # clipping was active on every step
    for a, b in zip(plain, zero2, strict=True):  # the same arithmetic as ZeRO-2's on one rank (bit for bit here)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    shutil.copytree(runs["plain"], tmp_path / "resumed")  # resumed in place from its step-2 checkpoint
    resumed = launch(_args(one, tmp_path / "resumed", cache, *common, "--zero-stage", "0", "--resume",
                           str(tmp_path / "resumed")), nproc=0)
    assert resumed.returncode == 0, explain(resumed)
    again = steps(tmp_path / "resumed", 0)
    assert [e["checkpoint"] for e in events(tmp_path / "resumed", 0, "resume")] == ["step000002"]
    assert [again[s]["loss"] for s in (2, 3)] == pytest.approx([plain[s]["loss"] for s in (2, 3)], abs=1e-6)


def test_packed_rows_train_with_segment_attention_like_the_block_mask(five, cache, tmp_path):
    """--pack: train.main gives the language model's attention to train/packing.py's per-sample sdpa (logged) and
    its losses equal those of transformers' block-diagonal mask (--no-segment-attention) step for step."""
    common = ("--model-family", "qwen3_vl", "--zero-stage", "0", "--dtype", "fp32", "--epochs", "2", "--lr", "3e-3",
              "--warmup-steps", "0", "--num-workers", "0", "--pack", "--max-tokens-per-batch", "1100", "--tail", "pad")
    runs = _run_arms(five, cache, tmp_path, common, {"segments": (), "mask": ("--no-segment-attention",)})
    assert [e["language_model"] for e in events(runs["segments"], 0, "segment_attention")] == ["video_ora_segments"]
    assert events(runs["mask"], 0, "segment_attention") == []
    seg, mask = (list(steps(runs[n], 0).values()) for n in ("segments", "mask"))
    assert len(seg) == len(mask) >= 2 and max(len(s["sample_ids"]) for s in seg) >= 2  # rows hold several samples
    assert [a["loss"] for a in seg] == pytest.approx([b["loss"] for b in mask], rel=1e-5)


def test_a_failed_step_leaves_the_step_before_it_logged(cache, one, tmp_path):
    """Each step's record is written while the next step runs (train/readback.py); when that next step fails
    (a simulated OOM in its forward, no checkpoint between), the finished step's record is still written."""
    run = tmp_path / "run"
    proc = run_group([sys.executable, "-m", "train.main", "--shards", str(one), "--output-dir", str(run),
                      "--cache-dir", str(cache), "--model-family", "qwen3_vl", "--max-steps", "4", "--tail", "pad",
                      "--save-every", "0", "--num-workers", "0", "--no-progress"],
                     timeout=300, env=train_env({"VIDEO_ORA_FAIL_AT": "forward:2:0"}))
    assert proc.returncode != 0, explain(proc)
    assert sorted(steps(run, 0)) == [0, 1], explain(proc)
