"""Turn a generated answer into window-local segments, and say how trustworthy that answer was.

Order of attempts: the strict training format (`schemas.answer.parse_answer`: JSON `[[start, end], ...]`,
one decimal, `[]` for nothing to keep), then a lenient reading of what models typically write instead:
`a - b`, `a to b`, `from a to b seconds`, `between a and b`, `[a, b]` inside prose, mm:ss / hh:mm:ss,
JSON-ish lists with missing or extra brackets. Pairs are then normalized: reversed pairs swapped, values
clamped to [0, window length], zero-length pairs dropped.

Each output gets a status -- `valid` (strict format, nothing changed), `repaired` (usable only after the
lenient reading or a normalization), `failed` (no usable segment) -- and degenerate flags that name the
failure modes the original Video-ORA adapter showed (`<argmax>11</argmax>`, `<1.0><1.0>...`): see
schemas.predictions.DEGENERATE_FLAGS. A degenerate output may still be repaired (e.g. a valid answer
followed by a stray tag); the flags and the status are independent.
"""
from __future__ import annotations

import dataclasses
import re

from schemas.answer import parse_answer
from schemas.manifest import Segment

END_TOKENS = ("<|im_end|>", "<|endoftext|>")
OUT_OF_WINDOW_TOL_S = 0.05  # answers carry one decimal: a window end of 29.97 s may be written 30.0
REPEAT_MIN_COPIES = 4  # a unit of 2..40 characters seen this many times back to back is a loop

_NUM = r"\d+(?::\d{1,2}){0,2}(?:\.\d+)?"  # 12 | 12.5 | 01:05 | 1:02:03.5
_UNIT = r"(?:\s*(?:seconds?|secs?|s)\b)?"
_T = rf"({_NUM}){_UNIT}"
_ST = rf"(-?{_NUM}){_UNIT}"  # signed: only inside brackets, where '-' cannot be a range dash
_RANGE_SEP = r"\s*(?:-|–|—|~|to|until|till|and)\s*"
_PAIR_RE = re.compile(
    rf"[\[(]\s*{_ST}\s*[,;]\s*{_ST}\s*[\])]"  # [a, b] or (a, b)
    rf"|(?:\b(?:from|between)\s+)?{_T}{_RANGE_SEP}{_T}",  # a - b, from a to b, between a and b
    re.IGNORECASE,
)
_DASH_RANGE_RE = re.compile(rf"{_NUM}{_UNIT}\s*[-–—~]\s*{_NUM}")
_JSONISH_RE = re.compile(r"[\s\[\]\(\),;0-9.:\-]*")
_UNIT_WORD_RE = re.compile(r"(?<=[\d\s])(?:seconds?|secs?|s)\b", re.IGNORECASE)
_SIGNED_NUM_RE = re.compile(rf"-?{_NUM}")
_TAG_RE = re.compile(r"<[^<>\s][^<>\n]{0,40}>")
_REPEAT_RE = re.compile(rf"(.{{2,40}}?)\1{{{REPEAT_MIN_COPIES - 1},}}", re.DOTALL)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParsedAnswer:
    """The segments recovered from one output and how they were obtained."""

    status: str  # valid | repaired | failed
    segments: list[Segment]  # window-local, in the order the model wrote them
    degenerate: list[str]  # subset of schemas.predictions.DEGENERATE_FLAGS
    repairs: list[str]  # lenient_syntax, swapped, clamped, dropped_empty
    reason: str = ""  # for failed: why nothing was usable


def to_seconds(token: str) -> float:
    """'12.5' -> 12.5, '01:05' -> 65.0, '1:02:03.5' -> 3723.5; a leading '-' is kept."""
    sign = -1.0 if token.startswith("-") else 1.0
    value = 0.0
    for part in token.lstrip("-").split(":"):
        value = value * 60 + float(part)
    return sign * value


def strip_end_tokens(text: str) -> str:
    """Drop trailing end-of-turn tokens and whitespace (predict stops at the first one)."""
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for tok in END_TOKENS:
            if text.endswith(tok):
                text, changed = text[: -len(tok)].rstrip(), True
    return text


