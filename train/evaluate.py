"""Score preds.jsonl against the build's gold answers: `python -m train.evaluate preds.jsonl --shards SHARDS`.

Definitions (also written into every report under "definitions"):

Window level (one manifest sample = one query; gold = the manifest's window-local segments):
- positive window: gold has >= 1 segment; negative window: gold is [] ("nothing worth keeping").
- top-1 IoU: the model's top-1 segment against the gold segment it overlaps best (max IoU over gold
  segments). Which segment is top-1 is the report's "top1" convention: "first" (default) = the FIRST
  segment the model wrote (the answer's order is its ranking, as TimeChat / VTimeLLM read a generated
  answer); "scored" (--top1 scored) = the segment with the highest score in preds.jsonl (ties: the
  earlier one), as QVHighlights ranks scored windows. A failed parse or an empty answer scores 0, as
  TimeChat, VTimeLLM and E.T.Bench count unparseable answers.
- R@1@t: share of positive windows with top-1 IoU >= t, t in 0.3/0.5/0.7. mIoU: mean top-1 IoU over
  positive windows. Negatives are excluded from R@1 and mIoU.
- set IoU: |union(pred) & union(gold)| / |union(pred) | union(gold)| over time, for multi-segment answers
  (mean over positive windows).
- negatives: a negative window is correct when the answer parsed (not failed) and is empty; reported as
  negative accuracy. Every predicted segment on a negative window is a false positive in P/R/F1.
- segment P/R/F1@0.5: one-to-one greedy matching (pairs taken by decreasing IoU, each segment used once,
  IoU >= 0.5 is a true positive), micro-averaged over all windows (negatives included).
- mAP: QVHighlights standalone_eval (compute_average_precision_detection + interpolated precision) per
  positive window over IoU 0.5:0.05:0.95, averaged over windows then thresholds. Needs per-segment scores
  in the predictions (train.predict writes them: the mean probability of each segment's number tokens;
  or --order-scores: the k-th written segment scores 1/(k+1)); skipped with a note otherwise. A positive window without predicted segments has AP 0.
- rates: valid = strict training format, repaired = usable only after lenient parsing/normalization,
  failed = no usable answer (a manifest sample missing from preds.jsonl counts as failed and is counted
  under "missing"); degenerate = any degenerate flag.

Video level (gold = the manifest answers mapped to source time and merged, or --gold annotations):
- keep lists: window-local segments + window start, merged when overlapping or closer than --merge-gap.
- frame keep/cut F1: time is cut into bins of --resolution seconds (default 0.1 s) over [0, duration]
  (duration = the last window end); a bin is "keep" when its center lies in a keep segment. keep-F1 treats
  keep as the positive class, cut-F1 treats cut as positive; micro over all bins of all videos.
- segment P/R/F1@0.5 on the merged keep lists, and set IoU per video (macro mean).
Conventions for empty sets: precision with no predictions is 1 if there was nothing to find, else 0
(recall likewise), so an empty answer on an empty gold scores 1/1/1.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from schemas.manifest import RejectRecord, SampleRecord, Segment, read_records
from schemas.predictions import DEGENERATE_FLAGS, PredictionRow, read_predictions
from train import segments as seg

R1_THRESHOLDS = (0.3, 0.5, 0.7)
MAP_THRESHOLDS = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))  # 0.5:0.05:0.95
PRF_THRESHOLD = 0.5
TOP1 = ("first", "scored")  # which predicted segment R@1 / mIoU take (module doc)
TOP1_TEXT = {"first": "first segment written; --top1 scored for the highest-scored",
             "scored": "highest-scored segment; --top1 first for the first written"}
MAP_MAX_PREDS = 10  # QVHighlights scores the 10 highest-scored windows of a query
RESOLUTION_S = 0.1


# ---------------------------------------------------------------- metric primitives

def iou(a: Segment, b: Segment) -> float:
    """Temporal IoU of two segments (0 when either is empty or they do not overlap)."""
    inter = max(0.0, min(a.end_s, b.end_s) - max(a.start_s, b.start_s))
    union = max(a.end_s, b.end_s) - min(a.start_s, b.start_s)
    return inter / union if union > 0 and inter > 0 else 0.0


def top1_iou(pred: Sequence[Segment], gold: Sequence[Segment]) -> float:
    """IoU of the first predicted segment with its best-matching gold segment; 0 if either is empty."""
    if not pred or not gold:
        return 0.0
    return max(iou(pred[0], g) for g in gold)


def match_greedy(pred: Sequence[Segment], gold: Sequence[Segment], threshold: float = PRF_THRESHOLD) -> int:
    """True positives of a one-to-one matching: pairs by decreasing IoU, each segment matched once."""
    pairs = sorted(
        ((iou(p, g), i, j) for i, p in enumerate(pred) for j, g in enumerate(gold)), key=lambda x: (-x[0], x[1], x[2])
    )
    used_p, used_g, tp = set(), set(), 0
    for v, i, j in pairs:
        if v < threshold:
            break
        if i in used_p or j in used_g:
            continue
        used_p.add(i)
        used_g.add(j)
        tp += 1
    return tp


def prf(tp: int, n_pred: int, n_gold: int) -> dict:
    """Precision/recall/F1 with the empty-set convention of the module doc."""
    fp, fn = n_pred - tp, n_gold - tp
    p = tp / n_pred if n_pred else (1.0 if fn == 0 else 0.0)
    r = tp / n_gold if n_gold else (1.0 if fp == 0 else 0.0)
    f1 = 2 * p * r / (p + r) if p + r > 0 else 0.0
    return {"precision": p, "recall": r, "f1": f1, "tp": tp, "pred": n_pred, "gold": n_gold}


def union_length(segments: Iterable[Segment]) -> float:
    return seg.total_s(seg.merge(segments, gap_s=0.0))


def set_iou(pred: Sequence[Segment], gold: Sequence[Segment]) -> float:
    """IoU of the union of predicted segments with the union of gold segments (1 if both are empty)."""
    if not pred and not gold:
        return 1.0
    p, g = seg.merge(pred, 0.0), seg.merge(gold, 0.0)
    inter = sum(max(0.0, min(a.end_s, b.end_s) - max(a.start_s, b.start_s)) for a in p for b in g)
    union = seg.total_s(p) + seg.total_s(g) - inter
    return inter / union if union > 0 else 0.0


def frame_mask(segments: Iterable[Segment], duration_s: float, resolution_s: float = RESOLUTION_S) -> np.ndarray:
    """Bins of resolution_s over [0, duration_s]; True where the bin center lies in a segment."""
    n = max(1, math.ceil(duration_s / resolution_s - 1e-9))
    centers = (np.arange(n) + 0.5) * resolution_s
    mask = np.zeros(n, dtype=bool)
    for s in segments:
        mask |= (centers >= s.start_s) & (centers < s.end_s)
    return mask


def confusion(pred_mask: np.ndarray, gold_mask: np.ndarray) -> dict:
    return {
        "tp": int(np.sum(pred_mask & gold_mask)),
        "fp": int(np.sum(pred_mask & ~gold_mask)),
        "fn": int(np.sum(~pred_mask & gold_mask)),
        "tn": int(np.sum(~pred_mask & ~gold_mask)),
    }


def keep_cut_f1(c: dict) -> dict:
    """Keep-F1 (keep positive) and cut-F1 (cut positive) from a bin confusion count."""
    keep = prf(c["tp"], c["tp"] + c["fp"], c["tp"] + c["fn"])
    cut = prf(c["tn"], c["tn"] + c["fn"], c["tn"] + c["fp"])
    return {"keep": _prf_short(keep), "cut": _prf_short(cut), "bins": sum(c.values())}


def _prf_short(d: dict) -> dict:
    return {k: d[k] for k in ("precision", "recall", "f1")}


def interpolated_precision_recall(precision: np.ndarray, recall: np.ndarray) -> float:
    """Area under the interpolated precision-recall curve (QVHighlights standalone_eval/utils.py)."""
    mprec = np.hstack([[0], precision, [0]])
    mrec = np.hstack([[0], recall, [1]])
    for i in range(len(mprec) - 1)[::-1]:
        mprec[i] = max(mprec[i], mprec[i + 1])
    idx = np.where(mrec[1::] != mrec[0:-1])[0] + 1
    return float(np.sum((mrec[idx] - mrec[idx - 1]) * mprec[idx]))


def average_precision(
    preds: Sequence[tuple[Segment, float]], gold: Sequence[Segment], thresholds: Sequence[float] = MAP_THRESHOLDS
) -> np.ndarray:
    """AP of one query at each IoU threshold, as QVHighlights' compute_average_precision_detection.

    Predictions are ranked by score (stable, so ties keep the written order); each is a true positive when
    its best still-unmatched gold segment (by IoU, highest first) reaches the threshold. Only the
    MAP_MAX_PREDS highest-scored predictions count, as there.
    """
    ap = np.zeros(len(thresholds))
    if not preds or not gold:
        return ap
    order = sorted(range(len(preds)), key=lambda i: -preds[i][1])[:MAP_MAX_PREDS]
    tp = np.zeros((len(thresholds), len(order)))
    fp = np.zeros((len(thresholds), len(order)))
    lock = np.full((len(thresholds), len(gold)), -1)
    for rank, i in enumerate(order):
        ious = np.array([iou(preds[i][0], g) for g in gold])
        by_iou = ious.argsort()[::-1]
        for t, thr in enumerate(thresholds):
            for j in by_iou:
                if ious[j] < thr:
                    fp[t, rank] = 1
                    break
                if lock[t, j] >= 0:
                    continue
                tp[t, rank] = 1
                lock[t, j] = rank
                break
            if fp[t, rank] == 0 and tp[t, rank] == 0:
                fp[t, rank] = 1
    tp_c, fp_c = np.cumsum(tp, axis=1), np.cumsum(fp, axis=1)
    recall = tp_c / len(gold)
    precision = tp_c / (tp_c + fp_c)
    for t in range(len(thresholds)):
        ap[t] = interpolated_precision_recall(precision[t], recall[t])
    return ap


# ---------------------------------------------------------------- evaluation

def load_gold_annotations(path: str | Path, fmt: str = "default") -> dict[str, list[Segment]]:
    """Source-time gold per video id from an annotations file (the `prep build` input formats)."""
    from schemas.annotations import parse_row, read_rows

    out: dict[str, list[Segment]] = {}
    for n, row in enumerate(read_rows(path), 1):
        ann = parse_row(row, n, fmt, Path("."), {})
        if isinstance(ann, RejectRecord):
            raise ValueError(f"{path}: {ann.detail}")
        out[ann.video_id] = seg.merge(ann.segments, 0.0)
    return out


def ranked(row: PredictionRow, top1: str) -> list[Segment]:
    """The row's segments in ranking order: as written ("first") or by decreasing score ("scored")."""
    if top1 == "first":
        return list(row.segments)
    if row.scores is None:
        raise ValueError(f"{row.sample_id}: --top1 scored needs per-segment scores in preds.jsonl "
                         "(written by train.predict; rows from older runs have none)")
    order = sorted(range(len(row.segments)), key=lambda i: -row.scores[i])  # stable: ties keep written order
    return [row.segments[i] for i in order]


