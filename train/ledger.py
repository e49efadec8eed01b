"""The coverage ledger: what each rank actually trained, checked against the plan.

Each rank appends one line per optimizer step to RUN/ledger/rank{r}.jsonl (the micro-batches it consumed);
at each epoch end rank 0 runs `check_ledger`, which proves that every planned sample was trained exactly
once (pad repeats and dropped samples accounted), or names the ones that were not. A resumed run first
forgets the lines of steps it will train again (`truncate_ledger`).
"""
from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Sequence

from train.plan import EpochPlan, MicroBatch, PlanError



def ledger_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "ledger" / f"rank{rank}.jsonl"


def append_ledger(run_dir: str | Path, step: int, rank: int, micro_batches: Sequence[MicroBatch]) -> None:
    """Append what `rank` trained at global `step` to RUN/ledger/rank{rank}.jsonl (one line, one write)."""
    path = ledger_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"step": step, "rank": rank, "micro_batches": [mb.to_json() for mb in micro_batches]})
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()


def truncate_ledger(run_dir: str | Path, rank: int, from_step: int) -> int:
    """On resume: forget entries at or after `from_step` (trained after the checkpoint, about to be trained
    again). Returns how many lines were removed."""
    path = ledger_path(run_dir, rank)
    if not path.exists():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    keep = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] < from_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")
    tmp.replace(path)
    return len(lines) - len(keep)


@dataclasses.dataclass
class EpochCoverage:
    epoch: int
    planned: int  # distinct samples the plan trains this epoch
    consumed: int  # of those, consumed exactly once
    repeats_planned: int
    repeats_consumed: int
    dropped: list[str]
    unreached: list[str]
    missing: list[str]  # planned, never consumed
    duplicated: list[str]  # consumed more than once (not as a planned repeat)
    unexpected: list[str]  # consumed, not planned this epoch
    problems: list[str]  # step-level problems: missing/duplicate ledger lines, order mismatches

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.unexpected or self.problems) and (
            self.repeats_planned == self.repeats_consumed
        )


@dataclasses.dataclass
class LedgerReport:
    epochs: list[EpochCoverage]

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.epochs)

    def message(self) -> str:
        lines = []
        for e in self.epochs:
            tail = f"{e.repeats_consumed} pad repeats, {len(e.dropped)} dropped"
            if e.unreached:
                tail += f", {len(e.unreached)} not reached before --max-steps"
            if e.ok:
                lines.append(f"epoch {e.epoch}: {e.consumed}/{e.planned} planned samples consumed exactly once ({tail})")
                continue
            lines.append(f"epoch {e.epoch}: coverage FAILED: {e.consumed}/{e.planned} consumed exactly once ({tail})")
            for name, ids in (("missing", e.missing), ("duplicated", e.duplicated), ("unexpected", e.unexpected)):
                if ids:
                    lines.append(f"  {name}: {', '.join(ids[:20])}{' ...' if len(ids) > 20 else ''}")
            if e.repeats_planned != e.repeats_consumed:
                lines.append(f"  pad repeats: planned {e.repeats_planned}, consumed {e.repeats_consumed}")
            lines.extend(f"  {p}" for p in e.problems[:20])
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise PlanError(self.message())


def read_ledger(run_dir: str | Path) -> list[dict]:
    """Every ledger line of every rank."""
    entries = []
    for path in sorted((Path(run_dir) / "ledger").glob("rank*.jsonl")):
        for n, ln in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if ln.strip():
                try:
                    entries.append(json.loads(ln))
                except json.JSONDecodeError as e:
                    raise PlanError(f"{path}:{n}: not a JSON line ({e}); the ledger is damaged") from e
    return entries


def check_ledger(run_dir: str | Path, plans: Sequence[EpochPlan]) -> LedgerReport:
    """Prove every planned sample of each epoch in `plans` was consumed exactly once, repeats accounted.

    Ledger lines whose global step lies outside `plans` are ignored, so rank 0 can check each epoch as it
    ends by passing only that epoch's plan.
    """
    by_step: dict[tuple[int, int], list[dict]] = {}
    for e in read_ledger(run_dir):
        by_step.setdefault((e["step"], e["rank"]), []).append(e)
    report = []
    for plan in plans:
        world = plan.config.world_size if plan.config else (len(plan.steps[0]) if plan.steps else 0)
        problems: list[str] = []
        consumed: Counter[str] = Counter()
        repeats = 0
        for i, step in enumerate(plan.steps):
            g = plan.first_global_step + i
            for r in range(world):
                lines = by_step.get((g, r), [])
                if not lines:
                    problems.append(f"step {g} rank {r}: no ledger line (planned {_ids(step[r])})")
                    continue
                if len(lines) > 1:
                    problems.append(f"step {g} rank {r}: {len(lines)} ledger lines (trained more than once)")
                for line in lines:
                    got = [MicroBatch.from_json(m) for m in line["micro_batches"]]
                    if got != step[r]:
                        problems.append(f"step {g} rank {r}: trained {_ids(got)}, planned {_ids(step[r])}")
                    for mb in got:
                        for sid, rep in zip(mb.sample_ids, mb.repeat):
                            if rep:
                                repeats += 1
                            else:
                                consumed[sid] += 1
        planned = Counter(plan.sample_ids())
        report.append(EpochCoverage(
            epoch=plan.epoch,
            planned=len(planned),
            consumed=sum(1 for sid in planned if consumed[sid] == 1),
            repeats_planned=len(plan.repeated),
            repeats_consumed=repeats,
            dropped=list(plan.dropped),
            unreached=list(plan.unreached),
            missing=sorted(sid for sid in planned if consumed[sid] == 0),
            duplicated=sorted(sid for sid, n in consumed.items() if n > 1),
            unexpected=sorted(sid for sid in consumed if sid not in planned),
            problems=problems,
        ))
    return LedgerReport(epochs=report)


def _ids(mbs: Sequence[MicroBatch]) -> str:
    return "[" + "; ".join(",".join(s + ("*" if rep else "") for s, rep in zip(mb.sample_ids, mb.repeat)) for mb in mbs) + "]"
