"""train.predict end to end on the prep fixture with the tiny random models, and its pieces."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from schemas.prompt import load_tokenizer, special_id, tokenize_sample
from schemas.manifest import SampleRecord, Segment, read_records
from schemas.predictions import STATUSES, read_predictions, write_predictions
from train import evaluate as ev
from train import export as ex
from train import predict as pr
from train.answer_parse import parse_output
from train.data import SampleStore, VisionSpec, collate

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_vl(tiny_cache):
    return tiny_cache / "tiny_qwen3_vl"


@pytest.fixture(scope="module")
def preds(tiny_vl, built_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("predict") / "preds.jsonl"
    cfg = pr.PredictConfig(model=tiny_vl, shards=built_shards, out=out, batch_size=5, max_new_tokens=12)
    summary = pr.predict(cfg, log=lambda _: None)
    return out, summary


def test_predict_writes_every_window_in_manifest_order(preds, built_shards):
    out, summary = preds
    rows = read_predictions(out)
    records = read_records(built_shards / "manifest.parquet", SampleRecord)
    assert [r.sample_id for r in rows] == [r.sample_id for r in records]
    assert summary["windows"] == 12
    for row, rec in zip(rows, records):
        assert row.status in STATUSES
        assert (row.window_start_s, row.window_end_s, row.video_id) == (rec.window_start_s, rec.window_end_s, rec.video_id)
        assert 1 <= row.generated_tokens <= 12
        assert row.source_fps == pytest.approx(8.0)
        # a random model's text is garbage: the parser must classify it, not crash or invent segments
        parsed = parse_output(row.raw_output, rec.window_end_s - rec.window_start_s,
                              finished="truncated" not in row.degenerate)
        assert (row.status, row.segments, row.degenerate) == (parsed.status, parsed.segments, parsed.degenerate)
        assert row.status != "valid", row.raw_output
        # every segment is scored by its number tokens' probability (greedy: each chosen token is the argmax)
        assert row.scores is not None and len(row.scores) == len(row.segments), row
        assert all(0.0 < x <= 1.0 for x in row.scores), row.scores
        assert row.segments_source == [Segment(start_s=s.start_s + rec.window_start_s, end_s=s.end_s + rec.window_start_s)
                                       for s in row.segments]
    assert summary["status"]["failed"] + summary["status"]["repaired"] == 12


def test_predictions_feed_evaluate_and_export(preds, built_shards, tmp_path, capsys):
    out, _ = preds
    assert ev.main([str(out), "--shards", str(built_shards), "--out", str(tmp_path / "r.json"),
                    "--html", str(tmp_path / "r.html")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["counts"] == {"windows": 12, "videos": 4, "predictions": 12}
    assert (tmp_path / "r.html").read_text().count("<section class=\"video\"") == 4
    for fmt in ("json", "ffmpeg"):
        assert ex.main([str(out), "--format", fmt, "--out", str(tmp_path / f"keep.{fmt}")]) == 0
    assert ex.main([str(out), "--format", "edl", "--out", str(tmp_path / "edl")]) == 0
    assert len(list((tmp_path / "edl").glob("*.edl"))) == 4
    capsys.readouterr()


def test_prompt_is_the_training_prompt(built_shards):
    """The ids predict feeds are the shard's prompt, which is what prep renders for generation."""
    store = SampleStore(built_shards)
    tok = load_tokenizer()
    for sid in list(store.records)[:3]:
        s = store.get(sid)
        r = s.record
        gen = tokenize_sample(tok, query=r.query, answer=None, group_times_s=r.group_times_s,
                              tokens_per_group=r.grid_h * r.grid_w // 4, layout=r.prompt_layout)
        assert pr.prompt_only(s).input_ids == gen.input_ids
        assert s.input_ids[s.prompt_tokens:] == tok(r.answer + "<|im_end|>", add_special_tokens=False)["input_ids"]


def _last_logits(model, tensors):
    return model(**tensors).logits[:, -1].float()


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_left_padded_batch_matches_single_samples(family, built_shards, tiny_cache):
    """Next-token logits of a left-padded batch equal those of each sample alone (positions, masks, M-RoPE)."""
    model_dir = tiny_cache / f"tiny_{family}"
    model = pr.load_model(model_dir, None, torch.device("cpu"), torch.float32)
    tok = load_tokenizer(str(model_dir))
    spec = VisionSpec.from_model_config(model.config)
    kw = dict(video_token_id=special_id(tok, "<|video_pad|>"), pad_token_id=tok.pad_token_id)
    store = SampleStore(built_shards)
    ids = ["vid_a/w0000", "vid_a/w0002", "vid_c/w0001"]  # full windows and a short last one
    samples = [pr.prompt_only(store.get(s)) for s in ids]
    assert len({len(s.input_ids) for s in samples}) >= 2  # padding really happens
    with torch.no_grad():
        batch = pr.left_pad(collate(samples, spec, **kw)[0])
        assert (batch["attention_mask"][:, -1] == 1).all()  # every prompt ends at the right edge
        together = _last_logits(model, batch)
        for i, s in enumerate(samples):
            alone = _last_logits(model, pr.left_pad(collate([s], spec, **kw)[0]))
            torch.testing.assert_close(together[i], alone[0], atol=1e-4, rtol=1e-4)


def test_token_probabilities_are_the_model_probabilities_of_the_generated_tokens(tiny_vl, built_shards, monkeypatch):
    """What predict scores segments with: for each generated token of a left-padded batch, the probability
    a plain forward pass over prompt + answer gives that token."""
    seen, last_ids = {}, []
    real_row, real_ends = pr.make_row, pr.token_ends

    def spy_ends(tokenizer, ids):  # called with the answer's ids just before make_row
        last_ids[:] = [list(ids)]
        return real_ends(tokenizer, ids)

    def spy_row(record, text, finished, generated, probs=None, ends=None):
        seen[record.sample_id] = (last_ids[0], probs)
        return real_row(record, text, finished, generated, probs=probs, ends=ends)

    monkeypatch.setattr(pr, "make_row", spy_row)
    monkeypatch.setattr(pr, "token_ends", spy_ends)
    model = pr.load_model(tiny_vl, None, torch.device("cpu"), torch.float32)
    tok = load_tokenizer(str(tiny_vl))
    store = SampleStore(built_shards)
    ids = ["vid_a/w0000", "vid_c/w0002"]  # different prompt lengths: left padding in the batch
    rows = pr.generate_rows(model, tok, store, ids, batch_size=2, max_new_tokens=5, device=torch.device("cpu"),
                            log=lambda _: None)
    spec = VisionSpec.from_model_config(model.config)
    kw = dict(video_token_id=special_id(tok, "<|video_pad|>"), pad_token_id=tok.pad_token_id)
    for sid in ids:
        answer, probs = seen[sid]
        assert len(probs) == len(answer) and tok.decode(answer, skip_special_tokens=False) == rows[sid].raw_output
        s = pr.prompt_only(store.get(sid))
        n = len(s.input_ids)
        full = pr.left_pad(collate([dataclasses.replace(s, input_ids=s.input_ids + answer)], spec, **kw)[0])
        with torch.no_grad():
            dist = torch.softmax(model(**full).logits[0].float(), dim=-1)
        want = [dist[n - 1 + t, tok_id].item() for t, tok_id in enumerate(answer)]
        assert probs == pytest.approx(want, abs=1e-4)


def test_adapter_is_applied(tiny_vl, built_shards, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(str(tiny_vl), dtype=torch.float32)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))  # random B: the adapter changes outputs
    run = tmp_path / "run"
    lora.save_pretrained(str(run / "adapter"))
    tok = load_tokenizer(str(tiny_vl))
    spec = VisionSpec.from_model_config(base.config)
    sample = pr.prompt_only(SampleStore(built_shards).get("vid_a/w0000"))
    batch = pr.left_pad(collate([sample], spec, video_token_id=special_id(tok, "<|video_pad|>"),
                                pad_token_id=tok.pad_token_id)[0])
    with torch.no_grad():
        want = _last_logits(lora.eval(), batch)
        loaded = pr.load_model(tiny_vl, run, torch.device("cpu"), torch.float32)  # RUN dir -> RUN/adapter
        plain = pr.load_model(tiny_vl, None, torch.device("cpu"), torch.float32)
        torch.testing.assert_close(_last_logits(loaded, batch), want)
        assert not torch.allclose(_last_logits(plain, batch), want)


