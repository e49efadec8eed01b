"""Metrics on hand-computed examples, merge across windows, the report and its HTML."""
import json

import numpy as np
import pytest

from schemas.manifest import SampleRecord, Segment, write_records
from schemas.predictions import PredictionRow, read_predictions, write_predictions
from train import evaluate as ev
from train.segments import gold_keep_lists, keep_lists, merge, to_source
from tests.records import v2_fields


def S(a, b):
    return Segment(start_s=a, end_s=b)


def record(video_id, index, start, end, gold):
    """A manifest record whose only meaningful fields are the window and its gold answer."""
    segs = [S(a, b) for a, b in gold]
    return SampleRecord(
        sample_id=f"{video_id}/w{index:04d}", video_id=video_id, source_path=f"{video_id}.mp4",
        window_index=index, window_start_s=start, window_end_s=end, num_frames=2, frame_indices=[0, 1],
        frame_times_s=[start, start + 0.1], group_times_s=[0.05], height=32, width=32, grid_t=1, grid_h=2,
        grid_w=2, visual_tokens=1, text_tokens=10, supervised_tokens=5, input_tokens=11, query="q",
        answer=json.dumps(gold), segments=segs, shard="shard-000000.tar", key=f"k{index}", **v2_fields(2, fps=10.0),
    )


def pred(rec, pairs, status="valid", degenerate=(), scores=None, raw=None):
    segs = [S(a, b) for a, b in pairs] if status != "failed" else []
    return PredictionRow(
        sample_id=rec.sample_id, video_id=rec.video_id, source_path=rec.source_path, window_index=rec.window_index,
        window_start_s=rec.window_start_s, window_end_s=rec.window_end_s,
        raw_output=raw if raw is not None else json.dumps(pairs), status=status, degenerate=list(degenerate),
        repairs=[], segments=segs, segments_source=to_source(segs, rec.window_start_s), scores=scores,
        source_fps=10.0,
    )


# ------------------------------------------------------------------ primitives

def test_iou():
    assert ev.iou(S(0, 4), S(2, 6)) == pytest.approx(2 / 6)
    assert ev.iou(S(0, 1), S(2, 3)) == 0.0
    assert ev.iou(S(0, 1), S(1, 2)) == 0.0  # touching is not overlapping
    assert ev.iou(S(1, 3), S(1, 3)) == 1.0


def test_top1_uses_first_prediction_against_best_gold():
    gold = [S(0, 4), S(6, 8)]
    assert ev.top1_iou([S(5, 8), S(0, 4)], gold) == pytest.approx(2 / 3)  # first segment only
    assert ev.top1_iou([], gold) == 0.0


def test_greedy_matching_is_one_to_one():
    gold = [S(0, 10)]
    assert ev.match_greedy([S(0, 10), S(0, 9)], gold) == 1  # the second cannot reuse the gold segment
    assert ev.match_greedy([S(0, 4)], gold) == 0  # IoU 0.4 < 0.5
    # greedy by IoU: the 1.0 pair is taken first, leaving the 0.5 pair
    assert ev.match_greedy([S(0, 2), S(0, 4)], [S(0, 4), S(0, 1)]) == 2


def test_prf_empty_conventions():
    assert ev.prf(0, 0, 0)["f1"] == 1.0
    assert ev.prf(0, 0, 2)["recall"] == 0.0 and ev.prf(0, 0, 2)["precision"] == 0.0
    assert ev.prf(0, 3, 0)["precision"] == 0.0
    assert ev.prf(1, 2, 4)["f1"] == pytest.approx(2 * 0.5 * 0.25 / 0.75)


def test_set_iou():
    assert ev.set_iou([S(0, 2), S(4, 6)], [S(0, 6)]) == pytest.approx(4 / 6)
    assert ev.set_iou([], []) == 1.0
    assert ev.set_iou([S(0, 1)], []) == 0.0


def test_frame_mask_resolution():
    m = ev.frame_mask([S(1.0, 1.5)], 2.0, 0.1)
    assert m.shape == (20,) and m.sum() == 5 and m[10:15].all()


