"""The data plan: which sample goes to which rank, micro-batch and step, decided before any weight loads.

Every rank computes the same plan from the same manifest (sorted by sample_id, then a seeded shuffle per
epoch), so no rank needs to talk to another to know what it trains. The plan is plain data: print it,
test it, write it next to the run. The coverage ledger (train/ledger.py) records what each rank actually
consumed and proves it against this plan.

Layout of `EpochPlan.steps`: [step][rank][accum] -> MicroBatch. Within a global step, samples (fixed
micro-batch size) or micro-batches (token budget) are dealt round-robin over ranks, so a tail padded with
repeats spreads its repeats over ranks instead of piling them on the last one.
"""
from __future__ import annotations

import dataclasses
import random
from collections import Counter
from typing import Iterable, Sequence

from schemas.manifest import SampleRecord

TAILS = ("error", "pad", "drop")
BUCKET_SAMPLES_PER_SLOT = 64  # length grouping sorts within buckets of 64 samples per micro-batch of a global step


class PlanError(ValueError):
    """The samples cannot be laid out as asked; the message says the numbers and the options."""


def batching_problems(*, tail: str, micro_batch_size: int, max_tokens_per_batch: int | None,
                      max_samples_per_batch: int | None = None) -> list[str]:
    """The tail and token-budget rules, shared by PlanConfig and the trainer's up-front flag check."""
    problems: list[str] = []
    if tail not in TAILS:
        problems.append(f"tail must be one of {'|'.join(TAILS)}, got {tail!r}")
    if max_tokens_per_batch is not None:
        if max_tokens_per_batch < 1:
            problems.append(f"max_tokens_per_batch must be >= 1, got {max_tokens_per_batch}")
        if micro_batch_size != 1:
            problems.append(
                f"micro_batch_size={micro_batch_size} and max_tokens_per_batch={max_tokens_per_batch} "
                "are exclusive: with a token budget micro-batches hold a variable number of samples "
                "(cap it with max_samples_per_batch)"
            )
    if max_samples_per_batch is not None:
        if max_tokens_per_batch is None:
            problems.append("max_samples_per_batch only applies with max_tokens_per_batch")
        elif max_samples_per_batch < 1:
            problems.append(f"max_samples_per_batch must be >= 1, got {max_samples_per_batch}")
    return problems


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """How samples become steps. Validated at construction."""

    world_size: int  # data-parallel ranks
    micro_batch_size: int = 1  # samples per micro-batch (fixed mode); must stay 1 with max_tokens_per_batch
    grad_accum: int = 1  # micro-batches per rank per optimizer step
    seed: int = 0  # shuffle seed; each epoch shuffles with (seed, epoch)
    tail: str = "error"  # what to do with samples that do not fill a whole global step: error|pad|drop
    max_tokens_per_batch: int | None = None  # token budget per micro-batch (padded size); None = fixed size
    max_samples_per_batch: int | None = None  # optional cap on samples per micro-batch in token mode
    pack: bool = False  # token mode counts the samples' tokens (one packed row), not longest x samples

    def __post_init__(self) -> None:
        problems = []
        for name in ("world_size", "micro_batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        problems += batching_problems(tail=self.tail, micro_batch_size=self.micro_batch_size,
                                      max_tokens_per_batch=self.max_tokens_per_batch,
                                      max_samples_per_batch=self.max_samples_per_batch)
        if self.pack and self.max_tokens_per_batch is None:
            problems.append("pack needs max_tokens_per_batch (the packed row's token budget)")
        if problems:
            raise PlanError("invalid plan config: " + "; ".join(problems))

    @property
    def token_mode(self) -> bool:
        return self.max_tokens_per_batch is not None

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches in one global (optimizer) step, over all ranks."""
        return self.world_size * self.grad_accum

    @property
    def samples_per_step(self) -> int:
        """Samples in one global step in fixed mode: the effective batch size."""
        return self.micro_batch_size * self.world_size * self.grad_accum


@dataclasses.dataclass
class MicroBatch:
    """The samples one rank feeds through one forward/backward."""

    sample_ids: list[str]
    repeat: list[bool]  # repeat[i]: sample_ids[i] is a pad repeat (trained again to fill the tail)

    def to_json(self) -> dict:
        return {"sample_ids": list(self.sample_ids), "repeat": list(self.repeat)}

    @classmethod
    def from_json(cls, data: dict) -> "MicroBatch":
        return cls(sample_ids=list(data["sample_ids"]), repeat=[bool(r) for r in data["repeat"]])


@dataclasses.dataclass
class EpochPlan:
    """One epoch of the run, identical on every rank."""

    epoch: int
    steps: list[list[list[MicroBatch]]]  # [step][rank][accum]
    dropped: list[str]  # sample ids left out by tail=drop
    repeated: list[str]  # sample ids trained a second time by tail=pad (one entry per repeat)
    config: PlanConfig | None = None
    num_samples: int = 0  # samples in the manifest
    first_global_step: int = 0  # global (run-wide) index of steps[0]
    unreached: list[str] = dataclasses.field(default_factory=list)  # planned, but after --max-steps ends the run

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def for_rank(self, rank: int) -> list[list[MicroBatch]]:
        """[step][accum] micro-batches of one rank, in training order."""
        return [step[rank] for step in self.steps]

    def sample_ids(self, *, repeats: bool = False) -> list[str]:
        """Every sample id the plan trains, in plan order (pad repeats only when asked)."""
        return [
            sid
            for step in self.steps
            for rank in step
            for mb in rank
            for sid, rep in zip(mb.sample_ids, mb.repeat)
            if repeats or not rep
        ]

    def to_json(self) -> dict:
        return {
            "epoch": self.epoch,
            "first_global_step": self.first_global_step,
            "num_samples": self.num_samples,
            "config": dataclasses.asdict(self.config) if self.config else None,
            "steps": [[[mb.to_json() for mb in rank] for rank in step] for step in self.steps],
            "dropped": list(self.dropped),
            "repeated": list(self.repeated),
            "unreached": list(self.unreached),
        }

    def describe(self) -> str:
        """The human summary rank 0 prints before loading the model."""
        cfg = self.config
        trained = len(self.sample_ids())
        lines = [f"epoch {self.epoch}: {self.num_samples} samples -> {self.num_steps} steps "
                 f"(global steps {self.first_global_step}..{self.first_global_step + self.num_steps - 1})"]
        if cfg is not None:
            if cfg.token_mode:
                cap = f", at most {cfg.max_samples_per_batch} samples" if cfg.max_samples_per_batch else ""
                sizes = [len(mb.sample_ids) for step in self.steps for rank in step for mb in rank]
                size = "packed row" if cfg.pack else "padded size"
                lines.append(
                    f"  micro-batches by token budget: {size} <= {cfg.max_tokens_per_batch} tokens{cap} "
                    f"({min(sizes, default=0)}..{max(sizes, default=0)} samples each); per global step "
                    f"{cfg.world_size} ranks x {cfg.grad_accum} accum = {cfg.micro_batches_per_step} micro-batches"
                )
            else:
                lines.append(
                    f"  effective batch = {cfg.micro_batch_size} micro x {cfg.world_size} ranks x "
                    f"{cfg.grad_accum} accum = {cfg.samples_per_step} samples per step"
                )
            lines.append(f"  tail: {cfg.tail}")
        lines.append(f"  trained: {trained} samples once, {len(self.repeated)} pad repeats, {len(self.dropped)} dropped")
        if self.repeated:
            lines.append(f"  repeated (tail=pad): {', '.join(self.repeated)}")
        if self.dropped:
            lines.append(f"  dropped (tail=drop): {', '.join(self.dropped)}")
        if self.unreached:
            lines.append(f"  not reached before --max-steps: {len(self.unreached)} samples")
        return "\n".join(lines)


def _shuffled(records: Sequence[SampleRecord], cfg: PlanConfig, epoch: int) -> tuple[list[SampleRecord], random.Random]:
    """Records sorted by id (manifest row order must not matter), then shuffled with (seed, epoch)."""
    if not records:
        raise PlanError("the manifest holds no samples: nothing to train")
    ordered = sorted(records, key=lambda r: r.sample_id)
    dupes = [sid for sid, n in Counter(r.sample_id for r in ordered).items() if n > 1]
    if dupes:
        raise PlanError(f"duplicate sample ids in the manifest: {', '.join(dupes[:10])}")
    # A string seed hashes with sha512, the same in every process (unlike hash()).
    rng = random.Random(f"video-ora-plan:{cfg.seed}:{epoch}")
    rng.shuffle(ordered)
    return ordered, rng


def _options(cfg: PlanConfig) -> str:
    unit = "micro-batches" if cfg.token_mode else "samples"
    return (
        f"options: --tail pad (repeat {unit} to fill the last step, marked as repeats), "
        f"--tail drop (leave the tail out, ids listed), a smaller --micro-batch-size / --grad-accum, or fewer ranks"
    )


def _numbers(cfg: PlanConfig, n_samples: int) -> str:
    if cfg.token_mode:
        return (
            f"world size {cfg.world_size}, grad accum {cfg.grad_accum}, token budget {cfg.max_tokens_per_batch} "
            f"-> {cfg.micro_batches_per_step} micro-batches per global step; {n_samples} samples"
        )
    return (
        f"{n_samples} samples, world size {cfg.world_size}, micro batch {cfg.micro_batch_size}, grad accum "
        f"{cfg.grad_accum} -> {cfg.samples_per_step} samples per global step"
    )


def _group_by_tokens(records: list[SampleRecord], cfg: PlanConfig, rng: random.Random) -> list[list[SampleRecord]]:
    """Length grouping: sort within shuffled buckets, fill greedily under the budget (padded size, or the sum
    of tokens when packing), shuffle batches."""
    budget = cfg.max_tokens_per_batch
    assert budget is not None
    over = [r for r in records if r.input_tokens > budget]
    if over:
        worst = sorted(over, key=lambda r: r.sample_id)
        names = ", ".join(f"{r.sample_id} ({r.input_tokens} tokens)" for r in worst[:10])
        raise PlanError(
            f"{len(over)} sample(s) exceed --max-tokens-per-batch {budget} on their own: {names}; "
            f"raise the budget to at least {max(r.input_tokens for r in over)} or rebuild with a smaller video budget"
        )
    cap = cfg.max_samples_per_batch or len(records)
    bucket = BUCKET_SAMPLES_PER_SLOT * cfg.micro_batches_per_step
    batches: list[list[SampleRecord]] = []
    for start in range(0, len(records), bucket):
        chunk = sorted(records[start:start + bucket], key=lambda r: (-r.input_tokens, r.sample_id))
        current: list[SampleRecord] = []
        for r in chunk:
            if current and (_size(current + [r], cfg.pack) > budget or len(current) >= cap):
                batches.append(current)
                current = []
            current.append(r)
        if current:
            batches.append(current)
    rng.shuffle(batches)
    return batches


def _size(batch: list[SampleRecord], pack: bool) -> int:
    """Tokens a micro-batch occupies: its samples' sum when packed into one row, else longest x samples
    (right padding; the batch is sorted longest first)."""
    if pack:
        return sum(r.input_tokens for r in batch)
    return batch[0].input_tokens * len(batch)


def _apply_tail(units: list[list[str]], per_step: int, cfg: PlanConfig, n_samples: int, min_real: int) -> tuple[
    list[list[str]], list[bool], list[str]
]:
    """Tail rule on `units` (a unit is one sample id in fixed mode, one micro-batch in token mode).

    Returns (units, is_repeat per unit, dropped ids). `min_real` is how many real units the ranks need so
    that none of them ends up with nothing (or only repeats).
    """
    unit = "micro-batches" if cfg.token_mode else "samples"
    n = len(units)
    if n < min_real:
        raise PlanError(
            f"{_numbers(cfg, n_samples)}: only {n} {unit} for {cfg.world_size} ranks, so rank {n} would get no "
            f"batch at all; --tail pad/drop cannot fix this. Use fewer ranks (at most {n}) or more samples."
        )
    rest = n % per_step
    if rest == 0:
        return units, [False] * n, []
    if cfg.tail == "error":
        raise PlanError(
            f"{_numbers(cfg, n_samples)}: {n} {unit} do not fill whole global steps of {per_step} "
            f"({n // per_step} full steps, {rest} left over). {_options(cfg)}."
        )
    if cfg.tail == "drop":
        if n // per_step == 0:
            raise PlanError(
                f"{_numbers(cfg, n_samples)}: --tail drop would drop all {n} {unit} (fewer than the {per_step} "
                f"of one global step), so no rank would get a batch. Use --tail pad, a smaller "
                f"--micro-batch-size / --grad-accum, or fewer ranks."
            )
        dropped = [sid for u in units[n - rest:] for sid in u]
        return units[: n - rest], [False] * (n - rest), dropped
    # pad: repeat units from the start of the shuffled order (deterministic, spread over the epoch).
    need = per_step - rest
    extra = [units[i % n] for i in range(need)]
    return units + extra, [False] * n + [True] * need, []


def plan_epoch(records: Sequence[SampleRecord], cfg: PlanConfig, epoch: int) -> EpochPlan:
    """The plan of one epoch; raises PlanError (before anything loads) when it cannot be laid out."""
    ordered, rng = _shuffled(records, cfg, epoch)
    W, A = cfg.world_size, cfg.grad_accum
    steps: list[list[list[MicroBatch]]] = []
    if cfg.token_mode:
        groups = [[r.sample_id for r in b] for b in _group_by_tokens(ordered, cfg, rng)]
        units, rep, dropped = _apply_tail(groups, W * A, cfg, len(ordered), min_real=W)
        for base in range(0, len(units), W * A):
            # micro-batch index within the step = a * W + rank: dealt round-robin over ranks
            idx = [[base + a * W + r for a in range(A)] for r in range(W)]
            steps.append([[MicroBatch(sample_ids=list(units[i]), repeat=[rep[i]] * len(units[i])) for i in rank]
                          for rank in idx])
    else:
        B = cfg.micro_batch_size
        G = cfg.samples_per_step
        ids = [[r.sample_id] for r in ordered]
        units, rep, dropped = _apply_tail(ids, G, cfg, len(ordered), min_real=W)
        flat = [u[0] for u in units]
        for s in range(len(flat) // G):
            base = s * G
            step = []
            for r in range(W):
                # sample index within the step = (a * B + j) * W + rank: dealt round-robin over ranks
                idx = [[base + (a * B + j) * W + r for j in range(B)] for a in range(A)]
                step.append([MicroBatch(sample_ids=[flat[i] for i in mb], repeat=[rep[i] for i in mb]) for mb in idx])
            steps.append(step)
    plan = EpochPlan(epoch=epoch, steps=steps, dropped=dropped, repeated=_repeats(steps), config=cfg,
                     num_samples=len(ordered))
    for r in range(W):
        if not any(not rep for accum in plan.for_rank(r) for mb in accum for rep in mb.repeat):
            raise PlanError(f"{_numbers(cfg, len(ordered))}: rank {r} would train only pad repeats. Use fewer ranks.")
    return plan


def _repeats(steps: list[list[list[MicroBatch]]]) -> list[str]:
    """Pad repeats in plan order (step, rank, accum)."""
    return [sid for step in steps for rank in step for mb in rank for sid, rep in zip(mb.sample_ids, mb.repeat) if rep]


def plan_run(
    records: Sequence[SampleRecord], cfg: PlanConfig, epochs: int | None = None, max_steps: int | None = None
) -> list[EpochPlan]:
    """Every epoch of the run, numbered by global step. --max-steps cuts the last epoch short (its samples
    past the cut land in `unreached`); with neither epochs nor max_steps the run is one epoch."""
    if epochs is not None and epochs < 1:
        raise PlanError(f"--epochs must be >= 1, got {epochs}")
    if max_steps is not None and max_steps < 1:
        raise PlanError(f"--max-steps must be >= 1, got {max_steps}")
    if epochs is None and max_steps is None:
        epochs = 1
    plans: list[EpochPlan] = []
    total = 0
    epoch = 0
    while (epochs is None or epoch < epochs) and (max_steps is None or total < max_steps):
        plan = plan_epoch(records, cfg, epoch)
        plan.first_global_step = total
        if max_steps is not None and total + plan.num_steps > max_steps:
            keep = max_steps - total
            cut = plan.steps[keep:]
            plan.steps = plan.steps[:keep]
            plan.unreached = [sid for step in cut for rank in step for mb in rank
                              for sid, rep in zip(mb.sample_ids, mb.repeat) if not rep]
            plan.repeated = _repeats(plan.steps)
        plans.append(plan)
        total += plan.num_steps
        epoch += 1
    return plans


def total_steps(plans: Sequence[EpochPlan]) -> int:
    return sum(p.num_steps for p in plans)


def locate(plans: Sequence[EpochPlan], global_step: int) -> tuple[int, int]:
    """(epoch, step within that epoch) of a 0-based global step; resume starts from here."""
    for p in plans:
        if p.first_global_step <= global_step < p.first_global_step + p.num_steps:
            return p.epoch, global_step - p.first_global_step
    raise PlanError(f"global step {global_step} is outside the plan ({total_steps(plans)} steps)")


def global_steps(plans: Sequence[EpochPlan], rank: int, start: int = 0) -> Iterable[tuple[int, int, int, list[MicroBatch]]]:
    """(global_step, epoch, step, [accum] micro-batches of `rank`) from global step `start` to the end."""
    for p in plans:
        for i, step in enumerate(p.steps):
            g = p.first_global_step + i
            if g >= start:
                yield g, p.epoch, i, step[rank]


def main(argv: list[str] | None = None) -> int:
    """`python -m train.plan`: the memory plan of a run (peak per phase, the configuration that fits);
    the logic lives in train/memplan.py."""
    from train.memplan import cli

    return cli(argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