def degenerate_flags(text: str, *, finished: bool = True) -> list[str]:
    """Flags that depend on the text alone (out_of_window needs the parse and is added by parse_output)."""
    flags = []
    if not text:
        flags.append("empty")
    if any(m.group(1).strip() for m in _REPEAT_RE.finditer(text)):
        flags.append("repetition")
    if _TAG_RE.search(text):
        flags.append("unknown_tag")
    if not finished:
        flags.append("truncated")
    return flags


def _strict(text: str) -> list[Segment] | None:
    try:
        return list(parse_answer(text))
    except ValueError:
        return None


def lenient_pairs(text: str) -> list[tuple[float, float]] | None:
    """Number pairs read leniently, in order; None when the text holds no readable pair structure.

    A text of only numbers, brackets and commas (JSON with broken brackets) is read as consecutive pairs
    (an odd count is unreadable); anything else is searched for bracketed pairs and ranges.
    """
    plain = _UNIT_WORD_RE.sub("", text)
    if _JSONISH_RE.fullmatch(plain) and not _DASH_RANGE_RE.search(plain):
        nums = [to_seconds(t) for t in _SIGNED_NUM_RE.findall(plain)]
        if nums and len(nums) % 2 == 0:
            return [(nums[i], nums[i + 1]) for i in range(0, len(nums), 2)]
        if not nums and "[" in plain:
            return []  # "[ ]", "[[]]": nothing to keep, written loosely
        return None
    pairs = []
    for m in _PAIR_RE.finditer(text):
        a, b = [g for g in m.groups() if g is not None]
        pairs.append((to_seconds(a), to_seconds(b)))
    return pairs or None


def normalize(
    pairs: list[tuple[float, float]], window_s: float
) -> tuple[list[Segment], list[str], bool]:
    """Swap reversed pairs, clamp to [0, window_s], drop zero-length ones.

    Returns (segments, repairs, out_of_window) where out_of_window says a value lay beyond the rounding
    tolerance outside the window.
    """
    repairs: set[str] = set()
    out = False
    segments = []
    for a, b in pairs:
        if a > b:
            a, b = b, a
            repairs.add("swapped")
        if a < -OUT_OF_WINDOW_TOL_S or b > window_s + OUT_OF_WINDOW_TOL_S:
            out = True
        ca, cb = min(max(a, 0.0), window_s), min(max(b, 0.0), window_s)
        if (ca, cb) != (a, b):
            repairs.add("clamped")
        if cb - ca <= 1e-9:
            repairs.add("dropped_empty")
            continue
        segments.append(Segment(start_s=round(ca, 3), end_s=round(cb, 3)))
    return segments, sorted(repairs), out


def parse_output(text: str, window_s: float, *, finished: bool = True) -> ParsedAnswer:
    """Parse one generated answer for a window of length window_s (seconds).

    finished=False means generation stopped at the token limit, not at the end token (flag truncated).
    """
    if window_s <= 0:
        raise ValueError(f"window length must be > 0, got {window_s}")
    text = strip_end_tokens(text)
    flags = degenerate_flags(text, finished=finished)
    if not text:
        return ParsedAnswer(status="failed", segments=[], degenerate=flags, repairs=[], reason="empty output")

    strict = _strict(text)
    repairs: list[str] = []
    if strict is not None:
        pairs = [(s.start_s, s.end_s) for s in strict]
    else:
        pairs = lenient_pairs(text)
        repairs.append("lenient_syntax")
        if pairs is None:
            return ParsedAnswer(
                status="failed", segments=[], degenerate=flags, repairs=[], reason="no [start, end] pair found"
            )
    segments, fixes, out = normalize(pairs, window_s)
    repairs += fixes
    if out:
        flags.append("out_of_window")
    if pairs and not segments:
        return ParsedAnswer(
            status="failed",
            segments=[],
            degenerate=flags,
            repairs=repairs,
            reason="no segment of positive length inside the window",
        )
    status = "valid" if not repairs else "repaired"
    return ParsedAnswer(status=status, segments=segments, degenerate=flags, repairs=repairs)