def test_average_precision_tiny_cases():
    gold = [S(0, 10)]
    assert np.allclose(ev.average_precision([(S(0, 10), 0.9), (S(20, 30), 0.8)], gold), 1.0)
    # the wrong one ranked first: precision 0.5 at full recall
    assert np.allclose(ev.average_precision([(S(20, 30), 0.9), (S(0, 10), 0.8)], gold), 0.5)
    # IoU 0.8: a hit at thresholds 0.5..0.8 (7 of 10), a miss above
    ap = ev.average_precision([(S(0, 8), 1.0)], gold)
    assert ap.tolist() == [1.0] * 7 + [0.0] * 3
    assert ev.average_precision([], gold).sum() == 0.0


def test_interpolated_precision_recall_matches_hand_value():
    # precision 1, 0.5, 0.67 at recall 0.5, 0.5, 1.0 -> 0.5 * 1 + 0.5 * 0.67
    assert ev.interpolated_precision_recall(np.array([1, 0.5, 2 / 3]), np.array([0.5, 0.5, 1.0])) == pytest.approx(
        0.5 + 0.5 * 2 / 3
    )


# ------------------------------------------------------------------ merge across windows

def test_to_source_and_merge_across_windows():
    # an event 8-13 s cut by the window border at 10 s comes back as two pieces
    pieces = to_source([S(8.0, 10.0)], 0.0) + to_source([S(0.0, 3.0)], 10.0)
    assert merge(pieces) == [S(8.0, 13.0)]
    assert merge([S(0, 1), S(1.05, 2)]) == [S(0, 2)]  # gap 0.05 <= 0.1
    assert merge([S(0, 1), S(1.1, 2)]) == [S(0, 2)]  # gap exactly 0.1 merges
    assert merge([S(0, 1), S(1.3, 2)]) == [S(0, 1), S(1.3, 2)]
    assert merge([S(0, 1), S(1.3, 2)], gap_s=0.5) == [S(0, 2)]
    assert merge([S(0, 5), S(1, 2)]) == [S(0, 5)]  # contained
    with pytest.raises(ValueError):
        merge([], gap_s=-1)


def test_keep_lists_from_rows_and_records():
    a0, a1 = record("a", 0, 0.0, 10.0, [[8.0, 10.0]]), record("a", 1, 10.0, 20.0, [[0.0, 3.0]])
    rows = [pred(a0, [[7.5, 10.0]]), pred(a1, [[0.0, 2.0]])]
    assert keep_lists(rows) == {"a": [S(7.5, 12.0)]}
    assert gold_keep_lists([a0, a1]) == {"a": [S(8.0, 13.0)]}
    # a failed window contributes nothing
    rows[1] = pred(a1, [], status="failed")
    assert keep_lists(rows) == {"a": [S(7.5, 10.0)]}


# ------------------------------------------------------------------ the whole report

@pytest.fixture
def example():
    """Two videos, five windows; every number in the tests below is computed by hand in the comments."""
    a0 = record("a", 0, 0.0, 10.0, [[2, 6]])
    a1 = record("a", 1, 10.0, 20.0, [[0, 4], [6, 8]])
    b0 = record("b", 0, 0.0, 10.0, [[1, 5]])
    b1 = record("b", 1, 10.0, 20.0, [])
    b2 = record("b", 2, 20.0, 30.0, [])
    rows = [
        pred(a0, [[3, 6]]),  # top-1 IoU 3/4
        pred(a1, [[5, 8], [0, 2]]),  # top-1 [5,8] vs [6,8]: 2/3; [0,2] vs [0,4]: 0.5 -> both match @0.5
        pred(b0, [], status="failed", degenerate=["unknown_tag"], raw="<argmax>11</argmax>"),  # counts 0
        pred(b1, []),  # negative, correct
        pred(b2, [[1, 2]]),  # negative, a false positive
    ]
    return rows, [a0, a1, b0, b1, b2]


