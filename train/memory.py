"""Per-phase memory: one helper that returns GiB and resets the peaks, and PhaseTracker, which knows this
rank's phase, injects the simulated faults there and accounts the memory of each phase.

On CUDA the numbers are `max_memory_allocated` / `max_memory_reserved` since the last reset. On CPU there
is no allocator to ask, so the process RSS stands in (labelled `cpu_rss`): `alloc` is the RSS now and
`reserved` the peak RSS of the process so far (the OS peak cannot be reset).

Every rank writes its latest numbers to RUN/memory/rank{r}.json once per training step (and after the load
and the save). An OOM report reads those files instead of running a collective, because the other ranks
may be stuck in one already.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import resource
import sys
import time
from pathlib import Path

import torch

from train.faults import armed

GIB = 2**30
PHASES = ("load", "data", "first_forward", "forward", "backward", "optimizer_step", "save")
FAIL_ENV = "VIDEO_ORA_FAIL_AT"  # debug hook: "phase:step[:rank]" raises a simulated OOM there


@dataclasses.dataclass(frozen=True)
class MemStat:
    alloc_gib: float  # CUDA: peak allocated since the last reset; CPU: RSS now
    reserved_gib: float  # CUDA: peak reserved since the last reset; CPU: peak RSS of the process
    kind: str  # "cuda" or "cpu_rss"


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def peak_memory(reset: bool = True) -> MemStat:
    """Peak memory of this process in GiB since the last call (CUDA), or the RSS stand-in (CPU)."""
    if _cuda():
        stat = MemStat(torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB, "cuda")
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return stat
    import psutil

    rss = psutil.Process().memory_info().rss / GIB
    # ru_maxrss is KiB on Linux, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024) / GIB
    return MemStat(rss, max(peak, rss), "cpu_rss")


def device_info() -> list[dict]:
    """The accelerators this process sees, with their memory (empty on CPU)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "total_gib": round(p.total_memory / GIB, 2)})
    return out


class PhaseTracker:
    """This rank's current phase, the fault hook and the memory of every phase, in one context manager.

    `with tracker.phase("backward", step):` makes "backward" the phase an error or OOM report names, raises
    the simulated OOM that VIDEO_ORA_FAIL_AT asks for there, and on exit takes the phase's peak (resetting
    it). Inside a training step (`begin_step` .. `end_step`) a phase that runs once per micro-batch keeps its
    max over the step, and RUN/memory/rank{r}.json is written once, by `end_step`; outside a step (load,
    save) the file is written as the phase ends.
    """

    def __init__(self, run_dir: Path, rank: int):
        self.path = Path(run_dir) / "memory" / f"rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.current = "setup"  # the phase running now, or the last one that ran
        self.latest: MemStat | None = None  # peak of the last phase that ended
        self.phases: dict[str, MemStat] = {}  # max per phase over the whole run (the summary table)
        self._step: int | None = None  # the training step being measured, None outside the loop
        self._step_peaks: dict[str, MemStat] = {}
        self._step_seconds: dict[str, float] = {}
        self.last_step_seconds: dict[str, float] = {}  # seconds per phase of the last step (data = waiting on the loader)
        self.last: dict = {}  # what the memory file holds

    @contextlib.contextmanager
    def phase(self, name: str, step: int):
        self.current = name
        maybe_fail(name, step, self.rank)
        t0 = time.perf_counter()
        yield
        if self._step is not None:  # wall seconds per phase within the step (CUDA work may still be queued)
            self._step_seconds[name] = self._step_seconds.get(name, 0.0) + time.perf_counter() - t0
        stat = peak_memory(reset=True)
        self.latest = stat
        self.phases[name] = _max(self.phases.get(name), stat)
        if self._step is None:
            self._write(name, step, stat)
        else:
            self._step_peaks[name] = _max(self._step_peaks.get(name), stat)

    def begin_step(self, step: int) -> None:
        self._step, self._step_peaks, self._step_seconds = step, {}, {}

    def end_step(self) -> dict[str, dict]:
        """The step's peak per phase ({phase: {alloc_gib, reserved_gib, kind}}); writes the memory file."""
        peaks = {k: _round(dataclasses.asdict(v)) for k, v in self._step_peaks.items()}
        if self._step_peaks:
            self._write(self.current, self._step, self._step_peaks[self.current] if self.current in self._step_peaks
                        else self.latest)
        self.last_step_seconds = {k: round(v, 4) for k, v in self._step_seconds.items()}
        self._step, self._step_peaks, self._step_seconds = None, {}, {}
        return peaks

    def snapshot(self, step: int | None) -> None:
        """Write the numbers now (an OOM report: the phase that failed never ended)."""
        self._write(self.current, step, peak_memory(reset=False))

    def _write(self, phase: str, step: int | None, stat: MemStat) -> None:
        self.last = {"rank": self.rank, "phase": phase, "step": step, **_round(dataclasses.asdict(stat)),
                     "phases": self.table_rows()}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.last))
        tmp.replace(self.path)

    def table_rows(self) -> dict:
        return {k: _round(dataclasses.asdict(v)) for k, v in self.phases.items()}


def _max(old: MemStat | None, new: MemStat) -> MemStat:
    if old is None:
        return new
    return MemStat(max(old.alloc_gib, new.alloc_gib), max(old.reserved_gib, new.reserved_gib), new.kind)


def _round(d: dict) -> dict:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items()}


