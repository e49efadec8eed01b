"""The review page: one static, self-contained HTML file to judge a model's keep lists by eye.

Written by `train.evaluate --html PAGE` from its report. Per video: a filmstrip of the frames the model
saw (JPEG thumbnails from the shards, embedded as data URIs, each under the time span it stands for),
the gold and predicted keep segments on the same time axis, one cell per window whose tooltip is the
model's raw output (status, flags, scores), and an HTML5 player of the source video. The player's
source is a path relative to the page (`--videos DIR`: the directory the manifest's source paths are
relative to), so the page opens straight from the file system next to the videos; clicking a segment or
a thumbnail seeks the player there, and "play keep only" plays the predicted keep segments back to back.
No external resources and no server: one inline script and stylesheet.
"""
from __future__ import annotations

import base64
import html
import io
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from schemas.manifest import SampleRecord, read_records
from schemas.shard import ShardError, ShardReader

THUMBS_PER_VIDEO = 16  # filmstrip cells per video (fewer when the build sampled fewer frames)
THUMB_HEIGHT = 54  # pixels of the embedded JPEG (re-encoded small: the page stays small)
STATUS_COLOR = {"valid": "#ffffff", "repaired": "#fff4c2", "failed": "#ffd6d6"}


def _thumb(jpeg: bytes) -> str:
    """A small JPEG data URI of one stored frame."""
    from PIL import Image

    img = Image.open(io.BytesIO(jpeg)).convert("RGB")
    if img.height > THUMB_HEIGHT:
        img = img.resize((max(1, round(img.width * THUMB_HEIGHT / img.height)), THUMB_HEIGHT), Image.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=75)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def filmstrip(records: Sequence[SampleRecord], reader: ShardReader, duration_s: float,
              cells: int = THUMBS_PER_VIDEO) -> tuple[list[dict], list[str]]:
    """Thumbnails of one video: cell k covers [k, k+1) * duration / cells and shows the stored frame whose
    source time is closest to the cell's middle. Returns (cells, problems): a window whose frames cannot
    be read leaves its cells out and says why (the page still renders)."""
    frames: list[tuple[float, SampleRecord, int]] = [(t, r, i) for r in records for i, t in enumerate(r.frame_times_s)]
    if not frames or duration_s <= 0:
        return [], []
    n = min(cells, len(frames))
    width = duration_s / n
    picks = []
    for k in range(n):
        mid = (k + 0.5) * width
        picks.append((k, min(frames, key=lambda f: abs(f[0] - mid))))
    problems: list[str] = []
    cache: dict[str, list[bytes] | None] = {}
    out = []
    for k, (t, rec, i) in picks:
        if rec.sample_id not in cache:
            try:
                cache[rec.sample_id] = reader.read(rec)[1]
            except (ShardError, OSError) as e:
                cache[rec.sample_id] = None
                problems.append(f"{rec.sample_id}: frames not shown ({e})")
        jpegs = cache[rec.sample_id]
        if jpegs is None:
            continue
        out.append({"start_s": k * width, "end_s": (k + 1) * width, "time_s": t, "src": _thumb(jpegs[i])})
    return out, problems


def _pct(t: float, duration: float) -> str:
    return f"{100.0 * max(0.0, min(t, duration)) / duration:.3f}%"


def _span(start: float, end: float, duration: float) -> str:
    return f"left:{_pct(start, duration)};width:{_pct(max(end - start, 0.0), duration)}"


def _window_tip(w: dict) -> str:
    scores = "" if not w.get("scores") else " scores " + ", ".join(f"{s:.2f}" for s in w["scores"])
    flags = f" [{', '.join(w['degenerate'])}]" if w["degenerate"] else ""
    raw = "(missing)" if w["raw_output"] is None else w["raw_output"]
    return (f"{w['sample_id']} ({w['window_start_s']:g}-{w['window_end_s']:g} s): {w['status']}{flags}{scores}\n"
            f"raw output: {raw}\ngold: {json.dumps(w['gold'])}")


