"""Structured logs: one JSON object per line in RUN/logs/rank{r}.jsonl, fixed keys per kind of event.

Step lines always carry STEP_KEYS (null where a value does not apply), so a plot script can read any run.
Human text goes to stdout on rank 0 only; tqdm.write keeps it from tearing the progress bar.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

STEP_KEYS = ("step", "epoch", "sample_ids", "repeat", "input_tokens", "visual_tokens", "supervised_tokens", "loss",
             "lr", "grad_norm", "tokens_per_s", "seconds", "peak_alloc_gib", "peak_reserved_gib", "memory_kind",
             "phase_memory", "phase_seconds", "data_wait_share", "vision_cache", "phase")


class RunLog:
    def __init__(self, run_dir: Path, rank: int):
        self.rank = rank
        self.path = Path(run_dir) / "logs" / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")
        self.bar = None  # rank 0's tqdm bar, when one is open

    def event(self, event: str, **fields) -> dict:
        rec = {"event": event, "rank": self.rank, "time": round(time.time(), 3), **fields}
        self._f.write(json.dumps(rec, default=str) + "\n")
        self._f.flush()
        return rec

    def step(self, **fields) -> dict:
        missing = [k for k in STEP_KEYS if k not in fields]
        extra = [k for k in fields if k not in STEP_KEYS]
        if missing or extra:  # a code error, not a data problem: fail loudly
            raise KeyError(f"step log keys differ from STEP_KEYS: missing {missing}, unexpected {extra}")
        return self.event("step", **fields)

    def say(self, text: str) -> None:
        """Human line on rank 0's stdout (other ranks stay quiet)."""
        if self.rank != 0:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def read_log(run_dir: Path, rank: int = 0, event: str | None = None) -> list[dict]:
    path = Path(run_dir) / "logs" / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return [r for r in rows if event is None or r["event"] == event]