def _window_eval(rec: SampleRecord, row: PredictionRow | None, top1: str = "first") -> dict:
    gold = list(rec.segments)
    status = row.status if row is not None else "failed"
    pred = list(row.segments) if row is not None and status != "failed" else []
    out = {
        "sample_id": rec.sample_id,
        "video_id": rec.video_id,
        "window_start_s": rec.window_start_s,
        "window_end_s": rec.window_end_s,
        "status": status,
        "missing": row is None,
        "degenerate": list(row.degenerate) if row is not None else [],
        "raw_output": row.raw_output if row is not None else None,
        "gold": [[g.start_s, g.end_s] for g in gold],
        "pred": [[p.start_s, p.end_s] for p in pred],
        "scores": list(row.scores) if row is not None and pred and row.scores is not None else None,
        "positive": bool(gold),
        "tp@0.5": match_greedy(pred, gold),
    }
    if gold:
        out["top1_iou"] = top1_iou(ranked(row, top1) if pred else [], gold)
        out["set_iou"] = set_iou(pred, gold)
    else:
        out["negative_correct"] = status != "failed" and not pred
    return out


def _scored(row: PredictionRow | None, order_scores: bool) -> list[tuple[Segment, float]] | None:
    if row is None or row.status == "failed" or not row.segments:
        return []
    if row.scores is not None:
        return list(zip(row.segments, row.scores))
    if order_scores:
        return [(s, 1.0 / (k + 1)) for k, s in enumerate(row.segments)]
    return None


