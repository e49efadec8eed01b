"""ZeRO-3 partitioned parameters, gathered: the one helper checkpoint saving and load verification share."""
from __future__ import annotations

import contextlib


def gathered(params):
    """Context manager that gathers the full values of ZeRO-3 partitioned parameters on every rank (a
    collective: every rank must enter it with the same parameters, in the same order); a no-op for plain
    parameters. Read-only: no rank's changes are written back."""
    zero = [p for p in params if hasattr(p, "ds_id")]
    if not zero:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(zero, modifier_rank=None)
