"""`video-ora VERB ...`: one console entry point for the module verbs.

Each verb calls its module's own `main(argv)`, the function `python -m MODULE ...` runs, with the same
arguments and exit code, so the two spellings cannot drift: `video-ora prep build ...` is `python -m prep
build ...` (prep's own dispatcher picks build/inspect/verify), `video-ora train ...` is `python -m
train.main ...` (one process; for several GPUs launch `deepspeed --module train.main` or `torchrun -m
train.main`). A verb's module is imported only when that verb runs.
"""
from __future__ import annotations

import importlib
import os
import sys

# verb -> (module whose main(argv) runs, one line for --help)
VERBS = {
    "prep": ("prep.__main__", "videos + annotations -> token-budgeted shards (build), summarize (inspect), recheck (verify)"),
    "train": ("train.main", "fine-tune a Qwen3-VL / Qwen3.5 model on a build (LoRA or full, DeepSpeed ZeRO)"),
    "verify-adapter": ("train.verify_adapter", "reload a run's saved weights in a fresh process, compare every tensor"),
    "predict": ("train.predict", "answer every window of a build with a model (+ adapter) -> preds.jsonl with scores"),
    "evaluate": ("train.evaluate", "score preds.jsonl: R@1, mIoU, mAP, keep/cut F1 -> report.json + review page"),
    "export": ("train.export", "keep lists as JSON, CMX3600 EDL or an ffmpeg trim+concat script"),
}


def usage() -> str:
    lines = ["usage: video-ora VERB [-h] ...", "", "Fine-tune Qwen3-VL / Qwen3.5 video LLMs to answer with the time "
             "segments worth keeping.", "", "verbs:"]
    lines += [f"  {verb:<15} {text}" for verb, (_, text) in VERBS.items()]
    from prep.__main__ import VERBS as PREP_VERBS

    lines += ["", "prep verbs (video-ora prep VERB):"]
    lines += [f"  {verb:<15} {text}" for verb, (_, text) in PREP_VERBS.items()]
    modules = ", ".join(f"{v} = python -m {m.removesuffix('.__main__')}" for v, (m, _) in VERBS.items())
    lines += ["",
              "Pipeline: prep build -> train -> verify-adapter -> predict -> evaluate -> export.",
              "From a source checkout, `python -m scripts.demo --out demo` runs all of it on bundled sample videos.",
              "`video-ora VERB --help` shows a verb's flags. Each verb is also a module:",
              f"  {modules}.",
              "Long steps (prep build, prep verify, train, predict, verify-adapter) draw a progress bar on stderr",
              "when it is a terminal; --no-progress turns it off."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from prep.__main__ import pick_verb

    picked = pick_verb("video-ora", VERBS, sys.argv[1:] if argv is None else list(argv), usage())
    if isinstance(picked, int):
        return picked
    verb, rest = picked
    module = importlib.import_module(VERBS[verb][0])
    try:
        code = int(module.main(rest) or 0)
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    if verb == "train":
        # as `python -m train.main`: skip interpreter teardown (gloo / torch destructors take seconds per rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
