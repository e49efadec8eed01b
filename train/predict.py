"""Generate answers for every window of a build: `python -m train.predict --model DIR --shards SHARDS --out preds.jsonl`.

The prompt is the training sample itself: the shard's input_ids up to prompt_tokens (chat template, the
`<t seconds>` video blocks, the query, the assistant turn opener) and the shard's frames, patchified by
train.data exactly as the trainer does. Nothing is re-rendered, so train/inference skew is impossible.

Greedy decoding by default, batched with left padding. Several GPUs: `torchrun --nproc_per_node N -m
train.predict ...`; the manifest is split into contiguous rank slices, each rank writes its part, rank 0
merges the parts in manifest order (a missing or duplicated sample is an error).

Each output is parsed by train.answer_parse (status valid|repaired|failed, degenerate flags) and mapped
to source time; each segment gets a score, the mean probability of its number tokens (train.scores), so
train.evaluate computes mAP from the model's own confidence. Rows follow schemas.predictions.PredictionRow.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

from schemas.build import BuildRecord
from schemas.manifest import SampleRecord, read_records
from schemas.prompt import DEFAULT_LAYOUT, LAYOUTS
from schemas.shard import ShardError
from schemas.predictions import PredictionRow, read_predictions, write_predictions
from train.answer_parse import parse_output
from train.data import MANIFEST, LoadedSample, SampleStore, VisionSpec, collate, preflight
from train.models import load_pretrained
from train.scores import segment_scores, token_ends
from train.segments import to_source

ADAPTER_DIR = "adapter"  # train.checkpoint.ADAPTER_DIR
NON_LORA = "non_lora_trainables.safetensors"  # train.checkpoint.NON_LORA
END_TOKENS = ("<|im_end|>", "<|endoftext|>")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PredictConfig:
    """What to predict with and on; validated at construction, every problem in one error."""

    model: Path  # save_pretrained directory (base model, or a full fine-tune's RUN/model)
    shards: Path  # build directory (manifest.parquet + tars)
    out: Path  # preds.jsonl
    adapter: Path | None = None  # training RUN dir (its adapter/ is loaded) or an adapter directory
    batch_size: int = 4  # windows per generate call
    max_new_tokens: int = 64  # an answer of 5 segments is ~60 tokens with the Qwen tokenizer
    device: str | None = None  # None: cuda:<local rank> when CUDA is available, else cpu
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32
    limit: int | None = None  # predict only the first N manifest samples (debugging)
    prompt_layout: str = DEFAULT_LAYOUT  # the layout the shards must have (the serving stack's, schemas/prompt.py)
    progress: bool = True  # rank 0's bar on stderr (shown only when stderr is a terminal)

    def __post_init__(self) -> None:
        problems = []
        if not (Path(self.model) / "config.json").is_file():
            problems.append(f"--model {self.model} has no config.json (need a save_pretrained directory)")
        if not (Path(self.shards) / MANIFEST).is_file():
            problems.append(f"--shards {self.shards} has no {MANIFEST} (need the output of `python -m prep build`)")
        if self.adapter is not None:
            try:
                resolve_adapter(self.adapter)
            except FileNotFoundError as e:
                problems.append(str(e))
        if self.batch_size < 1:
            problems.append(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.max_new_tokens < 1:
            problems.append(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.dtype not in DTYPES:
            problems.append(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.prompt_layout not in LAYOUTS:
            problems.append(f"--prompt-layout must be one of {sorted(LAYOUTS)}, got {self.prompt_layout!r}")
        if self.limit is not None and self.limit < 1:
            problems.append(f"--limit must be >= 1, got {self.limit}")
        if problems:
            raise ValueError("cannot predict:\n  " + "\n  ".join(problems))


DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_adapter(path: str | Path) -> Path:
    """The PEFT adapter directory of a training RUN (RUN/adapter) or the directory itself."""
    path = Path(path)
    for cand in (path, path / ADAPTER_DIR):
        if (cand / "adapter_config.json").is_file():
            return cand
    hint = f"; {path / 'model'} holds a full fine-tune: pass it as --model" if (path / "model" / "config.json").is_file() else ""
    raise FileNotFoundError(f"--adapter {path}: no adapter_config.json in it or in {path / ADAPTER_DIR}{hint}")


# ---------------------------------------------------------------- loading

def load_tokenizer_for(model_dir: Path, shards: Path):
    """The tokenizer that made the shards' ids: the model's own if it ships one, else the build's.

    Its special-token ids must equal those build.json recorded, or the decoded text would be wrong.
    """
    from schemas.prompt import load_tokenizer, special_id

    recorded = BuildRecord.read(shards).tokenizer
    if (model_dir / "tokenizer.json").is_file():
        tok = load_tokenizer(str(model_dir))
    elif not recorded.bundled and Path(recorded.path).is_dir():
        tok = load_tokenizer(recorded.path)
    else:
        tok = load_tokenizer(None)
    for name, want in recorded.special_token_ids.items():
        got = special_id(tok, name)
        if got != want:
            raise ValueError(f"tokenizer has {name}={got}, the build used {want}: the shards were tokenized with "
                             "another tokenizer than the model's")
    return tok


def load_model(model_dir: Path, adapter: Path | None, device: torch.device, dtype: torch.dtype):
    """Base model (+ trainable non-LoRA tensors + LoRA adapter), in eval mode on device."""
    model = load_pretrained(model_dir, dtype=dtype)
    if adapter is not None:
        from peft import PeftModel

        adapter = resolve_adapter(adapter)
        extra = adapter / NON_LORA
        if extra.is_file():  # --unfreeze-vision / --unfreeze-merger tensors saved beside the adapter
            from safetensors.torch import load_file

            state = load_file(str(extra))
            result = model.load_state_dict(state, strict=False)
            if result.unexpected_keys:
                raise ValueError(f"{extra}: {len(result.unexpected_keys)} tensors match no model parameter "
                                 f"(first: {result.unexpected_keys[:3]})")
        model = PeftModel.from_pretrained(model, str(adapter))
    return model.to(device).eval()


# ---------------------------------------------------------------- batching

def prompt_only(sample: LoadedSample) -> LoadedSample:
    """The sample cut at prompt_tokens: exactly what the model saw before the answer during training."""
    return dataclasses.replace(sample, input_ids=sample.input_ids[: sample.prompt_tokens])


def left_pad(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Turn collate's right padding into left padding (generation appends on the right)."""
    mask = tensors["attention_mask"]
    lengths = mask.sum(dim=1)
    out = dict(tensors)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        t = tensors[key].clone()
        for i, n in enumerate(lengths.tolist()):
            t[i] = torch.roll(tensors[key][i], shifts=int(mask.shape[1] - n))
        out[key] = t
    out.pop("labels", None)
    return out