def test_window_metrics_by_hand(example):
    rows, records = example
    rep = ev.evaluate(rows, records)
    w = rep["window"]
    assert (w["positives"], w["negatives"]) == (3, 2)
    assert w["miou"] == pytest.approx((0.75 + 2 / 3 + 0.0) / 3)
    assert w["r1"] == pytest.approx({"0.3": 2 / 3, "0.5": 2 / 3, "0.7": 1 / 3})
    prf = w["segment_prf@0.5"]
    assert (prf["tp"], prf["pred"], prf["gold"]) == (3, 4, 4)
    assert prf["f1"] == pytest.approx(0.75)
    assert w["negative_accuracy"] == 0.5
    assert w["map"] is None and "skipped" in w["map_note"]
    f = rep["format"]
    assert (f["valid_rate"], f["repaired_rate"], f["failed_rate"], f["degenerate_rate"]) == (0.8, 0.0, 0.2, 0.2)
    assert f["degenerate_counts"]["unknown_tag"] == 1


def test_video_frame_f1_by_hand(example):
    rows, records = example
    v = ev.evaluate(rows, records)["video"]
    # video a (20 s = 200 bins): gold 2-6, 10-14, 16-18 (100 bins); pred 3-6, 10-12, 15-18 (80 bins); overlap 70
    # video b (30 s = 300 bins): gold 1-5 (40 bins); pred 21-22 (10 bins); overlap 0
    tp, fp, fn, tn = 70, 20, 70, 340
    ff = v["frame_f1"]
    assert ff["bins"] == 500 and ff["resolution_s"] == 0.1
    p, r = tp / (tp + fp), tp / (tp + fn)
    assert ff["keep"]["f1"] == pytest.approx(2 * p * r / (p + r))
    cp, cr = tn / (tn + fn), tn / (tn + fp)
    assert ff["cut"]["f1"] == pytest.approx(2 * cp * cr / (cp + cr))


def test_per_video_entries(example):
    rows, records = example
    rep = ev.evaluate(rows, records)
    a = next(v for v in rep["per_video"] if v["video_id"] == "a")
    assert a["gold_keep"] == [[2, 6], [10, 14], [16, 18]]
    assert a["pred_keep"] == [[3, 6], [10, 12], [15, 18]]
    assert a["window_metrics"]["miou"] == pytest.approx((0.75 + 2 / 3) / 2)
    assert a["set_iou"] == pytest.approx(7 / 11)  # intersection 7 s, union 11 s


def test_map_with_order_scores_and_with_scores(example):
    rows, records = example
    rep = ev.evaluate(rows, records, order_scores=True)
    # a0: one hit at IoU 0.75 -> thresholds 0.5..0.75 (6 of 10)
    # a1: [5,8] (0.667 vs [6,8]) then [0,2] (0.5 vs [0,4]); gold 2 segments
    #     t=0.5: both hits -> AP 1; t in 0.55..0.65: first hit, second miss -> AP 0.5; above: 0
    # b0: failed -> 0
    a1_ap = [1.0, 0.5, 0.5, 0.5] + [0.0] * 6
    a0_ap = [1.0] * 6 + [0.0] * 4
    expected = np.mean([np.mean([x, y, 0.0]) for x, y in zip(a0_ap, a1_ap)])
    assert rep["window"]["map"]["average"] == pytest.approx(expected)
    assert rep["window"]["map"]["0.5"] == pytest.approx(2 / 3)
    # explicit scores reverse a1's ranking: [0,2] first (IoU 0.5 only at t=0.5), then [5,8]
    rows[1] = pred(records[1], [[5, 8], [0, 2]], scores=[0.1, 0.9])
    rows[0] = pred(records[0], [[3, 6]], scores=[1.0])
    rows[4] = pred(records[4], [[1, 2]], scores=[0.3])
    rep2 = ev.evaluate(rows, records)
    assert rep2["window"]["map"]["0.5"] == pytest.approx(2 / 3)
    # a1 at t=0.55: miss then hit, half the gold found -> precision 0.5 over recall 0..0.5 -> AP 0.25
    assert rep2["window"]["map"]["0.55"] == pytest.approx((1.0 + 0.25 + 0) / 3)


