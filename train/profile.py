"""`--profile-steps N`: torch.profiler over N training steps, so "where does the step go" has an answer.

The first step is skipped (allocator warm-up, lazy kernels), the next N are recorded. Per rank it writes
RUN/profile/rank{r}.trace.json.gz (a Chrome trace: https://ui.perfetto.dev or chrome://tracing) and
RUN/profile/kernels_rank{r}.txt, the ops sorted by self device time (self CPU time on a CPU run), with each
one's share of the table's sum. On CUDA the table lists both aten ops and the kernels they launch (and the
ProfilerStep rows), so the shares overlap: read kernel totals from the trace. Profiling slows the steps it
records (their step lines do not mark them), so time runs without it.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch


class StepProfiler:
    """Call `step()` after every training step; records steps 1..N (0-based) of this process."""

    def __init__(self, steps: int, out_dir: Path, rank: int):
        self.steps, self.rank, self.out_dir = steps, rank, Path(out_dir)
        self._prof = None
        self._seen = 0
        self._t0 = 0.0

    def __enter__(self):
        if self.steps > 0:
            from torch.profiler import ProfilerActivity, profile, schedule

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=activities, schedule=schedule(wait=1, warmup=0, active=self.steps, repeat=1),
                                 on_trace_ready=self._write, record_shapes=False, with_stack=False)
            self._prof.__enter__()
        return self

    def step(self) -> None:
        if self._prof is None:
            return
        self._seen += 1
        if self._seen == 1:
            self._t0 = time.perf_counter()
        self._prof.step()

    def __exit__(self, *exc):
        if self._prof is not None:
            with contextlib.suppress(Exception) if exc[0] is not None else contextlib.nullcontext():
                self._prof.__exit__(*exc)
            self._prof = None
        return False

    def _write(self, prof) -> None:
        wall = time.perf_counter() - self._t0
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out_dir / f"rank{self.rank}.trace.json.gz"))
        cuda = torch.cuda.is_available()
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
        events.sort(key=lambda e: getattr(e, key), reverse=True)
        total_us = sum(getattr(e, key) for e in events)
        lines = [f"{self.steps} profiled step(s), {wall:.3f} s wall; ops by self {'device' if cuda else 'CPU'} time "
                 f"(sum {total_us / 1e6:.3f} s)", f"{'self s':>9} {'share':>6} {'calls':>7}  op"]
        for e in events[:60]:
            t = getattr(e, key)
            lines.append(f"{t / 1e6:9.4f} {t / max(total_us, 1):6.1%} {e.count:7d}  {e.key[:120]}")
        (self.out_dir / f"kernels_rank{self.rank}.txt").write_text("\n".join(lines) + "\n")
