"""RUN/run.json: everything needed to say what ran, on what, from which code and data.

Written by rank 0 once the DeepSpeed config is final (before the model loads), updated at the end with the
outcome. A reader should be able to rerun the same thing from this file alone.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from schemas.versions import package_versions

ENV_PREFIXES = ("VIDEO_", "NCCL_", "DS_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
             "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF", "MODEL_SEQ_LEN")
REPO = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("prep", "train", "schemas")


def git_state(repo: Path = REPO) -> dict:
    """Commit and dirty flag of the source tree (None when it is not a git checkout)."""
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no", "--", *SOURCE_DIRS)
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def source_hash(repo: Path = REPO) -> str:
    """sha256 over the package's .py and .json sources (path + bytes), so an uncommitted edit shows."""
    h = hashlib.sha256()
    for d in SOURCE_DIRS:
        for path in sorted((repo / d).rglob("*")):
            if path.suffix in (".py", ".json") and path.is_file() and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(repo)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def file_sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def relevant_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def build_run_record(*, config: dict, ds_config: dict, shards: Path, world_size: int, devices: list[dict],
                     model_dir: str, family: str, plan_summary: str) -> dict:
    return {
        "interpreter": sys.executable,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": package_versions(),
        "git": git_state(),
        "source_sha256": source_hash(),
        "argv": [sys.executable, *sys.orig_argv[1:]] if hasattr(sys, "orig_argv") else sys.argv,
        "env": relevant_env(),
        "config": config,
        "deepspeed_config": ds_config,
        "manifest": {"shards": str(shards), "build_json_sha256": file_sha256(shards / "build.json"),
                     "manifest_sha256": file_sha256(shards / "manifest.parquet")},
        "model": {"dir": model_dir, "family": family},
        "world_size": world_size,
        "devices": devices,
        "plan": plan_summary,
        "status": "running",
    }


def write_json(path: Path, data: dict) -> None:
    """Atomic JSON write (temporary name, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def update_run_record(path: Path, **fields) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(fields)
    write_json(path, data)