def summary_table(per_rank: list[dict]) -> str:
    """Human table: one row per (rank, phase) with peak alloc / reserved GiB."""
    kind = next((v["kind"] for rows in per_rank for v in rows.values()), "cuda")
    head = "peak alloc / reserved GiB" if kind == "cuda" else "CPU stand-in: RSS at phase end / peak RSS GiB"
    lines = [f"memory per rank and phase ({head})", f"{'rank':>4}  " + "  ".join(f"{p:>16}" for p in PHASES)]
    for r, rows in enumerate(per_rank):
        cells = []
        for p in PHASES:
            v = rows.get(p)
            cells.append(f"{v['alloc_gib']:>7.2f}/{v['reserved_gib']:<8.2f}" if v else f"{'-':>16}")
        lines.append(f"{r:>4}  " + "  ".join(cells))
    return "\n".join(lines)


def all_ranks_memory(run_dir: Path) -> list[dict]:
    """The last memory record each rank wrote (for an OOM report; no collective)."""
    out = []
    for path in sorted((Path(run_dir) / "memory").glob("rank*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:  # a rank may be mid-write; say so instead of failing the report
            out.append({"file": str(path), "unreadable": str(e)})
    return out


def maybe_fail(phase: str, step: int, rank: int) -> None:
    """Debug hook: VIDEO_ORA_FAIL_AT=phase:step[:rank] raises a simulated torch.OutOfMemoryError there."""
    spec = armed(FAIL_ENV, phase, step, rank)
    if spec:
        raise torch.OutOfMemoryError(f"simulated out of memory ({FAIL_ENV}={spec})")


def gpu_memory_in_use(local_index: int | None = None) -> list[dict]:
    """Memory already used on the GPUs before this process loads anything: every visible device through NVML
    (no CUDA context is created) where pynvml imports, else this rank's own device via cudaMemGetInfo. Empty
    without CUDA. Each entry: index, name, total_gib, used_gib (by anything on the device), free_gib, source."""
    if not torch.cuda.is_available():
        return []
    try:
        import pynvml

        pynvml.nvmlInit()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            info = pynvml.nvmlDeviceGetMemoryInfo(h)
            procs = [{"pid": p.pid, "used_gib": round((p.usedGpuMemory or 0) / GIB, 2)}
                     for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
            out.append({"index": i, "name": pynvml.nvmlDeviceGetName(h), "total_gib": round(info.total / GIB, 2),
                        "used_gib": round(info.used / GIB, 2), "free_gib": round(info.free / GIB, 2),
                        "processes": procs, "source": "nvml"})
        return out
    except Exception:  # no pynvml / no NVML library: this rank's device through the CUDA runtime instead
        i = torch.cuda.current_device() if local_index is None else local_index
        free, total = torch.cuda.mem_get_info(i)
        ours = torch.cuda.memory_reserved(i)
        return [{"index": i, "name": torch.cuda.get_device_name(i), "total_gib": round(total / GIB, 2),
                 "used_gib": round((total - free - ours) / GIB, 2), "free_gib": round(free / GIB, 2),
                 "source": "cudaMemGetInfo (this process's CUDA context included)"}]


def apply_mem_cap(cap_gib: float, index: int) -> float:
    """Cap this process's CUDA caching allocator at cap_gib on device `index` (a smaller card, simulated);
    returns the fraction set. Allocations beyond it raise torch.OutOfMemoryError like a full card."""
    total = torch.cuda.get_device_properties(index).total_memory
    if cap_gib * GIB > total:
        raise ValueError(f"--mem-cap-gib {cap_gib} exceeds the device's {total / GIB:.1f} GiB")
    fraction = cap_gib * GIB / total
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


HISTORY_ENTRIES = 200_000  # allocator events kept while recording (a ring buffer)


def record_allocations(on: bool) -> bool:
    """Start (or stop) CUDA's allocation history with Python stacks; returns whether it is recording. On from
    the load to the end of the first step (where out-of-memory errors happen), so that an OOM report names
    the code holding the memory, not only the totals (the planner's misses are found that way). A no-op
    without CUDA."""
    if not torch.cuda.is_available():
        return False
    torch.cuda.memory._record_memory_history(enabled="all" if on else None, stacks="python",
                                             max_entries=HISTORY_ENTRIES)
    return on


def history_breaks_training(zero_stage: int, checkpointing: str) -> bool:
    """Whether recording the allocation history would break the run itself. With torch 2.11 on one H200,
    ZeRO-3 with checkpointed layers failed in the first forward with "SystemError: <built-in method apply of
    FunctionMeta> returned NULL without setting an exception" inside DeepSpeed's and liger's autograd
    Functions while recording (two legs; without recording the same legs ran), the regression reported as
    pytorch/pytorch#179536 (recording + activation checkpointing + a custom autograd Function). ZeRO-2 with
    checkpointed layers recorded fine in the same call, so only this combination goes without."""
    return zero_stage == 3 and checkpointing != "none"


def live_allocations_by_site(snapshot: dict, *, top: int = 20) -> list[dict]:
    """The allocated blocks of a `torch.cuda.memory._snapshot()` grouped by where they were allocated (the
    first two stack frames outside torch itself, e.g. a model's line and its caller), largest first."""
    sites: dict[str, list[int]] = {}
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = [f for f in block.get("frames") or [] if "/torch/" not in f.get("filename", "")]
            site = " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames[:2]) or "unrecorded"
            entry = sites.setdefault(site, [0, 0])
            entry[0] += int(block.get("requested_size") or block.get("size") or 0)
            entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"site": site, "gib": round(size / GIB, 4), "blocks": count} for site, (size, count) in ranked]