def _rates(windows: list[dict]) -> dict:
    n = len(windows)
    status = Counter(w["status"] for w in windows)
    flags = Counter(f for w in windows for f in w["degenerate"])
    degenerate = sum(1 for w in windows if w["degenerate"])
    return {
        "windows": n,
        "valid_rate": status["valid"] / n if n else 0.0,
        "repaired_rate": status["repaired"] / n if n else 0.0,
        "failed_rate": status["failed"] / n if n else 0.0,
        "degenerate_rate": degenerate / n if n else 0.0,
        "missing": sum(1 for w in windows if w["missing"]),
        "status_counts": {k: status[k] for k in ("valid", "repaired", "failed")},
        "degenerate_counts": {k: flags[k] for k in DEGENERATE_FLAGS},
    }


def _window_summary(windows: list[dict]) -> dict:
    pos = [w for w in windows if w["positive"]]
    neg = [w for w in windows if not w["positive"]]
    tp = sum(w["tp@0.5"] for w in windows)
    n_pred = sum(len(w["pred"]) for w in windows)
    n_gold = sum(len(w["gold"]) for w in windows)
    return {
        "positives": len(pos),
        "negatives": len(neg),
        "r1": {str(t): (sum(w["top1_iou"] >= t for w in pos) / len(pos) if pos else None) for t in R1_THRESHOLDS},
        "miou": (sum(w["top1_iou"] for w in pos) / len(pos)) if pos else None,
        "mean_set_iou": (sum(w["set_iou"] for w in pos) / len(pos)) if pos else None,
        "segment_prf@0.5": prf(tp, n_pred, n_gold),
        "negative_accuracy": (sum(w["negative_correct"] for w in neg) / len(neg)) if neg else None,
        "negative_correct": sum(w["negative_correct"] for w in neg),
    }


