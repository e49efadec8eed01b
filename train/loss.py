"""The training loss: mean cross-entropy over the supervised positions (the answer and its <|im_end|>)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from train.data import IGNORE_INDEX


def causal_lm_loss(model, batch: dict[str, torch.Tensor], *, full_logits: bool = False) -> torch.Tensor:
    """Mean cross-entropy over supervised tokens (labels != -100), the same value as the model's own loss.

    Position p predicts token p+1, so only columns whose next label is supervised need logits; the model
    computes them there alone (`logits_to_keep` as an index tensor). That skips the full-sequence fp32
    logits, the first allocation to run out of memory on long videos. Seam for later: the frozen vision
    tower can run under no_grad before this call and be passed in through `mm_encoder_outputs`.
    """
    batch = dict(batch)
    labels = batch.pop("labels")
    if full_logits:
        return model(**batch, labels=labels).loss
    next_labels = labels[:, 1:]
    keep = (next_labels != IGNORE_INDEX).any(dim=0).nonzero().squeeze(1)
    out = model(**batch, logits_to_keep=keep)
    logits = out.logits.float()
    target = next_labels[:, keep]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX)