def cut_at_end(ids: list[int], end_ids: set[int]) -> tuple[list[int], bool, int]:
    """(answer ids before the first end token, whether one was produced, tokens generated incl. the end)."""
    for i, tok in enumerate(ids):
        if tok in end_ids:
            return ids[:i], True, i + 1
    return ids, False, len(ids)


def make_row(record: SampleRecord, text: str, finished: bool, generated: int,
             probs: list[float] | None = None, ends: list[int] | None = None) -> PredictionRow:
    """The row of one window. probs / ends: probability and end offset in text of each answer token;
    with them every segment is scored (train.scores), without them scores stay None."""
    window_s = record.window_end_s - record.window_start_s
    parsed = parse_output(text, window_s, finished=finished)
    scores = None if probs is None else segment_scores(text, ends, probs, parsed.segments, window_s)
    return PredictionRow(
        sample_id=record.sample_id, video_id=record.video_id, source_path=record.source_path,
        window_index=record.window_index, window_start_s=record.window_start_s, window_end_s=record.window_end_s,
        raw_output=text, status=parsed.status, degenerate=parsed.degenerate, repairs=parsed.repairs,
        segments=parsed.segments, segments_source=to_source(parsed.segments, record.window_start_s),
        source_fps=record.source_fps, generated_tokens=generated,
        scores=scores,
    )


