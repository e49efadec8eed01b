"""Check a run's saved weights in a fresh process: `python -m train.verify_adapter RUN`.

LoRA runs: load the base model and RUN/adapter with PEFT exactly as a user would, then
  1. every tensor in the adapter files equals (sha256 of its bytes) what the trainer had in memory when it
     saved (RUN/adapter/saved_tensors.json) - catches a damaged or altered file;
  2. every tensor in the files is elementwise equal to the tensor PEFT loaded into the model - catches a key
     PEFT silently skips or maps elsewhere.
Full fine-tunes: the same two checks on RUN/model loaded with plain `from_pretrained` (no missing or
unexpected keys allowed). Prints "N/N tensors equal"; exits 1 naming every differing tensor.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from train.checkpoint import ADAPTER_DIR, DIGESTS, MODEL_DIR, NON_LORA, tensor_sha256
from train.models import load_pretrained


def _dtype(run: dict) -> torch.dtype:
    return torch.bfloat16 if (run.get("config") or {}).get("dtype", "bf16") == "bf16" else torch.float32


def _compare(name: str, file_t: torch.Tensor, loaded: torch.Tensor | None) -> str | None:
    if loaded is None:
        return f"{name}: in the file but not loaded into the model (key not matched)"
    loaded = loaded.detach().to("cpu")
    if loaded.shape != file_t.shape:
        return f"{name}: shape {list(file_t.shape)} in the file, {list(loaded.shape)} loaded"
    # Loading may upcast (PEFT keeps adapters in fp32 by default); an exact upcast round-trips.
    if not torch.equal(loaded.to(file_t.dtype), file_t) or not torch.equal(loaded, file_t.to(loaded.dtype)):
        diff = (loaded.float() - file_t.float()).abs().max().item()
        return f"{name}: loaded tensor differs from the file (max abs diff {diff:.3g})"
    return None


def _digest_problems(files: dict[str, dict[str, torch.Tensor]], digests: dict[str, dict[str, str]]) -> list[tuple[str, str]]:
    """(tensor key, problem) for every file tensor that is not what the trainer had in memory at save."""
    problems = []
    for fname, tensors in files.items():
        want = digests.get(fname, {})
        for key, t in tensors.items():
            if key not in want:
                problems.append((key, f"{fname}:{key}: not recorded at save time (unexpected tensor)"))
            elif tensor_sha256(t) != want[key]:
                problems.append((key, f"{fname}:{key}: differs from the tensor the trainer saved (file altered or damaged)"))
        for key in want:
            if key not in tensors:
                problems.append((key, f"{fname}:{key}: recorded at save time but missing from the file"))
    return problems


def _bar(total: int, progress: bool):
    """Bar over the tensor comparisons (stderr, terminals only): large models have thousands."""
    from tqdm import tqdm

    return tqdm(total=total, unit="tensor", desc="verify", disable=None if progress else True, dynamic_ncols=True)


def verify_lora(run_dir: Path, run: dict, base: Path, progress: bool = False) -> tuple[int, list[tuple[str, str]]]:
    from peft import PeftModel
    from safetensors.torch import load_file

    adapter = run_dir / ADAPTER_DIR
    files = {"adapter_model.safetensors": load_file(str(adapter / "adapter_model.safetensors"))}
    if (adapter / NON_LORA).exists():
        files[NON_LORA] = load_file(str(adapter / NON_LORA))
    digests = json.loads((adapter / DIGESTS).read_text())
    problems = _digest_problems(files, {k: v for k, v in digests.items() if v or k in files})

    model = load_pretrained(base, dtype=_dtype(run))
    if NON_LORA in files:
        missing = [k for k in files[NON_LORA] if k not in dict(model.named_parameters())]
        problems += [(k, f"{NON_LORA}:{k}: no such base model parameter") for k in missing]
        model.load_state_dict({k: v for k, v in files[NON_LORA].items() if k not in missing}, strict=False)
    model = PeftModel.from_pretrained(model, str(adapter))
    params = dict(model.named_parameters())
    n = 0
    bar = _bar(sum(len(t) for t in files.values()), progress)
    for key, t in files["adapter_model.safetensors"].items():
        bar.update(1)
        # PEFT file keys drop the adapter name: ...q_proj.lora_A.weight -> ...q_proj.lora_A.default.weight
        name = key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        p = _compare(key, t, params.get(name))
        n += 1
        if p:
            problems.append((key, p))
    base_params = dict(model.get_base_model().named_parameters())
    for key, t in files.get(NON_LORA, {}).items():
        bar.update(1)
        n += 1
        p = _compare(key, t, base_params.get(key))
        if p:
            problems.append((key, p))
    bar.close()
    return n, problems


def verify_full(run_dir: Path, run: dict, progress: bool = False) -> tuple[int, list[tuple[str, str]]]:
    from safetensors.torch import load_file

    model_dir = run_dir / MODEL_DIR
    files = {p.name: load_file(str(p)) for p in sorted(model_dir.glob("*.safetensors"))}
    digests = json.loads((model_dir / DIGESTS).read_text())
    problems = _digest_problems(files, {k: v for k, v in digests.items()})
    model, info = load_pretrained(model_dir, dtype=_dtype(run), output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(kind):
            problems.append(("", f"from_pretrained reports {kind}: {sorted(map(str, info[kind]))[:20]}"))
    from train.load_check import map_checkpoint_keys

    state = model.state_dict()
    n = 0
    bar = _bar(sum(len(t) for t in files.values()), progress)
    for fname, tensors in files.items():
        mapping, _ = map_checkpoint_keys(model, tensors)
        for key, t in tensors.items():
            bar.update(1)
            n += 1
            p = _compare(key, t, state.get(mapping[key]))
            if p:
                problems.append((key, p))
    bar.close()
    return n, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="train.verify_adapter", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="run directory written by train.main")
    ap.add_argument("--base", type=Path, default=None, help="base model directory (default: the one in RUN/run.json)")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar (stderr, terminals only)")
    a = ap.parse_args(argv)
    run_json = a.run / "run.json"
    if not run_json.exists():
        print(f"error: {run_json} not found", file=sys.stderr)
        return 2
    run = json.loads(run_json.read_text())
    finetune = (run.get("config") or {}).get("finetune", "lora")
    if finetune == "lora":
        base = a.base or Path(run["model"]["dir"])
        total, problems = verify_lora(a.run, run, base, a.progress)
    else:
        total, problems = verify_full(a.run, run, a.progress)
    bad = {key for key, _ in problems if key}
    print(f"{total - len(bad)}/{total} tensors equal")
    if problems:
        print(f"FAILED ({len(problems)} problems):", file=sys.stderr)
        for _, p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
