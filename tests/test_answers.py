"""Answers: rebasing gold segments into windows, and the one answer format (format_answer / parse_answer)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prep.annotations import Annotation, check_segments
from prep.answers import rebase_segments
from schemas.answer import format_answer, parse_answer
from prep.windows import make_windows
from schemas.manifest import Segment


def segs(*pairs):
    return [Segment(start_s=a, end_s=b) for a, b in pairs]


def test_format_examples():
    assert format_answer(segs((1.0, 12.5), (20.0, 31.2))) == "[[1.0, 12.5], [20.0, 31.2]]"
    assert format_answer([]) == "[]"
    assert format_answer(segs((0.04, 3.96))) == "[[0.0, 4.0]]"


@pytest.mark.parametrize("text", ["[[1.0, 12.5], [20.0, 31.2]]", "[]", "[[0.0, 16.0]]"])
def test_parse_inverts_format(text):
    assert format_answer(parse_answer(text)) == text


@pytest.mark.parametrize("text", [
    "[[1.0,12.5]]",  # no space
    "[[1, 12.5]]",  # no decimal
    "[[1.00, 12.5]]",  # two decimals
    "[[12.5, 1.0]]",  # end before start
    "[[3.0, 3.0]]",  # empty
    "[[5.0, 6.0], [1.0, 2.0]]",  # unsorted
    "[[1.0, 2.0]] trailing",
    " []",
    "[[-1.0, 2.0]]",
    "",
])
def test_parse_is_strict(text):
    with pytest.raises(ValueError):
        parse_answer(text)


def test_rebase_clips_shifts_and_drops_short_pieces():
    gold = segs((2.0, 10.0), (15.7, 17.0), (20.0, 21.0), (30.0, 40.0))
    # window [16, 32): (2,10) outside; (15.7,17) -> [0, 1.0]; (20,21) -> [4, 5]; (30,40) -> [14, 16]
    assert rebase_segments(gold, 16.0, 32.0) == segs((0.0, 1.0), (4.0, 5.0), (14.0, 16.0))
    # a 0.4 s piece after clipping is dropped, a 0.5 s one kept
    assert rebase_segments(segs((15.6, 17.0)), 0.0, 16.0) == []
    assert rebase_segments(segs((15.5, 17.0)), 0.0, 16.0) == segs((15.5, 16.0))
    assert rebase_segments(segs((15.6, 17.0)), 0.0, 16.0, min_segment_s=0.3) == segs((15.6, 16.0))


gold_strategy = st.lists(
    st.tuples(st.floats(0, 200, allow_nan=False), st.floats(0.05, 40, allow_nan=False)), max_size=6
).map(lambda xs: [Segment(start_s=s, end_s=s + d) for s, d in xs])


@settings(max_examples=300, deadline=None)
@given(
    gold=gold_strategy,
    duration=st.floats(2.5, 240, allow_nan=False),
    window=st.sampled_from([4.0, 8.0, 16.0, 30.0]),
    stride_ratio=st.sampled_from([0.5, 1.0, 1.5]),
    last=st.sampled_from(["keep", "drop", "extend"]),
    min_seg=st.sampled_from([0.0, 0.5, 1.0]),
)
def test_every_window_answer_is_gold_clipped_minus_start(gold, duration, window, stride_ratio, last, min_seg):
    ann = Annotation(video_id="v", source_path="v.mp4", segments=tuple(gold), query=None, row=1)
    checked = check_segments(ann, max(duration, max((g.end_s for g in gold), default=0)))
    assert not hasattr(checked, "reason")
    gold_n = checked.segments  # sorted, overlaps merged
    for w in make_windows(duration, window, window * stride_ratio, last):
        got = rebase_segments(gold_n, w.start_s, w.end_s, min_seg)
        length = w.end_s - w.start_s
        expected = []
        for g in gold_n:
            s, e = max(g.start_s, w.start_s) - w.start_s, min(g.end_s, w.end_s) - w.start_s
            if e - s >= min_seg and e > s and round(e, 1) > round(s, 1):
                expected.append((s, e))
        assert len(got) == len(expected)
        for seg, (s, e) in zip(got, expected):
            assert abs(seg.start_s - s) <= 0.05 + 1e-9 and abs(seg.end_s - e) <= 0.05 + 1e-9
            assert 0.0 <= seg.start_s < seg.end_s <= round(length, 1)
        assert parse_answer(format_answer(got)) == got
