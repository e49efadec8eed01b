"""ZeRO-3 partitioned parameters: gathered (the one helper checkpoint saving, load verification and the
chunked loss share), and the check that partitioning really happened (ShardingReport)."""
from __future__ import annotations

import contextlib
import dataclasses


def gathered(params):
    """Context manager that gathers the full values of ZeRO-3 partitioned parameters on every rank (a
    collective: every rank must enter it with the same parameters, in the same order); a no-op for plain
    parameters. Read-only: no rank's changes are written back."""
    zero = [p for p in params if hasattr(p, "ds_id")]
    if not zero:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(zero, modifier_rank=None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingReport:
    """Parameter bytes this rank holds right after engine init, against the 1/world ZeRO-3 should leave."""

    rank: int
    world: int
    total_bytes: int  # every parameter at its logical size
    resident_bytes: int  # this rank's partitions (ds_tensor) + any parameter ZeRO never partitioned
    persistent_bytes: int  # gathered whole at run time by stage3_param_persistence_threshold (reported, not held yet)
    unpartitioned_bytes: int  # parameters DeepSpeed never partitioned (should be 0)
    tolerance: float = 0.10

    @property
    def expected_bytes(self) -> float:
        return self.total_bytes / self.world

    @property
    def ok(self) -> bool:
        return abs(self.resident_bytes - self.expected_bytes) <= self.tolerance * self.expected_bytes

    def message(self) -> str:
        mib = 2**20
        return (f"ZeRO-3 sharding, rank {self.rank} of {self.world}: holds {self.resident_bytes / mib:.2f} MiB of "
                f"{self.total_bytes / mib:.2f} MiB of parameters, expected 1/{self.world} = "
                f"{self.expected_bytes / mib:.2f} MiB; not partitioned {self.unpartitioned_bytes / mib:.2f} MiB; "
                f"{self.persistent_bytes / mib:.2f} MiB will be kept whole once gathered "
                f"(stage3_param_persistence_threshold): {'ok' if self.ok else 'NOT SHARDED as configured'} "
                f"(tolerance {self.tolerance:.0%})")


def sharding_report(model, *, rank: int, world: int) -> ShardingReport:
    """Count what each parameter occupies on this rank: a ZeRO-3 parameter its partition (`ds_tensor`), any
    other parameter its whole size."""
    total = resident = persistent = unpartitioned = 0
    for p in model.parameters():
        size = p.element_size()
        if hasattr(p, "ds_id"):
            total += p.ds_numel * size
            resident += p.ds_tensor.numel() * size
            if getattr(p, "ds_persist", False):
                persistent += p.ds_numel * size
        else:
            total += p.numel() * size
            resident += p.numel() * size
            unpartitioned += p.numel() * size
    return ShardingReport(rank=rank, world=world, total_bytes=total, resident_bytes=resident,
                          persistent_bytes=persistent, unpartitioned_bytes=unpartitioned)
