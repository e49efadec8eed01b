"""Device values on their way to the host log without the host waiting for them.

Why: reading a loss or a gradient norm with `.item()` at the end of a step makes the host wait for the GPU to
finish the step, then the GPU waits for the host to log, fetch and copy the next batch and launch its first
kernels: one of the step-boundary gaps measured on one H200 (BENCHMARKS.md, session 15). Here the step's values
are copied into pinned host memory behind the step's own work (no wait), and read after the next step's work is
queued, when the copy has long finished.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class HostValues:
    """Scalars copied to the host; `read` waits only for their copy (done by then: the next step is queued)."""

    host: torch.Tensor
    copied: torch.cuda.Event | None

    def read(self) -> list[float]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


def values_to_host(values: list) -> HostValues:
    """Scalars (0-d tensors on one device, floats, or None, which reads back as nan), copied without a sync."""
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    flat = torch.stack([v.detach().reshape(()).float() if isinstance(v, torch.Tensor)
                        else torch.tensor(float("nan") if v is None else float(v), device=device) for v in values])
    if flat.device.type != "cuda":
        return HostValues(flat, None)
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return HostValues(host, copied)


@dataclasses.dataclass
class PendingStep:
    """A finished step's log record without the values still on their way (`values`: its micro-batches' losses,
    then its gradient norm)."""

    fields: dict
    values: HostValues
