"""The README's first command, scripts.demo, end to end at toy size (2 training steps, a few videos): every
stage runs as its own command and the outputs a newcomer opens exist. That the recipe behind it learns is
the learnability test's job (same recipe, full size), so no second real training run here."""
import json
import os
import sys

import pytest

from tests.train_helpers import run_group


@pytest.mark.slow
def test_demo_runs_every_stage_and_writes_the_review_page(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "scripts.demo", "--out", str(out), "--steps", "2", "--train-videos", "3",
           "--test-videos", "2"]
    # on timeout the demo and every stage it started are killed together
    proc = run_group(cmd, timeout=420, env=env)
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    lines = stdout.splitlines()
    for stage in ("prep train", "prep held-out", "predict before", "train", "verify", "predict", "evaluate", "export"):
        assert any(line.startswith(f"{stage} ") and " ok in " in line for line in lines), (stage, stdout)
    assert any(line.strip().startswith("before ") for line in lines) and any(line.strip().startswith("after ") for line in lines)
    assert "real clip bikes.mp4" in stdout
    assert "tensors equal" in (out / "logs" / "verify.log").read_text()
    # every stage's log says how its OpenMP wait policy was chosen; a stage started beside another is passive
    assert (out / "logs" / "train.log").read_text().startswith("[stage] OMP_WAIT_POLICY=")
    assert (out / "logs" / "verify.log").read_text().startswith("[stage] OMP_WAIT_POLICY=PASSIVE: 1 stage(s) beside")
    report = json.loads((out / "report.json").read_text())
    assert {v["video_id"] for v in report["per_video"]} >= {"bikes"} and report["counts"]["videos"] == 3
    page = (out / "review.html").read_text()
    assert page.count('<section class="video"') == 3 and 'src="videos/bikes.mp4"' in page
    assert (out / "keep.sh").is_file()
