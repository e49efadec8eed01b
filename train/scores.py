"""Per-segment confidence from the generated tokens: the mean probability of the segment's number tokens.

Why the numbers: the brackets and commas of an answer are near-certain once the model has learned the
format, so they say nothing about where a segment lies; the probabilities the model gave the digits of
its start and end times do. A segment is matched to the first unused pair of consecutive numbers in the
text whose values, ordered and clamped to the window as train.answer_parse normalizes them, equal the
segment; its score is the mean probability of every token overlapping those two numbers. A segment no
pair explains (a lenient parse this rule does not follow) gets the mean over all answer tokens.
These scores rank segments for QVHighlights mAP and `train.evaluate --top1 scored`.
"""
from __future__ import annotations

import re
from typing import Sequence

from schemas.manifest import Segment
from train.answer_parse import to_seconds

_NUMBER_RE = re.compile(r"-?\d+(?::\d{1,2}){0,2}(?:\.\d+)?")  # the numbers answer_parse reads (mm:ss included)
_MATCH_TOL_S = 1e-3  # parsed values are rounded to 3 decimals


def token_ends(tokenizer, ids: Sequence[int]) -> list[int]:
    """Character offset where each token's text ends in tokenizer.decode(ids) (prefix decoding, so
    multi-token characters and merges are counted as the full decode renders them)."""
    return [len(tokenizer.decode(list(ids[: i + 1]), skip_special_tokens=False)) for i in range(len(ids))]


def _tokens_over(start: int, end: int, ends: Sequence[int]) -> set[int]:
    """Indices of the tokens whose text overlaps characters [start, end)."""
    return {i for i in range(len(ends)) if ends[i] > start and (ends[i - 1] if i else 0) < end}


def segment_scores(text: str, ends: Sequence[int], probs: Sequence[float], segments: Sequence[Segment],
                   window_s: float) -> list[float]:
    """One score in [0, 1] per segment, in the segments' order (see the module doc for the rule)."""
    if len(ends) != len(probs):
        raise ValueError(f"{len(ends)} token offsets for {len(probs)} token probabilities")
    if not segments:
        return []
    overall = sum(probs) / len(probs) if probs else 0.0
    numbers = [(m.start(), m.end(), to_seconds(m.group())) for m in _NUMBER_RE.finditer(text)]

    def normalized(a: float, b: float) -> tuple[float, float]:
        lo, hi = sorted((a, b))
        return round(min(max(lo, 0.0), window_s), 3), round(min(max(hi, 0.0), window_s), 3)

    out, cursor = [], 0
    for seg in segments:
        score = None
        for j in range(cursor, len(numbers) - 1):
            lo, hi = normalized(numbers[j][2], numbers[j + 1][2])
            if abs(lo - seg.start_s) <= _MATCH_TOL_S and abs(hi - seg.end_s) <= _MATCH_TOL_S:
                picked = _tokens_over(*numbers[j][:2], ends) | _tokens_over(*numbers[j + 1][:2], ends)
                score = sum(probs[i] for i in picked) / len(picked) if picked else None
                cursor = j + 2
                break
        out.append(round(score if score is not None else overall, 6))
    return out