def test_config_reports_every_problem(tmp_path):
    with pytest.raises(ValueError) as e:
        pr.PredictConfig(model=tmp_path, shards=tmp_path, out=tmp_path / "p.jsonl", adapter=tmp_path / "run",
                         batch_size=0, max_new_tokens=0, dtype="fp8")
    msg = str(e.value)
    for part in ("config.json", "manifest.parquet", "adapter_config.json", "--batch-size", "--max-new-tokens", "--dtype"):
        assert part in msg


def test_cut_at_end():
    assert pr.cut_at_end([5, 6, 1, 7], {1, 2}) == ([5, 6], True, 3)
    assert pr.cut_at_end([5, 6], {1}) == ([5, 6], False, 2)


def test_rank_slices_cover_the_manifest_once():
    for n in (0, 1, 5, 12):
        for world in (1, 2, 3, 8):
            parts = [range(*pr.rank_slice(n, r, world)) for r in range(world)]
            assert [i for p in parts for i in p] == list(range(n))


def test_merge_parts_refuses_a_missing_sample(preds, tmp_path):
    rows = read_predictions(preds[0])
    out = tmp_path / "preds.jsonl"
    write_predictions(pr.part_path(out, 0, 2), rows[:6])
    write_predictions(pr.part_path(out, 1, 2), rows[7:])
    with pytest.raises(RuntimeError, match="1 samples have no prediction"):
        pr.merge_parts(out, 2, [r.sample_id for r in rows])
    write_predictions(pr.part_path(out, 1, 2), rows[6:])
    assert pr.merge_parts(out, 2, [r.sample_id for r in rows]) == 12
    assert read_predictions(out) == rows
    assert not list(tmp_path.glob("*.part-*"))


