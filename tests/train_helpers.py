"""Helpers for the trainer tests: tiny models, N-sample copies of `built_shards`, launching train.main."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.manifest import SampleRecord, read_records, write_records

REPO = Path(__file__).resolve().parent.parent


def op_counter(counts=lambda name: True):
    """A dispatch mode counting the aten ops that run inside it (those whose base name `counts` accepts).
    Entered outside a checkpoint's own modes it sees only real executions (a cached op is not re-run)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCount(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += bool(counts(func.__name__.split(".")[0]))
            return func(*args, **(kwargs or {}))

    return OpCount()


def subset_shards(src: Path, dst: Path, sample_ids: list[str]) -> Path:
    """A copy of a SHARDS dir whose manifest lists only `sample_ids` (the tars are shared as-is: the trainer
    must read only what the manifest lists)."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.name != "manifest.parquet" and p.is_file():
            shutil.copy2(p, dst / p.name)
    records = [r for r in read_records(src / "manifest.parquet", SampleRecord) if r.sample_id in set(sample_ids)]
    assert len(records) == len(sample_ids), (sample_ids, [r.sample_id for r in records])
    write_records(dst / "manifest.parquet", records, SampleRecord)
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    env.update(extra or {})
    return env


def launch(args: list[str], *, nproc: int = 2, env: dict | None = None, timeout: int = 400,
           launcher: str = "torchrun") -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc -m train.main ARGS`, or DeepSpeed's launcher (`deepspeed --num_gpus
    nproc --module train.main ARGS`), or with nproc 0 plain `python -m train.main ARGS`."""
    if nproc and launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port",
               str(free_port()), "--module", "train.main", *args]
    elif nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "train.main", *args]
    else:
        cmd = [sys.executable, "-m", "train.main", *args]
    return subprocess.run(cmd, cwd=REPO, env=train_env(env), capture_output=True, text=True, timeout=timeout)


def run_group(cmd: list[str], *, timeout: int, env: dict | None = None,
              stderr_to_stdout: bool = False) -> subprocess.CompletedProcess:
    """Run cmd from the repo root in a process group of its own; on timeout SIGKILL the whole group (the
    command and every stage or rank it started) and fail the test with the output's tail, so a hang costs
    `timeout` seconds and leaves nothing running."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True,
                            stderr=subprocess.STDOUT if stderr_to_stdout else subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s:\n{stdout[-4000:]}\n{(stderr or '')[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def verify(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train.verify_adapter", str(run_dir)], cwd=REPO, env=train_env(),
                          capture_output=True, text=True, timeout=300)


def events(run_dir: Path, rank: int = 0, event: str | None = None) -> list[dict]:
    path = run_dir / "logs" / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return [r for r in rows if event is None or r["event"] == event]


def steps(run_dir: Path, rank: int) -> dict[int, dict]:
    return {r["step"]: r for r in events(run_dir, rank, "step")}


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
