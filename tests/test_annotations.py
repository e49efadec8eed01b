"""Annotation loading (jsonl, parquet, HF dataset, QVHighlights), matching files, segment checks, windows."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prep.annotations import check_segments, load_annotations
from prep.windows import make_windows
from schemas.annotations import Annotation
from schemas.manifest import RejectRecord, Segment


def touch_videos(root, *names):
    for n in names:
        p = root / n
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


ROWS = [
    {"video": "a.mp4", "segments": [[1, 2]], "id": "A", "query": "find the dog"},
    {"video": "sub/b.mkv", "segments": []},
]


def test_jsonl_parquet_and_hf_dataset_agree(tmp_path):
    touch_videos(tmp_path, "a.mp4", "sub/b.mkv")
    jsonl = write_jsonl(tmp_path / "ann.jsonl", ROWS)
    parquet = tmp_path / "ann.parquet"
    rows = [{"video": r["video"], "segments": r["segments"], "id": r.get("id"), "query": r.get("query")} for r in ROWS]
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    import datasets

    hf = tmp_path / "ann_hf"
    datasets.Dataset.from_list(rows).save_to_disk(str(hf))
    results = [load_annotations(p, tmp_path) for p in (jsonl, parquet, hf)]
    for anns, rejects in results:
        assert rejects == []
        assert [(a.video_id, a.source_path, a.segments, a.query) for a in anns] == [
            ("A", "a.mp4", (Segment(start_s=1.0, end_s=2.0),), "find the dog"),
            ("sub/b", "sub/b.mkv", (), None),
        ]


def test_qvhighlights_layout(tmp_path):
    touch_videos(tmp_path, "vidX_60.0_210.0.mp4", "vidY_0.0_150.0.webm")
    path = write_jsonl(tmp_path / "qvh.jsonl", [
        {"qid": 7, "query": "a man cooks", "duration": 150, "vid": "vidX_60.0_210.0", "relevant_windows": [[0, 4], [10, 20]]},
        {"qid": 8, "query": "a cat", "duration": 150, "vid": "vidY_0.0_150.0", "relevant_windows": [[2, 6]]},
        {"qid": 9, "query": "gone", "duration": 150, "vid": "nope", "relevant_windows": [[2, 6]]},
    ])
    anns, rejects = load_annotations(path, tmp_path, fmt="qvhighlights")
    assert [(a.video_id, a.source_path, len(a.segments), a.query) for a in anns] == [
        ("7", "vidX_60.0_210.0.mp4", 2, "a man cooks"), ("8", "vidY_0.0_150.0.webm", 1, "a cat")]
    assert [(r.video_id, r.reason) for r in rejects] == [("9", "missing_video")]


def test_matching_rejects_each_problem_once(tmp_path):
    touch_videos(tmp_path, "a.mp4", "b.mp4", "orphan.mov", "notes.txt")
    path = write_jsonl(tmp_path / "ann.jsonl", [
        {"video": "a.mp4", "segments": [[1, 2]], "id": "A"},
        {"video": "b.mp4", "segments": [[1, 2]], "id": "A"},  # duplicate id: first row wins
        {"video": "missing.mp4", "segments": []},
        "not json",
        {"segments": [[1, 2]]},  # no video field
        {"video": "b.mp4", "segments": [[1]], "id": "B"},  # unreadable segment
    ])
    anns, rejects = load_annotations(path, tmp_path)
    assert [a.video_id for a in anns] == ["A"]
    got = sorted((r.reason, r.source_path) for r in rejects)
    assert got == sorted([
        ("duplicate_id", "b.mp4"), ("missing_video", "missing.mp4"), ("bad_annotation", ""), ("bad_annotation", ""),
        ("bad_annotation", "b.mp4"), ("video_without_annotation", "orphan.mov"),
    ])
    assert all(r.stage == "annotations" and r.detail for r in rejects)
    dup = next(r for r in rejects if r.reason == "duplicate_id")
    assert "row 1" in dup.detail and "row 2" in dup.detail


def ann(*pairs):
    return Annotation(video_id="v", source_path="v.mp4", segments=tuple(Segment(start_s=a, end_s=b) for a, b in pairs),
                      query=None, row=3)


@pytest.mark.parametrize("pairs, reason", [
    ([(5.0, 5.0)], "segment_end_before_start"),
    ([(6.0, 5.0)], "segment_end_before_start"),
    ([(-1.0, 5.0)], "segment_negative"),
    ([(1.0, 10.6)], "segment_past_duration"),
])
def test_bad_segments_reject_the_video(pairs, reason):
    r = check_segments(ann(*pairs), duration_s=10.0)
    assert isinstance(r, RejectRecord) and r.reason == reason and "row 3" in r.detail


def test_segments_clipped_within_tolerance_sorted_and_merged():
    got = check_segments(ann((8.0, 10.4), (1.0, 3.0), (2.0, 4.0), (10.2, 10.45)), duration_s=10.0)
    assert got.segments == (Segment(start_s=1.0, end_s=4.0), Segment(start_s=8.0, end_s=10.0))


def spans(ws):
    return [(w.start_s, w.end_s) for w in ws]


def test_window_policies():
    assert spans(make_windows(40, 16)) == [(0, 16), (16, 32), (32, 40)]
    assert spans(make_windows(33.5, 16)) == [(0, 16), (16, 32)]  # 1.5 s tail < 2 s
    assert spans(make_windows(40, 16, last="drop")) == [(0, 16), (16, 32)]
    assert spans(make_windows(40, 16, last="extend")) == [(0, 16), (16, 32), (24, 40)]
    assert spans(make_windows(32, 16, last="extend")) == [(0, 16), (16, 32)]
    assert spans(make_windows(10, 16)) == [(0, 10)]
    assert spans(make_windows(10, 16, last="drop")) == []
    assert spans(make_windows(10, 16, last="extend")) == [(0, 10)]
    assert spans(make_windows(1.5, 16)) == []
    assert spans(make_windows(40, 16, 8)) == [(0, 16), (8, 24), (16, 32), (24, 40)]
    assert spans(make_windows(36, 16, 8)) == [(0, 16), (8, 24), (16, 32), (24, 36)]
    assert [w.index for w in make_windows(40, 16)] == [0, 1, 2]


def test_paths_resolving_outside_videos_are_rejected_unless_allowed(tmp_path):
    videos, elsewhere = tmp_path / "videos", tmp_path / "elsewhere"
    touch_videos(videos, "in.mp4")
    touch_videos(elsewhere, "x.mp4")
    (videos / "link.mp4").symlink_to(elsewhere / "x.mp4")  # a file inside whose target is outside
    (videos / "inner.mp4").symlink_to(videos / "in.mp4")  # a link that stays inside is fine
    (tmp_path / "videos_link").symlink_to(videos)  # --videos itself may be a link
    path = write_jsonl(tmp_path / "ann.jsonl", [
        {"id": "in", "video": "in.mp4"}, {"id": "dotdot", "video": "../elsewhere/x.mp4"},
        {"id": "abs", "video": str(elsewhere / "x.mp4")}, {"id": "link", "video": "link.mp4"},
        {"id": "inner", "video": "inner.mp4"}])
    for root in (videos, tmp_path / "videos_link"):
        anns, rejects = load_annotations(path, root)
        assert [a.video_id for a in anns] == ["in", "inner"]
        assert [(r.video_id, r.reason) for r in rejects] == [
            ("dotdot", "path_outside_videos"), ("abs", "path_outside_videos"), ("link", "path_outside_videos")]
        assert f"row 4: link.mp4 resolves to {elsewhere / 'x.mp4'}, outside --videos {videos}" in rejects[2].detail
    anns, rejects = load_annotations(path, videos, allow_outside=True)
    assert [a.video_id for a in anns] == ["in", "dotdot", "abs", "link", "inner"] and rejects == []


def test_unreadable_lines_are_rejects_with_their_line_number_and_the_rest_is_read(tmp_path):
    from schemas.annotations import MAX_DEPTH, MAX_LINE_BYTES

    touch_videos(tmp_path, "a.mp4", "b.mp4", "c.mp4")
    nested = {"video": "c.mp4", "segments": [[1, 2]], "extra": json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH)}
    lines = [
        b"\xef\xbb\xbf" + json.dumps({"id": "A", "video": "a.mp4"}).encode(),  # a byte order mark is fine
        b"",
        b'{"id": "B", "video": "b.mp4", "query": "caf\xe9"}',  # latin-1, not UTF-8
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the interpreter's recursion limit
        json.dumps(nested).encode(),  # parses, but deeper than MAX_DEPTH
        b'{"id": "huge", "video": "a.mp4", "query": "' + b"x" * (MAX_LINE_BYTES + 10) + b'"}',
        json.dumps({"id": "C", "video": "c.mp4"}).encode(),
    ]
    path = tmp_path / "ann.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    anns, rejects = load_annotations(path, tmp_path)
    assert [a.video_id for a in anns] == ["A", "C"]
    got = [(r.reason, r.detail) for r in rejects if r.reason != "video_without_annotation"]
    assert [(reason, detail.split(" ")[:4]) for reason, detail in got] == [
        ("not_utf8", ["row", "2:", "line", "3"]), ("too_deeply_nested", ["row", "3:", "line", "4"]),
        ("too_deeply_nested", ["row", "4:", "line", "5"]), ("line_too_long", ["row", "5:", "line", "6"])]
    assert "byte 0xe9 at column 44" in got[0][1]
    assert f"has {len(lines[5]) + 1} bytes" in got[3][1]