def test_torchrun_two_ranks_match_one(preds, tiny_vl, built_shards, tmp_path):
    out = tmp_path / "preds.jsonl"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "train.predict", "--model", str(tiny_vl), "--shards", str(built_shards), "--out", str(out),
           "--batch-size", "5", "--max-new-tokens", "12"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_predictions(out) == read_predictions(preds[0])
    assert not list(tmp_path.glob("*.part-*"))


def test_oracle_answers_score_perfectly(built_shards, tmp_path):
    """The shard's own answer tokens, decoded and parsed the way predict does, give valid rows that
    evaluate scores as perfect: decode -> parse -> source time -> metrics lose nothing."""
    store = SampleStore(built_shards)
    tok = load_tokenizer()
    end = {special_id(tok, "<|im_end|>")}
    rows = []
    for sid in store.records:
        s = store.get(sid)
        answer, finished, n = pr.cut_at_end(s.input_ids[s.prompt_tokens:] + [0, 0], end)
        assert finished and n == len(s.input_ids) - s.prompt_tokens
        rows.append(pr.make_row(s.record, tok.decode(answer, skip_special_tokens=False), finished, n))
    assert all(r.status == "valid" and not r.degenerate for r in rows)
    assert [r.segments for r in rows] == [store.record(r.sample_id).segments for r in rows]
    report = ev.evaluate(rows, list(store.records.values()))
    w, v = report["window"], report["video"]
    assert w["miou"] == 1.0 and all(x == 1.0 for x in w["r1"].values())
    assert w["segment_prf@0.5"]["f1"] == 1.0 and w["negative_accuracy"] == 1.0
    assert v["frame_f1"]["keep"]["f1"] == 1.0 and v["frame_f1"]["cut"]["f1"] == 1.0
    assert report["format"]["valid_rate"] == 1.0


def test_cli_qwen3_5_with_adapter(built_shards, tiny_cache, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    model_dir = tiny_cache / "tiny_qwen3_5"
    base = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(str(tmp_path / "run" / "adapter"))
    out = tmp_path / "preds.jsonl"
    assert pr.main(["--model", str(model_dir), "--adapter", str(tmp_path / "run"), "--shards", str(built_shards),
                    "--out", str(out), "--limit", "3", "--batch-size", "2", "--max-new-tokens", "6"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["windows"] == 3
    assert [r.sample_id for r in read_predictions(out)] == ["vid_a/w0000", "vid_a/w0001", "vid_a/w0002"]