def end_token_ids(tokenizer, model) -> list[int]:
    """Ids that end an answer: <|im_end|> (required), <|endoftext|> when the vocabulary has it, and the
    model's generation_config eos ids. Looked up by exact token string: a saved Qwen3.5 tokenizer names
    <|endoftext|> its unk token, which schemas.prompt.special_id would refuse."""
    from schemas.prompt import special_id

    ids = [special_id(tokenizer, "<|im_end|>")]
    for tok in END_TOKENS[1:]:
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == tok:
            ids.append(i)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in [eos] if isinstance(eos, int) else (eos or []):
        ids.append(int(i))
    return list(dict.fromkeys(ids))


@torch.no_grad()
def generate_rows(model, tokenizer, store: SampleStore, sample_ids: list[str], *, batch_size: int,
                  max_new_tokens: int, device: torch.device, log=print, progress: bool = False) -> dict[str, PredictionRow]:
    """Rows for sample_ids, generated in batches of similar prompt length."""
    from tqdm import tqdm

    from schemas.prompt import special_id

    spec = VisionSpec.from_model_config(model.config)
    video_token_id = special_id(tokenizer, "<|video_pad|>")
    end_ids = end_token_ids(tokenizer, model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_ids[-1]
    vocab = model.get_input_embeddings().weight.shape[0]
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    order = sorted(sample_ids, key=lambda s: store.record(s).input_tokens - store.record(s).supervised_tokens)
    rows: dict[str, PredictionRow] = {}
    t0 = time.time()
    bar = tqdm(total=len(order), unit="window", desc="predict", disable=None if progress else True, dynamic_ncols=True)
    for b in range(0, len(order), batch_size):
        samples = [store.get(sid) for sid in order[b: b + batch_size]]
        for s in samples:
            preflight(s, spec=spec, video_token_id=video_token_id)
            if max(s.input_ids) >= vocab:
                raise ValueError(f"sample {s.record.sample_id}: token id {max(s.input_ids)} >= model vocabulary {vocab}")
        tensors, _ = collate([prompt_only(s) for s in samples], spec, video_token_id=video_token_id, pad_token_id=pad_id)
        tensors = left_pad(tensors)
        tensors["pixel_values_videos"] = tensors["pixel_values_videos"].to(dtype)
        tensors = {k: v.to(device) for k, v in tensors.items()}
        out = model.generate(**tensors, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=end_ids,
                             pad_token_id=pad_id, output_logits=True, return_dict_in_generate=True)
        new = out.sequences[:, tensors["input_ids"].shape[1]:]
        # probability of each chosen token under the raw (unprocessed) logits: the model's own confidence
        logits = torch.stack(out.logits, dim=1).float()  # (batch, new tokens, vocab)
        picked = logits.gather(2, new[:, : logits.shape[1], None]).squeeze(2)
        chosen = (picked - torch.logsumexp(logits, dim=-1)).exp()
        for s, ids, p in zip(samples, new.tolist(), chosen.tolist()):
            answer, finished, n = cut_at_end(ids, set(end_ids))
            text = tokenizer.decode(answer, skip_special_tokens=False)
            rows[s.record.sample_id] = make_row(s.record, text, finished, n, probs=p[: len(answer)],
                                                ends=token_ends(tokenizer, answer))
        bar.update(len(samples))
        line = json.dumps({"phase": "predict", "done": len(rows), "of": len(order), "seconds": round(time.time() - t0, 2)})
        with tqdm.external_write_mode():  # a log line must not tear the bar
            log(line)
    bar.close()
    return rows


# ---------------------------------------------------------------- ranks

def rank_slice(n: int, rank: int, world: int) -> tuple[int, int]:
    """Contiguous [start, end) of n manifest rows for this rank (sizes differ by at most one)."""
    return rank * n // world, (rank + 1) * n // world


def part_path(out: Path, rank: int, world: int) -> Path:
    return out.with_name(f"{out.name}.part-{rank:05d}-of-{world:05d}")


def merge_parts(out: Path, world: int, sample_ids: list[str]) -> int:
    """Rank 0: join every rank's part in manifest order, check coverage, remove the parts."""
    rows: dict[str, PredictionRow] = {}
    for r in range(world):
        for row in read_predictions(part_path(out, r, world)):
            if row.sample_id in rows:
                raise RuntimeError(f"sample {row.sample_id} predicted by two ranks")
            rows[row.sample_id] = row
    missing = [s for s in sample_ids if s not in rows]
    if missing or len(rows) != len(sample_ids):
        raise RuntimeError(f"{len(missing)} samples have no prediction after merging (first: {missing[:3]})")
    n = write_predictions(out, (rows[s] for s in sample_ids))
    for r in range(world):
        part_path(out, r, world).unlink()
    return n


def predict(cfg: PredictConfig, log=print) -> dict:
    """Run prediction on this rank (and merge on rank 0); returns a small summary."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if world > 1 and not torch.distributed.is_initialized():
        # gloo only serves the barrier before the merge; generation may take hours on slow ranks
        torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(hours=12))
    if cfg.device:
        device = torch.device(cfg.device)
    else:
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[cfg.dtype] or (torch.bfloat16 if device.type == "cuda" else torch.float32)

    records = read_records(cfg.shards / MANIFEST, SampleRecord)
    if cfg.limit:
        records = records[: cfg.limit]
    all_ids = [r.sample_id for r in records]
    start, end = rank_slice(len(records), rank, world)
    mine = all_ids[start:end]
    store = SampleStore(cfg.shards, records)
    store.check_layout(cfg.prompt_layout)
    store.index_for(mine)

    tokenizer = load_tokenizer_for(Path(cfg.model), Path(cfg.shards))
    model = load_model(Path(cfg.model), cfg.adapter, device, dtype)
    t0 = time.time()
    rows = generate_rows(model, tokenizer, store, mine, batch_size=cfg.batch_size,
                         max_new_tokens=cfg.max_new_tokens, device=device, log=log if rank == 0 else (lambda _: None),
                         progress=cfg.progress and rank == 0)
    seconds = time.time() - t0
    ordered = [rows[s] for s in mine]
    if world == 1:
        write_predictions(cfg.out, ordered)
    else:
        write_predictions(part_path(cfg.out, rank, world), ordered)
        torch.distributed.barrier()
        if rank == 0:
            merge_parts(cfg.out, world, all_ids)
        torch.distributed.barrier()
    summary = {"rank": rank, "world_size": world, "windows": len(mine), "seconds": round(seconds, 2),
               "status": {k: sum(r.status == k for r in ordered) for k in ("valid", "repaired", "failed")},
               "degenerate": sum(bool(r.degenerate) for r in ordered), "out": str(cfg.out)}
    return summary


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m train.predict", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="save_pretrained model directory")
    ap.add_argument("--adapter", type=Path, help="training RUN dir (loads RUN/adapter) or a PEFT adapter dir")
    ap.add_argument("--shards", type=Path, required=True, help="build directory of `python -m prep build`")
    ap.add_argument("--out", type=Path, required=True, help="preds.jsonl to write")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", help="cpu, cuda, cuda:1 (default: this rank's GPU, else cpu)")
    ap.add_argument("--dtype", default="auto", choices=sorted(DTYPES))
    ap.add_argument("--limit", type=int, help="only the first N manifest samples")
    ap.add_argument("--prompt-layout", choices=sorted(LAYOUTS), default=DEFAULT_LAYOUT,
                    help="prompt layout the shards must have been built with (prep build --prompt-layout); "
                         "shards of another layout are refused")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return ap


def config_from_argv(argv: list[str] | None = None) -> PredictConfig:
    """The PredictConfig of a `train.predict` command line (scripts build the same flags the CLI takes)."""
    return PredictConfig(**vars(parser().parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    try:
        summary = predict(config_from_argv(argv))
    except (ValueError, ShardError) as e:  # a config, schema, layout or data problem: the message says which
        print(f"train.predict: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