def evaluate(
    rows: list[PredictionRow],
    records: list[SampleRecord],
    *,
    gold_videos: dict[str, list[Segment]] | None = None,
    gap_s: float = seg.MERGE_GAP_S,
    resolution_s: float = RESOLUTION_S,
    order_scores: bool = False,
    only_predicted: bool = False,
    top1: str = "first",
) -> dict:
    """The full report as a dict (see the module doc for every definition)."""
    if top1 not in TOP1:
        raise ValueError(f"top1 must be one of {TOP1}, got {top1!r}")
    by_id = {r.sample_id: r for r in rows}
    known = {r.sample_id for r in records}
    stray = sorted(set(by_id) - known)
    if stray:
        raise ValueError(
            f"{len(stray)} predictions name samples the manifest does not have (first: {stray[:3]}); "
            "were they made from another build?"
        )
    if only_predicted:
        records = [r for r in records if r.sample_id in by_id]
    windows = [_window_eval(rec, by_id.get(rec.sample_id), top1) for rec in records]

    # mAP, only with scores
    scored = [(_scored(by_id.get(rec.sample_id), order_scores), rec) for rec in records if rec.segments]
    unscored = sum(1 for s, _ in scored if s is None)
    if not scored:
        map_report, map_note = None, "no positive windows"
    elif unscored:
        map_report = None
        map_note = (
            f"skipped: {unscored} positive windows have predicted segments without scores "
            "(preds.jsonl from a train.predict that did not score segments; rerun it, or pass --order-scores "
            "to rank by written order)"
        )
    else:
        aps = np.array([average_precision(s, rec.segments) for s, rec in scored])
        per_thr = aps.mean(axis=0)
        map_report = {str(t): float(v) for t, v in zip(MAP_THRESHOLDS, per_thr)}
        map_report["average"] = float(per_thr.mean())
        own = sum(1 for _, rec in scored if rec.sample_id in by_id and by_id[rec.sample_id].scores is not None)
        rest = len(scored) - own
        map_note = (f"{own} positive windows ranked by the scores in preds.jsonl"
                    + (f", {rest} by written order (--order-scores)" if rest else ""))

    # video level
    recs_by_video: dict[str, list[SampleRecord]] = defaultdict(list)
    for rec in records:
        recs_by_video[rec.video_id].append(rec)
    gold_keep = seg.gold_keep_lists(records, gap_s)
    if gold_videos is not None:
        absent = sorted(set(recs_by_video) - set(gold_videos))
        if absent:
            raise ValueError(f"--gold has no entry for {len(absent)} videos (first: {absent[:3]})")
        gold_keep = {vid: gold_videos[vid] for vid in recs_by_video}
    evaluated_rows = [by_id[r.sample_id] for r in records if r.sample_id in by_id]
    pred_keep = seg.keep_lists(evaluated_rows, gap_s)
    win_by_video: dict[str, list[dict]] = defaultdict(list)
    for w in windows:
        win_by_video[w["video_id"]].append(w)

    videos = []
    total = {"tp": 0, "fp": 0, "fn": 0, "tn": 0}
    v_tp = v_pred = v_gold = 0
    for vid, recs in recs_by_video.items():
        duration = max(r.window_end_s for r in recs)
        gold = [s for s in gold_keep.get(vid, []) if s.start_s < duration]
        pred = pred_keep.get(vid, [])
        c = confusion(frame_mask(pred, duration, resolution_s), frame_mask(gold, duration, resolution_s))
        for k in total:
            total[k] += c[k]
        tp = match_greedy(pred, gold)
        v_tp, v_pred, v_gold = v_tp + tp, v_pred + len(pred), v_gold + len(gold)
        videos.append({
            "video_id": vid,
            "source_path": recs[0].source_path,
            "duration_s": duration,
            "windows": [[r.window_start_s, r.window_end_s] for r in recs],
            "gold_keep": [[s.start_s, s.end_s] for s in gold],
            "pred_keep": [[s.start_s, s.end_s] for s in pred],
            "set_iou": set_iou(pred, gold),
            "segment_prf@0.5": prf(tp, len(pred), len(gold)),
            "frame_f1": keep_cut_f1(c),
            "window_metrics": _window_summary(win_by_video[vid]),
            "format": _rates(win_by_video[vid]),
        })

    return {
        "counts": {"windows": len(windows), "videos": len(videos), "predictions": len(rows)},
        "format": _rates(windows),
        "window": {**_window_summary(windows), "top1": top1, "map": map_report, "map_note": map_note},
        "video": {
            "frame_f1": {**keep_cut_f1(total), "resolution_s": resolution_s},
            "segment_prf@0.5": prf(v_tp, v_pred, v_gold),
            "mean_set_iou": (sum(v["set_iou"] for v in videos) / len(videos)) if videos else None,
            "gold_source": "annotations" if gold_videos is not None else "manifest",
            "merge_gap_s": gap_s,
        },
        "per_video": videos,
        "per_window": windows,
        "definitions": __doc__,
    }