def video_card(video: dict, windows: list[dict], strip: list[dict], problems: list[str], src: str | None,
               index: int) -> str:
    """One video: title, player, filmstrip, gold / predicted / window tracks."""
    dur = max(video["duration_s"], 1e-6)
    ff, wm = video["frame_f1"], video["window_metrics"]
    vid = html.escape(video["video_id"])
    out = [f'<section class="video" id="video-{index}" data-duration="{dur:.3f}" '
           f'data-keep="{html.escape(json.dumps(video["pred_keep"]))}">',
           f'<h2>{vid}</h2><p class="metrics">set IoU {_fmt(video["set_iou"])} · keep-F1 {_fmt(ff["keep"]["f1"])} · '
           f'cut-F1 {_fmt(ff["cut"]["f1"])} · window mIoU {_fmt(wm["miou"])} · {len(windows)} windows</p>']
    out.append('<div class="body">')
    if src is not None:
        out.append(f'<div class="player"><video src="{html.escape(src)}" controls preload="auto" muted '
                   f'playsinline></video><div class="buttons"><button class="keep-only">play keep only</button> '
                   f'<span class="now">0.0 s</span></div></div>')
    else:
        out.append('<p class="note player">no player: pass --videos DIR (the directory the manifest\'s source '
                   'paths are relative to) to train.evaluate</p>')
    out.append('<div class="timeline"><div class="track strip">')
    for c in strip:
        out.append(f'<img class="thumb" style="{_span(c["start_s"], c["end_s"], dur)}" src="{c["src"]}" '
                   f'data-start="{c["time_s"]:.3f}" alt="frame at {c["time_s"]:.1f} s" '
                   f'title="frame at {c["time_s"]:.1f} s (click to seek)">')
    out.append('</div>')
    for label, key, cls in (("gold", "gold_keep", "gold"), ("pred", "pred_keep", "pred")):
        out.append(f'<div class="track"><span class="label">{label}</span>')
        for s, e in video[key]:
            tip = f"{label} keep {s:.1f}-{e:.1f} s (click to seek)"
            out.append(f'<div class="seg {cls}" style="{_span(s, e, dur)}" data-start="{s:.3f}" data-end="{e:.3f}" '
                       f'title="{html.escape(tip)}"></div>')
        out.append('</div>')
    out.append('<div class="track windows"><span class="label">model</span>')
    for w in windows:
        out.append(f'<div class="win" style="{_span(w["window_start_s"], w["window_end_s"], dur)};'
                   f'background:{STATUS_COLOR[w["status"]]}" data-start="{w["window_start_s"]:.3f}" '
                   f'title="{html.escape(_window_tip(w))}">{html.escape((w["raw_output"] or "")[:60])}</div>')
    out.append('</div><div class="axis">')
    step = max(1, round(dur / 10))
    t = 0
    while t <= dur + 1e-9:
        out.append(f'<span style="left:{_pct(t, dur)}">{t:g}s</span>')
        t += step
    out.append('</div><div class="playhead"></div></div></div>')
    out += [f'<p class="note">{html.escape(p)}</p>' for p in problems]
    out.append('</section>')
    return "\n".join(out)


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


STYLE = """
body{font-family:sans-serif;margin:20px;max-width:1200px;color:#222}
td,th{padding:2px 8px;text-align:left}table{border-collapse:collapse}tr:nth-child(even){background:#f4f4f4}
section.video{border-top:1px solid #ccc;padding:8px 0 16px}
h2{font-size:16px;margin:6px 0}.metrics,.note{color:#555;font-size:13px;margin:2px 0 6px}
.body{display:flex;gap:16px;align-items:flex-start}.player{flex:0 0 240px}
.player video{width:240px;max-height:160px;background:#000;display:block}
.buttons{margin:4px 0;font-size:13px}.keep-only.on{background:#1565c0;color:#fff}
.timeline{position:relative;margin-left:44px;flex:1}
.track{position:relative;height:18px;margin:2px 0;background:#f2f2f2}
.track.strip{height:54px;background:#ddd;overflow:hidden}
.thumb{position:absolute;top:0;height:54px;object-fit:cover;cursor:pointer;border-right:1px solid #fff;box-sizing:border-box}
.label{position:absolute;left:-44px;font-size:11px;line-height:18px}
.seg{position:absolute;top:3px;height:12px;cursor:pointer;min-width:2px}
.seg.gold{background:#2e7d32}.seg.pred{background:#1565c0}
.track.windows{height:20px}.win{position:absolute;top:0;height:18px;border:1px solid #bbb;box-sizing:border-box;
  font:10px monospace;overflow:hidden;white-space:nowrap;cursor:help}
.axis{position:relative;height:16px;font-size:11px}.axis span{position:absolute;transform:translateX(-50%)}
.playhead{position:absolute;top:0;bottom:16px;width:2px;background:#d32f2f;left:0;pointer-events:none}
"""

