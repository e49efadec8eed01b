"""Sequence parallelism (train/sequence_parallel.py) on CPU with the tiny Qwen3-VL:
- 4 gloo ranks (plain processes, no DeepSpeed engine) split one sample; loss and LoRA gradients summed over the
  group equal the one-rank model's own loss and gradients, and the vision tower sharded by temporal group gives
  the full tower's embeddings (its attention stays within a temporal group);
- train.main with --sequence-parallel 2 on 2 ranks (DeepSpeed ZeRO-3, torchrun) trains like one process.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.train_helpers import REPO, free_port, train_env

SAMPLE = "vid_c/w0000"  # a full 8 s portrait window: 8 temporal groups, 315 tokens (padded for 2 and 4 ranks)


def _spawn(n: int, *, model, shards, tmp_path, timeout: int = 120) -> dict:
    out = tmp_path / f"sp{n}.json"
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "tests.sp_worker", "--model", str(model), "--shards", str(shards),
                               "--sample", SAMPLE, "--out", str(out), "--init", init, "--rank", str(r), "--world", str(n)],
                              cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
             for r in range(n)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:  # a rank still alive (timeout, or a peer died): kill its whole process group
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    codes = [p.returncode for p in procs]
    assert codes == [0] * n, (codes, "\n".join(x[-3000:] for x in logs))
    return json.loads(out.read_text())


@pytest.mark.parametrize("n", [4])  # 2 ranks: the train.main test below (loss, adapter)
def test_sequence_parallel_loss_and_lora_gradients_equal_one_rank(tiny_cache, built_shards, tmp_path, n):
    got = _spawn(n, model=tiny_cache / "tiny_qwen3_vl", shards=built_shards, tmp_path=tmp_path)
    t = sum(g[0] for g in got["grid"])
    assert t >= n, got["grid"]  # every rank encoded at least one temporal group
    assert got["length"] % n, got["length"]  # the pad path is exercised
    # the vision tower sharded by temporal group == the whole tower (groups do not attend across each other)
    assert got["vision_rows"][0] == got["vision_rows"][1] and max(got["vision_rel"]) < 1e-4, got["vision_rel"]
    # each rank held its own slice and ran the all-to-all attention in every layer (2 layers; checkpointing
    # recomputes the forward in backward, so more calls than layers)
    ranks = sorted(got["ranks"], key=lambda r: r["rank"])
    assert [r["start"] for r in ranks] == [i * ranks[0]["end"] for i in range(n)]
    assert all(r["attention_calls"] >= 2 for r in ranks)
    # 4 ranks > 2 kv heads: the GQA repeat path; 2 ranks: kv heads split as they are
    # the loss sits where the supervised tokens are: the answer is at the end, so the first rank has none
    assert ranks[0]["supervised_here"] == 0 and ranks[0]["partial_loss"] == 0.0
    assert sum(r["supervised_here"] for r in ranks) == got["supervised"] > 0
    assert got["sp_loss"] == pytest.approx(got["ref_loss"], rel=1e-4), got
    assert got["grad_nonzero"] == len(got["grad_rel"]) > 0
    assert max(got["grad_rel"].values()) < 1e-3, sorted(got["grad_rel"].items(), key=lambda kv: -kv[1])[:3]


def test_shard_ranges_cover_the_padded_sequence_once():
    from train.sequence_parallel import SeqShard

    for length, size in ((10, 3), (12, 4), (1, 2), (7, 1)):
        shards = [SeqShard.of(length, rank=r, size=size) for r in range(size)]
        assert shards[0].start == 0 and shards[-1].end == shards[0].padded >= length
        assert all(a.end == b.start for a, b in zip(shards, shards[1:]))
        assert len({s.end - s.start for s in shards}) == 1 and shards[0].padded - length < size


def test_unsupported_batches_and_models_are_refused_with_the_reason(tiny_cache):
    from transformers import AutoModelForImageTextToText

    from train.sequence_parallel import sp_problems

    vl = AutoModelForImageTextToText.from_pretrained(tiny_cache / "tiny_qwen3_vl")
    two = {"input_ids": torch.ones(2, 8, dtype=torch.long), "attention_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2])}
    problems = sp_problems(vl, two, 3)
    assert any("4 attention heads do not split over 3" in p for p in problems)
    assert any("one sample per sequence-parallel group" in p for p in problems)
    assert any("padded" in p for p in problems)
    q35 = AutoModelForImageTextToText.from_pretrained(tiny_cache / "tiny_qwen3_5")
    one = {"input_ids": torch.ones(1, 8, dtype=torch.long)}
    assert any("Qwen3-VL only" in p and "linear-attention" in p for p in sp_problems(q35, one, 2))
    assert sp_problems(vl, one, 2) == []


def test_train_main_sequence_parallel_2_ranks_trains_like_one_process(tiny_cache, built_shards, tmp_path):
    """torchrun 2 ranks with --sequence-parallel 2 (DeepSpeed ZeRO-3 on CPU) against plain one-process training
    of the same two samples: same per-step losses, same adapter, one ledger writer for the one data slot."""
    from safetensors.torch import load_file

    from tests.train_helpers import events, explain, launch, steps, subset_shards

    shards = subset_shards(built_shards, tmp_path / "shards", ["vid_c/w0000", "vid_a/w0001"])
    common = ["--shards", str(shards), "--cache-dir", str(tiny_cache), "--model-family", "qwen3_vl", "--dtype", "fp32",
              "--lora-dropout", "0", "--lr", "1e-2", "--warmup-steps", "0", "--num-workers", "0", "--epochs", "1"]
    sp = launch(["--output-dir", str(tmp_path / "sp"), *common, "--sequence-parallel", "2"], nproc=2, timeout=240)
    assert sp.returncode == 0, explain(sp)
    ref = launch(["--output-dir", str(tmp_path / "ref"), *common], nproc=0, timeout=240)
    assert ref.returncode == 0, explain(ref)
    for r in (0, 1):
        (layout,) = events(tmp_path / "sp", r, "sequence_parallel")
        assert (layout["size"], layout["dp_rank"], layout["sp_rank"], layout["dp_world"]) == (2, 0, r, 1)
    a, b = steps(tmp_path / "sp", 0), steps(tmp_path / "ref", 0)
    assert sorted(a) == sorted(b) == [0, 1] and steps(tmp_path / "sp", 1).keys() == a.keys()
    for s in a:
        assert a[s]["sample_ids"] == b[s]["sample_ids"] == steps(tmp_path / "sp", 1)[s]["sample_ids"]
        assert a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-4), (s, a[s]["loss"], b[s]["loss"])
    assert sorted(p.name for p in (tmp_path / "sp" / "ledger").iterdir()) == ["rank0.jsonl"]
    (ledger,) = events(tmp_path / "sp", 0, "ledger")
    assert ledger["ok"] and "2/2 planned samples consumed exactly once" in ledger["message"]
    x = load_file(str(tmp_path / "sp" / "adapter" / "adapter_model.safetensors"))
    y = load_file(str(tmp_path / "ref" / "adapter" / "adapter_model.safetensors"))
    assert x.keys() == y.keys() and len(x) > 0
    # within 1% of one AdamW step (lr 1e-2): Adam divides each gradient by its own scale, so the fp32 summation
    # order of the 2-rank all-to-all against one process shows in the weights at ~0.2% of a step (1.8e-5 with
    # transformers 5.25's attention); a wrong gradient or position moves weights by a whole step
    assert max((x[k] - y[k]).abs().max().item() for k in x) <= 1e-2 * 1e-2


def test_train_main_refuses_sequence_parallel_it_cannot_run(tmp_path):
    from train.config import ConfigError, parse_config

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "manifest.parquet").write_bytes(b"")
    base = ["--shards", str(shards), "--output-dir", str(tmp_path / "run")]
    with pytest.raises(ConfigError) as e:
        parse_config([*base, "--sequence-parallel", "2", "--micro-batch-size", "2", "--finetune", "full",
                      "--unfreeze-merger"])
    msg = str(e.value)
    assert "splits one sample" in msg and "--finetune lora" in msg and "frozen vision tower" in msg
    with pytest.raises(ConfigError, match="--sequence-parallel must be >= 1"):
        parse_config([*base, "--sequence-parallel", "0"])
    assert parse_config([*base, "--sequence-parallel", "2"]).sequence_parallel == 2
    from train.sequence_parallel import SequenceParallelError, rank_layout

    assert [rank_layout(r, 4, 2) for r in range(4)] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    with pytest.raises(SequenceParallelError, match="world size 3 is not a multiple"):
        rank_layout(0, 3, 2)
