"""train.scores: per-segment scores from token probabilities, on hand-made token splits."""
import pytest

from schemas.manifest import Segment
from train.answer_parse import parse_output
from train.scores import segment_scores, token_ends


def S(a, b):
    return Segment(start_s=a, end_s=b)


def split(pieces, probs):
    """(text, token end offsets, probs) of an answer generated as these token strings."""
    ends, n = [], 0
    for p in pieces:
        n += len(p)
        ends.append(n)
    return "".join(pieces), ends, probs


def test_score_is_the_mean_probability_of_the_segment_number_tokens():
    text, ends, probs = split(["[[", "1", ".", "0", ",", " 3", ".5", "],", " [", "6", ".0", ",", " 8", ".0", "]]"],
                              [1.0, 0.8, 1.0, 0.6, 1.0, 0.4, 0.2, 1.0, 1.0, 0.9, 0.9, 1.0, 0.9, 0.9, 1.0])
    segs = parse_output(text, 8.0).segments
    assert segs == [S(1.0, 3.5), S(6.0, 8.0)]
    got = segment_scores(text, ends, probs, segs, 8.0)
    assert got == pytest.approx([(0.8 + 1.0 + 0.6 + 0.4 + 0.2) / 5, 0.9])  # brackets and commas never count


def test_repaired_answers_are_matched_by_value():
    # reversed pair (swapped by the parser) and a value past the window (clamped)
    text, ends, probs = split(["from ", "5", " to ", "2", " and ", "7", " - ", "9"], [1, 0.5, 1, 0.7, 1, 0.2, 1, 0.4])
    parsed = parse_output(text, 8.0)
    assert parsed.segments == [S(2.0, 5.0), S(7.0, 8.0)]
    assert segment_scores(text, ends, probs, parsed.segments, 8.0) == pytest.approx([0.6, 0.3])


def test_unmatched_segment_falls_back_to_the_answer_mean_and_empty_answer_has_no_scores():
    text, ends, probs = split(["[[", "1", ",", "2", "]]"], [0.5, 0.5, 0.5, 0.5, 1.0])
    assert segment_scores(text, ends, probs, [S(4.0, 6.0)], 8.0) == pytest.approx([0.6])
    assert segment_scores("[]", [2], [0.9], [], 8.0) == []
    with pytest.raises(ValueError):
        segment_scores(text, ends[:-1], probs, [S(1.0, 2.0)], 8.0)


def test_token_ends_follow_the_tokenizer():
    from schemas.prompt import load_tokenizer

    tok = load_tokenizer()
    text = "[[0.5, 12.0], [14.5, 16.0]]"
    ids = tok.encode(text, add_special_tokens=False)
    ends = token_ends(tok, ids)
    assert ends[-1] == len(text) and ends == sorted(ends)
    segs = parse_output(text, 16.0).segments
    assert len(segment_scores(text, ends, [0.5] * len(ids), segs, 16.0)) == 2