# One player per video card. Seeking waits for the metadata when the video has not loaded yet; "keep only"
# jumps over everything outside the predicted keep segments and stops after the last one.
SCRIPT = """
document.querySelectorAll('section.video').forEach(function (card) {
  var video = card.querySelector('video');
  var duration = parseFloat(card.dataset.duration);
  var keep = JSON.parse(card.dataset.keep);
  var head = card.querySelector('.playhead');
  var now = card.querySelector('.now');
  var button = card.querySelector('.keep-only');
  var keepOnly = false;
  function seek(t) {
    if (!video) return;
    var go = function () { video.currentTime = t; };
    if (video.readyState >= 1) go(); else video.addEventListener('loadedmetadata', go, {once: true});
  }
  card.querySelectorAll('[data-start]').forEach(function (el) {
    el.addEventListener('click', function (ev) { ev.stopPropagation(); seek(parseFloat(el.dataset.start)); });
  });
  if (!video) return;
  function setKeepOnly(on) {
    keepOnly = on && keep.length > 0;
    button.classList.toggle('on', keepOnly);
    button.textContent = keepOnly ? 'stop keep only' : 'play keep only';
  }
  button.addEventListener('click', function () {
    setKeepOnly(!keepOnly);
    if (keepOnly) { seek(keep[0][0]); video.play().catch(function () {}); }
  });
  video.addEventListener('timeupdate', function () {
    var t = video.currentTime;
    head.style.left = (100 * Math.min(t, duration) / duration) + '%';
    now.textContent = t.toFixed(1) + ' s' + (keepOnly ? ' (keep only)' : '');
    if (!keepOnly) return;
    for (var i = 0; i < keep.length; i++) {
      if (t < keep[i][0] - 0.05) { video.currentTime = keep[i][0]; return; }
      if (t < keep[i][1]) return;
    }
    video.pause(); setKeepOnly(false);
  });
});
"""


def render_review(report: dict, summary: list[tuple[str, str]], *, shards: Path, page: Path,
                  videos: Path | None) -> str:
    """The page for an evaluate report. summary: the (metric, value) rows shown on top; page: where the
    HTML will be written (player sources are relative to its directory); videos: source root or None."""
    records: dict[str, list[SampleRecord]] = defaultdict(list)
    manifest = Path(shards) / "manifest.parquet"
    for rec in read_records(manifest, SampleRecord):
        records[rec.video_id].append(rec)
    reader = ShardReader(shards)
    windows_by_video: dict[str, list[dict]] = defaultdict(list)
    for w in report["per_window"]:
        windows_by_video[w["video_id"]].append(w)
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>video-ora review</title>",
           f"<style>{STYLE}</style></head><body><h1>video-ora review</h1><table>"]
    out += [f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in summary]
    out.append("</table><p class='note'>Per video: the frames the model saw, gold keep (green) and predicted "
               "keep (blue) on one time axis, and one cell per window with the model's raw output (hover; "
               "white = valid, yellow = repaired, red = failed). Click a segment or a frame to seek the player.</p>")
    for i, video in enumerate(report["per_video"]):
        strip, problems = filmstrip(records.get(video["video_id"], []), reader, video["duration_s"])
        src = None
        if videos is not None:
            src = Path(os.path.relpath(Path(videos).resolve() / video["source_path"], Path(page).resolve().parent)).as_posix()
        out.append(video_card(video, windows_by_video[video["video_id"]], strip, problems, src, i))
    out.append(f"<h2>Definitions</h2><pre>{html.escape(report.get('definitions') or '')}</pre>")
    out.append(f"<script>{SCRIPT}</script></body></html>")
    return "\n".join(out)