def test_top1_convention_first_written_or_highest_scored(example):
    rows, records = example
    rows[0] = pred(records[0], [[3, 6]], scores=[1.0])
    rows[1] = pred(records[1], [[5, 8], [0, 2]], scores=[0.1, 0.9])  # the model is surer of [0,2]
    rows[4] = pred(records[4], [[1, 2]], scores=[0.3])
    first = ev.evaluate(rows, records)
    scored = ev.evaluate(rows, records, top1="scored")
    assert first["window"]["top1"] == "first" and scored["window"]["top1"] == "scored"
    # a1's top-1: [5,8] vs [6,8] = 2/3 as written; [0,2] vs [0,4] = 0.5 by score
    assert first["window"]["miou"] == pytest.approx((0.75 + 2 / 3) / 3)
    assert scored["window"]["miou"] == pytest.approx((0.75 + 0.5) / 3)
    assert scored["window"]["r1"]["0.5"] == pytest.approx(2 / 3) and scored["window"]["r1"]["0.7"] == pytest.approx(1 / 3)
    assert scored["window"]["map"] == first["window"]["map"]  # mAP always ranks by score
    rows[0] = pred(records[0], [[3, 6]])  # no scores: the scored convention cannot be applied
    with pytest.raises(ValueError, match="--top1 scored needs per-segment scores"):
        ev.evaluate(rows, records, top1="scored")


def test_missing_prediction_counts_as_failed_and_stray_is_an_error(example):
    rows, records = example
    rep = ev.evaluate(rows[1:], records)
    assert rep["format"]["missing"] == 1 and rep["format"]["failed_rate"] == pytest.approx(2 / 5)
    assert rep["window"]["miou"] == pytest.approx((0 + 2 / 3 + 0) / 3)
    only = ev.evaluate(rows[1:], records, only_predicted=True)
    assert only["counts"]["windows"] == 4
    with pytest.raises(ValueError, match="manifest does not have"):
        ev.evaluate(rows, records[1:])


def test_gold_annotations_override_video_level(example, tmp_path):
    rows, records = example
    ann = tmp_path / "annotations.jsonl"
    ann.write_text('{"id": "a", "video": "a.mp4", "segments": [[3, 6], [10, 12], [15, 18]]}\n'
                   '{"id": "b", "video": "b.mp4", "segments": [[21, 22]]}\n')
    gold = ev.load_gold_annotations(ann)
    rep = ev.evaluate(rows, records, gold_videos=gold)
    assert rep["video"]["gold_source"] == "annotations"
    assert rep["video"]["frame_f1"]["keep"]["f1"] == pytest.approx(1.0)  # preds equal this gold exactly
    assert rep["window"]["miou"] == pytest.approx((0.75 + 2 / 3) / 3)  # windows still use the manifest
    with pytest.raises(ValueError, match="no entry"):
        ev.evaluate(rows, records, gold_videos={"a": gold["a"]})


def test_cli_writes_json_and_html(example, tmp_path, capsys):
    rows, records = example
    shards = tmp_path / "shards"
    shards.mkdir()
    write_records(shards / "manifest.parquet", records, SampleRecord)
    preds = tmp_path / "preds.jsonl"
    write_predictions(preds, rows)
    assert read_predictions(preds) == rows
    assert ev.main([str(preds), "--shards", str(shards), "--out", str(tmp_path / "r.json"),
                    "--html", str(tmp_path / "r.html")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["miou"] == pytest.approx((0.75 + 2 / 3) / 3)
    report = json.loads((tmp_path / "r.json").read_text())
    assert len(report["per_window"]) == 5
    page = (tmp_path / "r.html").read_text()
    assert page.count("<section class=\"video\"") == 2  # one review card per video
    assert "&lt;argmax&gt;11&lt;/argmax&gt;" in page  # raw output escaped into the tooltip
    assert page.count("<script") == 1 and "<script src" not in page  # one inline script, nothing fetched