# ---------------------------------------------------------------- HTML

def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def summary_rows(report: dict) -> list[tuple[str, str]]:
    """(metric, value) rows of the report's headline numbers, as the review page shows them."""
    w, f, v = report["window"], report["format"], report["video"]
    return [
        ("windows / videos", f'{report["counts"]["windows"]} / {report["counts"]["videos"]}'),
        ("valid / repaired / failed", f'{_fmt(f["valid_rate"])} / {_fmt(f["repaired_rate"])} / {_fmt(f["failed_rate"])}'),
        ("degenerate rate", _fmt(f["degenerate_rate"])),
        (f'R@1 IoU 0.3 / 0.5 / 0.7 (top-1 = {TOP1_TEXT[w["top1"]]})',
         " / ".join(_fmt(w["r1"][k]) for k in ("0.3", "0.5", "0.7"))),
        ("mIoU (top-1)", _fmt(w["miou"])),
        ("mean set IoU (windows)", _fmt(w["mean_set_iou"])),
        ("segment P/R/F1 @0.5 (windows)", " / ".join(_fmt(w["segment_prf@0.5"][k]) for k in ("precision", "recall", "f1"))),
        ("negative accuracy", _fmt(w["negative_accuracy"])),
        ("mAP 0.5:0.95", _fmt(w["map"]["average"]) if w["map"] else w["map_note"]),
        (f'keep-F1 / cut-F1 (bins of {v["frame_f1"]["resolution_s"]} s)',
         f'{_fmt(v["frame_f1"]["keep"]["f1"])} / {_fmt(v["frame_f1"]["cut"]["f1"])}'),
        ("segment P/R/F1 @0.5 (videos)", " / ".join(_fmt(v["segment_prf@0.5"][k]) for k in ("precision", "recall", "f1"))),
    ]


