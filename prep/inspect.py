"""`python -m prep inspect SHARDS [--sample ID --out PNG]`: what a build holds, or what one sample shows.

The summary answers "what will the model see": sample/video/window counts, positives vs negatives, the
frames, sizes and token distributions (text histograms), the budget from build.json and the rejects by
reason. With --sample it prints that sample's record and draws a contact sheet: the frames as stored (after
the budget resize), each labelled with its window-local time, over a timeline of the window with the answer
segments and the frame times on it.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

from schemas.manifest import RejectRecord, SampleRecord, SchemaError, read_records
from schemas.build import BuildRecord
from schemas.shard import ShardError, ShardReader, ShardSample

HIST_WIDTH = 40  # characters of the longest histogram bar
HIST_BINS = 8


# ----------------------------------------------------------------------------------------------- summary


def _stats(values: list[int]) -> dict:
    if not values:
        return {"total": 0, "min": None, "median": None, "max": None, "mean": None}
    return {"total": sum(values), "min": min(values), "median": statistics.median(values), "max": max(values),
            "mean": round(statistics.fmean(values), 2)}


def histogram(values: list[int], bins: int = HIST_BINS) -> list[tuple[str, int]]:
    """(label, count) rows: one row per value when there are few distinct values, else equal-width bins."""
    if not values:
        return []
    distinct = sorted(set(values))
    if len(distinct) <= bins:
        counts = Counter(values)
        return [(str(v), counts[v]) for v in distinct]
    lo, hi = distinct[0], distinct[-1]
    width = max(1, -(-(hi - lo + 1) // bins))  # ceil
    counts = Counter((v - lo) // width for v in values)
    return [(f"{lo + b * width}-{lo + (b + 1) * width - 1}", counts[b]) for b in range((hi - lo) // width + 1)]


def histogram_lines(title: str, rows: list[tuple[str, int]]) -> list[str]:
    if not rows:
        return [f"{title}: (none)"]
    top = max(c for _, c in rows)
    pad = max(len(label) for label, _ in rows)
    lines = [f"{title}:"]
    for label, count in rows:
        bar = "#" * (round(count / top * HIST_WIDTH) if count else 0)
        lines.append(f"  {label:>{pad}} | {bar} {count}")
    return lines


def inspect_shards(path: str | Path) -> dict:
    """Summary of the build in `path` as a plain dict (also what `--json` prints)."""
    root = Path(path)
    records = read_records(root / "manifest.parquet", SampleRecord)
    rejects = read_records(root / "rejects.parquet", RejectRecord) if (root / "rejects.parquet").exists() else []
    build = BuildRecord.read(root)
    config = build.config
    windows_per_video = Counter(r.video_id for r in records)
    fields = ("num_frames", "visual_tokens", "text_tokens", "supervised_tokens", "input_tokens")
    return {
        "path": str(root),
        "samples": len(records),
        "videos": len(windows_per_video),
        "shards": len({r.shard for r in records}),
        "shard_bytes": sum(s.bytes for s in build.shard_files),
        "windows": len(records),
        "positives": sum(1 for r in records if r.segments),
        "negatives": sum(1 for r in records if not r.segments),
        "windows_per_video": _stats(list(windows_per_video.values())),
        **{name: _stats([getattr(r, name) for r in records]) for name in fields},
        "frame_sizes": dict(Counter(f"{r.width}x{r.height}" for r in records).most_common()),
        "histograms": {
            name: histogram([getattr(r, name) for r in records]) for name in ("num_frames", "visual_tokens", "input_tokens")
        },
        "window_seconds": config.get("window_seconds"),
        "stride_seconds": config.get("stride_seconds"),
        "max_input_tokens": config.get("max_input_tokens"),
        "jpeg_quality": config.get("jpeg_quality"),
        "budget": build.budget,
        "prompt_layout": build.prompt.layout,
        "decoders": build.decode.backends or {"?": build.decode.backend},  # codec -> backend (older builds: backend)
        "rejects": len(rejects),
        "rejects_by_reason": dict(sorted(Counter(r.reason for r in rejects).items())),
        "rejects_by_stage": dict(sorted(Counter(r.stage for r in rejects).items())),
    }


def summary_lines(s: dict) -> list[str]:
    b = s["budget"] or {}
    lines = [
        f"{s['path']}: {s['samples']} samples ({s['positives']} with segments, {s['negatives']} negatives) "
        f"from {s['videos']} videos in {s['shards']} shards ({s['shard_bytes'] / 2**20:.1f} MiB)",
        f"windows: {s['window_seconds']} s, stride {s['stride_seconds']} s; per video min {s['windows_per_video']['min']}, "
        f"median {s['windows_per_video']['median']}, max {s['windows_per_video']['max']}",
        f"budget: {b.get('model_family')} {b.get('video_min_tokens')}-{b.get('video_max_tokens')} tokens/frame, "
        f"{b.get('fps')} fps, frames {b.get('min_frames')}-{b.get('max_frames')}, "
        f"max input tokens {s['max_input_tokens']}, jpeg quality {s['jpeg_quality']}, prompt layout {s['prompt_layout']}",
        "decoded by: " + ", ".join(f"{codec} -> {backend}" for codec, backend in s["decoders"].items()),
    ]
    for name in ("num_frames", "visual_tokens", "text_tokens", "supervised_tokens", "input_tokens"):
        st = s[name]
        lines.append(f"{name}: total {st['total']}, min {st['min']}, median {st['median']}, mean {st['mean']}, max {st['max']}")
    lines.append("frame sizes: " + ", ".join(f"{k} x{v}" for k, v in s["frame_sizes"].items()))
    for name, rows in s["histograms"].items():
        lines += histogram_lines(f"{name} per sample", rows)
    lines.append(f"rejects: {s['rejects']}")
    lines += [f"  {reason}: {n}" for reason, n in s["rejects_by_reason"].items()]
    return lines


# ----------------------------------------------------------------------------------------------- one sample


def find_record(root: Path, sample: str) -> SampleRecord:
    """By sample_id ("vid/w0003") or WebDataset key."""
    records = read_records(root / "manifest.parquet", SampleRecord)
    for r in records:
        if sample in (r.sample_id, r.key):
            return r
    near = [r.sample_id for r in records if sample.split("/")[0] in r.sample_id][:5]
    raise KeyError(f"no sample {sample!r} in {root / 'manifest.parquet'}" + (f"; similar: {near}" if near else ""))


def read_sample(root: Path, record: SampleRecord) -> tuple[ShardSample, list[bytes]]:
    """The sample's JSON and JPEG bytes from its tar, through the trainer's reader (digests checked)."""
    return ShardReader(root).read(record)


def sample_lines(record: SampleRecord, meta: ShardSample) -> list[str]:
    d = dataclasses.asdict(record)
    lines = [f"{record.sample_id}  ({record.shard} : {record.key})"]
    for k, v in d.items():
        if k in ("sample_id", "shard", "key"):
            continue
        if isinstance(v, list) and len(v) > 8 and k != "segments":
            v = f"{[round(x, 3) if isinstance(x, float) else x for x in v[:4]]} ... {len(v)} values"
        lines.append(f"  {k}: {v}")
    lines.append(f"  prompt_tokens: {meta.prompt_tokens} (labels start at position {meta.prompt_tokens})")
    return lines


def contact_sheet(record: SampleRecord, jpegs: list[bytes], out: str | Path, thumb_width: int = 192) -> Path:
    """PNG: the frames in rows, each with its window-local time, above a timeline of the window showing the
    answer segments (green) and where each frame sits (ticks)."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    scale = min(1.0, thumb_width / record.width)
    tw, th = max(1, round(record.width * scale)), max(1, round(record.height * scale))
    cols = min(8, record.num_frames)
    rows = -(-record.num_frames // cols)
    label_h, gap, margin = 14, 4, 8
    sheet_w = margin * 2 + cols * tw + (cols - 1) * gap
    grid_h = rows * (th + label_h + gap)
    timeline_h = 70
    header_h = 34
    img = Image.new("RGB", (sheet_w, header_h + grid_h + timeline_h + margin), "white")
    draw = ImageDraw.Draw(img)
    duration = record.window_end_s - record.window_start_s
    draw.text((margin, 4), f"{record.sample_id}  {record.source_path}  {record.window_start_s:.2f}-"
                           f"{record.window_end_s:.2f} s  {record.num_frames} frames {record.width}x{record.height}  "
                           f"grid {record.grid_t}x{record.grid_h}x{record.grid_w}  {record.input_tokens} tokens",
              fill="black", font=font)
    draw.text((margin, 18), f"answer: {record.answer}", fill="black", font=font)
    for i, data in enumerate(jpegs):
        r, c = divmod(i, cols)
        x = margin + c * (tw + gap)
        y = header_h + r * (th + label_h + gap)
        with Image.open(io.BytesIO(data)) as frame:
            img.paste(frame.convert("RGB").resize((tw, th)), (x, y))
        t = record.frame_times_s[i] - record.window_start_s
        inside = any(s.start_s <= t < s.end_s for s in record.segments)
        draw.text((x, y + th + 1), f"{t:.1f}s #{record.frame_indices[i]}", fill="darkgreen" if inside else "black", font=font)

    top = header_h + grid_h + 10
    x0, x1 = margin, sheet_w - margin

    def px(t: float) -> float:
        return x0 + (x1 - x0) * (t / duration if duration > 0 else 0)

    draw.rectangle([x0, top + 10, x1, top + 30], fill=(225, 225, 225), outline="gray")
    for s in record.segments:
        draw.rectangle([px(s.start_s), top + 10, px(s.end_s), top + 30], fill=(60, 180, 75))
    for t in record.frame_times_s:
        x = px(t - record.window_start_s)
        draw.line([x, top + 30, x, top + 38], fill="black")
    for tick in range(int(duration) + 1):
        draw.text((px(tick) - 3, top + 42), str(tick), fill="gray", font=font)
    draw.text((x0, top - 4), "window timeline (s): answer segments green, ticks = frames", fill="gray", font=font)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    img.save(out, format="PNG")
    return out


def inspect_sample(path: str | Path, sample: str, out: str | Path | None = None) -> tuple[dict, Path | None]:
    """The sample's record (as a dict, plus prompt_tokens) and, when out is given, its contact sheet."""
    root = Path(path)
    record = find_record(root, sample)
    meta, jpegs = read_sample(root, record)
    png = contact_sheet(record, jpegs, out) if out is not None else None
    return {**dataclasses.asdict(record), "prompt_tokens": meta.prompt_tokens}, png


# ----------------------------------------------------------------------------------------------- CLI


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m prep inspect", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("shards", type=Path, help="output directory of `python -m prep build`")
    ap.add_argument("--sample", default=None, help="sample_id (e.g. myvideo/w0003) or WebDataset key to show")
    ap.add_argument("--out", type=Path, default=None,
                    help="contact sheet PNG for --sample (default: ./<key>.png)")
    ap.add_argument("--json", action="store_true", help="print the summary (or the sample record) as JSON only")
    return ap


def cli(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not (args.shards / "manifest.parquet").exists():
        print(f"prep inspect: error: {args.shards / 'manifest.parquet'} not found (not a `prep build` output)", file=sys.stderr)
        return 2
    if args.sample is None:
        if args.out is not None:
            parser().error("--out needs --sample")
        try:
            s = inspect_shards(args.shards)
        except SchemaError as e:
            print(f"prep inspect: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(s, sort_keys=True) if args.json else "\n".join(summary_lines(s)))
        return 0
    root = args.shards
    try:
        record = find_record(root, args.sample)
        meta, jpegs = read_sample(root, record)
    except KeyError as e:
        print(f"prep inspect: error: {e.args[0]}", file=sys.stderr)
        return 2
    except SchemaError as e:
        print(f"prep inspect: error: {e}", file=sys.stderr)
        return 2
    except ShardError as e:
        print(f"prep inspect: error: {e} (run `python -m prep verify {root}`)", file=sys.stderr)
        return 2
    out = args.out or Path(re.sub(r"[^A-Za-z0-9_.-]+", "_", record.key) + ".png")
    png = contact_sheet(record, jpegs, out)
    if args.json:
        print(json.dumps({**dataclasses.asdict(record), "prompt_tokens": meta.prompt_tokens, "contact_sheet": str(png)}))
    else:
        print("\n".join(sample_lines(record, meta)))
        print(f"contact sheet: {png}")
    return 0


main = cli

if __name__ == "__main__":
    sys.exit(cli())
