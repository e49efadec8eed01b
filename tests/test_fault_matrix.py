"""scripts/fault_matrix.py at its smallest setting: one kill -9 of `prep build` (whole process group, right
after a folder event of the reference build), rerun, compared with the reference byte for byte and by `prep
verify`. About 15 s. The training half (a kill inside a 2-rank checkpoint save, then resume) runs through
the same script's `train_point` in tests/test_train_main.py, against that module's uninterrupted run."""
from __future__ import annotations

import json
import os
import sys

from tests.train_helpers import REPO, run_group


def test_fault_matrix_smallest_build_sweep_recovers_the_kill(tmp_path):
    work = tmp_path / "work"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    proc = run_group([sys.executable, "-m", "scripts.fault_matrix", "--work", str(work), "--build-kills", "1",
                      "--train-kills", "0"], timeout=300, env=env, stderr_to_stdout=True)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    assert "build: 1/1 kill points recovered" in out and "train:" not in out, out[-4000:]
    summary = json.loads((work / "fault_matrix.json").read_text())
    assert summary["build"]["reference_events"] >= 4, summary  # temp tars, renames, sidecars, manifest were seen
    (point,) = summary["build"]["points"]
    assert point["killed"] and point["rerun_rc"] == 0 and point["same_sample_ids"] and point["byte_identical"]
    assert point["verify_rc"] == 0 and point["after_event"] >= 1 and "temp files" in point["on_disk_at_kill"], point
    assert not (work / "build_kill01").exists()  # a passing point's output is removed