def render_html(report: dict, *, shards: Path, page: Path, videos: Path | None = None) -> str:
    """The review page of a report (train/review.py): filmstrips, keep tracks, raw outputs, players."""
    from train.review import render_review

    return render_review(report, summary_rows(report), shards=shards, page=page, videos=videos)


# ---------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preds", help="preds.jsonl written by train.predict")
    ap.add_argument("--shards", required=True, help="the build directory (manifest.parquet)")
    ap.add_argument("--gold", help="annotations file with source-time segments per video (else: the manifest)")
    ap.add_argument("--gold-format", default="default", choices=("default", "qvhighlights"))
    ap.add_argument("--out", help="write the JSON report here")
    ap.add_argument("--html", help="write the review page here (static HTML: filmstrips, keep segments, raw outputs, "
                    "players)")
    ap.add_argument("--videos", help="directory the manifest's source paths are relative to: the review page "
                    "plays them (paths relative to the page)")
    ap.add_argument("--merge-gap", type=float, default=seg.MERGE_GAP_S, help="seconds; pieces this close merge")
    ap.add_argument("--resolution", type=float, default=RESOLUTION_S, help="bin size of keep/cut F1 (seconds)")
    ap.add_argument("--order-scores", action="store_true",
                    help="score segments by written order for mAP (predictions without scores)")
    ap.add_argument("--top1", choices=TOP1, default="first",
                    help="R@1 / mIoU convention: the first segment written, or the highest-scored one")
    ap.add_argument("--only-predicted", action="store_true", help="evaluate only the samples in preds.jsonl")
    args = ap.parse_args(argv)

    rows = read_predictions(args.preds)
    records = read_records(Path(args.shards) / "manifest.parquet", SampleRecord)
    gold = load_gold_annotations(args.gold, args.gold_format) if args.gold else None
    report = evaluate(rows, records, gold_videos=gold, gap_s=args.merge_gap, resolution_s=args.resolution,
                      order_scores=args.order_scores, only_predicted=args.only_predicted, top1=args.top1)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.html:
        Path(args.html).write_text(render_html(report, shards=Path(args.shards), page=Path(args.html),
                                               videos=Path(args.videos) if args.videos else None))
    w, f, v = report["window"], report["format"], report["video"]
    print(json.dumps({
        "windows": report["counts"]["windows"], "videos": report["counts"]["videos"],
        "valid_rate": f["valid_rate"], "repaired_rate": f["repaired_rate"], "failed_rate": f["failed_rate"],
        "degenerate_rate": f["degenerate_rate"], "miou": w["miou"], "r1": w["r1"], "top1": w["top1"],
        "segment_f1@0.5": w["segment_prf@0.5"]["f1"], "negative_accuracy": w["negative_accuracy"],
        "map": w["map"]["average"] if w["map"] else None, "keep_f1": v["frame_f1"]["keep"]["f1"],
        "cut_f1": v["frame_f1"]["cut"]["f1"],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
