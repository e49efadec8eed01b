"""The lenient answer parser: strict answers, each repair, and the original Video-ORA failure outputs."""
import pytest

from schemas.answer import format_answer
from schemas.manifest import Segment
from train.answer_parse import degenerate_flags, parse_output, to_seconds

W = 30.0  # window length used throughout


def segs(*pairs):
    return [Segment(start_s=a, end_s=b) for a, b in pairs]


def test_strict_answer_is_valid_and_exact():
    text = format_answer(segs((1.0, 12.5), (20.0, 29.9)))
    r = parse_output(text + "<|im_end|>", W)
    assert r.status == "valid"
    assert r.segments == segs((1.0, 12.5), (20.0, 29.9))
    assert r.degenerate == [] and r.repairs == []


def test_strict_empty_answer_is_valid_negative():
    r = parse_output("[]", W)
    assert (r.status, r.segments, r.degenerate) == ("valid", [], [])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1.0 - 12.5", [(1.0, 12.5)]),
        ("1-12.5", [(1.0, 12.5)]),
        ("1.0 to 12.5", [(1.0, 12.5)]),
        ("The event happens from 3 to 7 seconds.", [(3.0, 7.0)]),
        ("between 2.5s and 4s", [(2.5, 4.0)]),
        ("00:05 - 00:12", [(5.0, 12.0)]),
        ("from 0:01.5 to 0:20", [(1.5, 20.0)]),
        ("0:00:03 to 0:00:09", [(3.0, 9.0)]),
        ("[[1.0, 2.0], [3.0, 4.0]", [(1.0, 2.0), (3.0, 4.0)]),  # missing closing bracket
        ("[1.0, 2.0], [3.0, 4.0]", [(1.0, 2.0), (3.0, 4.0)]),  # missing outer brackets
        ("1.0, 2.0", [(1.0, 2.0)]),  # no brackets at all
        ("[[1, 2], [3, 4]]", [(1.0, 2.0), (3.0, 4.0)]),  # integers instead of one decimal
        ("[[3.0, 4.0], [1.0, 2.0]]", [(3.0, 4.0), (1.0, 2.0)]),  # unsorted: order kept (it is the ranking)
        ("Keep [1.5, 3.0] and (10, 12.25).", [(1.5, 3.0), (10.0, 12.25)]),
        ("1.0 - 2.0, 5.0 - 6.0", [(1.0, 2.0), (5.0, 6.0)]),
        ("[[1.0s, 2.0s]]", [(1.0, 2.0)]),
        ("[ ]", []),
    ],
)
def test_lenient_repairs(text, expected):
    r = parse_output(text, W)
    assert r.status == "repaired", r
    assert "lenient_syntax" in r.repairs
    assert r.segments == segs(*expected)
    assert r.degenerate == []


def test_reversed_pairs_are_swapped():
    r = parse_output("[[5.0, 2.0]]", W)
    assert r.status == "repaired"
    assert r.segments == segs((2.0, 5.0))
    assert "swapped" in r.repairs
    assert r.degenerate == []


def test_numbers_outside_the_window_are_clamped_and_flagged():
    r = parse_output("[[25.0, 40.0]]", W)  # strict format, but past the 30 s window
    assert r.status == "repaired"
    assert r.segments == segs((25.0, 30.0))
    assert "clamped" in r.repairs
    assert r.degenerate == ["out_of_window"]


def test_negative_start_is_clamped():
    r = parse_output("[[-2.0, 3.0]]", W)
    assert r.segments == segs((0.0, 3.0))
    assert r.status == "repaired" and "out_of_window" in r.degenerate


def test_rounding_overshoot_is_clamped_without_flag():
    r = parse_output("[[20.0, 30.0]]", 29.97)  # one-decimal rounding of the window end
    assert r.segments == segs((20.0, 29.97))
    assert r.degenerate == []


def test_segment_entirely_outside_the_window_fails():
    r = parse_output("[[40.0, 50.0]]", W)
    assert r.status == "failed"
    assert r.segments == []
    assert "out_of_window" in r.degenerate


def test_zero_length_pair_is_dropped():
    r = parse_output("[[1.0, 1.0], [2.0, 3.0]]", W)
    assert r.segments == segs((2.0, 3.0))
    assert "dropped_empty" in r.repairs and r.status == "repaired"


def test_original_failure_argmax_tag():
    r = parse_output("<argmax>11</argmax>", W)
    assert r.status == "failed"
    assert r.segments == []
    assert "unknown_tag" in r.degenerate


def test_original_failure_repeated_one():
    r = parse_output("<1.0>" * 60, W, finished=False)
    assert r.status == "failed"
    assert r.segments == []
    assert {"repetition", "unknown_tag", "truncated"} <= set(r.degenerate)


def test_empty_output():
    r = parse_output("  <|im_end|>", W)
    assert (r.status, r.degenerate) == ("failed", ["empty"])


def test_prose_without_numbers_fails():
    r = parse_output("I cannot see anything interesting.", W)
    assert r.status == "failed" and r.degenerate == []


def test_odd_number_count_fails():
    assert parse_output("[1.0, 2.0, 3.0]", W).status == "failed"


def test_valid_answer_with_trailing_tag_is_repaired_and_degenerate():
    r = parse_output("[[1.0, 2.0]]</answer>", W)
    assert r.status == "repaired" and r.segments == segs((1.0, 2.0))
    assert r.degenerate == ["unknown_tag"]


def test_repetition_of_identical_segments():
    r = parse_output("[" + ", ".join(["[1.0, 2.0]"] * 8) + "]", W)
    assert "repetition" in r.degenerate


def test_clean_multi_segment_answer_is_not_flagged():
    text = "[[0.0, 1.1], [10.0, 11.1], [20.0, 21.1], [22.2, 23.3]]"
    assert degenerate_flags(text) == []


def test_to_seconds():
    assert to_seconds("12.5") == 12.5
    assert to_seconds("01:05") == 65.0
    assert to_seconds("1:02:03.5") == 3723.5
    assert to_seconds("-2") == -2.0


def test_window_length_must_be_positive():
    with pytest.raises(ValueError):
        parse_output("[]", 0.0)
