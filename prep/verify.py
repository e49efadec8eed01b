"""`python -m prep verify SHARDS`: recheck a build from its files, independently of the code that wrote it.

Checks, each problem naming its shard and sample:
  shards    every tar of build.json exists and has the recorded sha256 and size; no unlisted tars
  sidecars  every shard's samples/rejects parquet exists with the recorded sha256 and size and holds, row
            for row, what manifest.parquet / rejects.parquet hold for that shard (each sample is named)
  members   every manifest row reads back through schemas.shard.ShardReader (the trainer's reader):
            `<key>.json` equal to the row, every frame's sha256 as recorded, no stray member; every frame
            a JPEG of (width, height); no tar member belongs to no row
  record    the row agrees with itself and with its input_ids (SampleRecord.problems, the rule the trainer
            and predict apply too)
  tokens    input_ids equal a fresh tokenize_sample() with the build's tokenizer and prompt layout
  budget    frame indices, times, size and grid equal prep.budget.plan_frames() for the source facts the
            manifest records (fps, frames, size)
  source    the sources as probed now still have those facts (skipped with --skip-source)
  redecode  for a seeded random subset, the stored JPEGs match the source frames decoded in one batch by the
            codec's reference decoder (decord; PyAV where decord's seeks are off) and resized like the build
            (mean absolute difference under a JPEG-noise threshold)
Problems are data (listed, exit 1); a bug in this module crashes.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from PIL import Image

from prep.budget import SPATIAL_MERGE, FramePlan, VideoBudget, group_times, plan_frames
from prep.decoders import REFERENCE_BACKEND, DecodeError, backend_for, open_reader
from schemas.build import BuildRecord, ShardFile
from schemas.manifest import RejectRecord, SampleRecord, read_records
from schemas.shard import ShardError, ShardReader, ShardSample

# Mean absolute difference (0-255 levels) between a stored JPEG and the source frame resized the same way.
# JPEG at quality 95 leaves ~1 level on natural frames and ~3.4 at worst on the synthetic test videos'
# random textures; the neighbouring source frame there (a wrong index) gives 12-22 on most frames. Builds
# with a low --jpeg-quality need a higher threshold (--max-diff).
DEFAULT_MAX_DIFF = 6.0
TIME_TOL = 1e-6
SOURCE_FACTS = ("fps", "frames", "width", "height", "codec", "rotation")  # ProbeResult field = SampleRecord.source_<field>


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    """One thing wrong with a build."""

    check: str  # shards, sidecars, members, record, tokens, budget, source, redecode, build
    shard: str  # tar name ("" when not about one shard)
    sample_id: str  # sample ("" when about a whole shard or the build)
    detail: str  # sentence with the numbers involved

    def __str__(self) -> str:
        where = " ".join(x for x in (self.shard, self.sample_id) if x) or "build"
        return f"[{self.check}] {where}: {self.detail}"


@dataclasses.dataclass(kw_only=True)
class VerifyReport:
    """What verify looked at and what it found; ok means no problem."""

    shards: int = 0  # tars checked
    samples: int = 0  # manifest rows
    frames: int = 0  # JPEG members checked for size
    budget_checked: int = 0  # rows whose plan was recomputed from the recorded source facts
    tokens_checked: int = 0  # rows re-tokenized
    redecoded: list[str] = dataclasses.field(default_factory=list)  # sample ids compared with the source
    max_redecode_diff: float = 0.0  # largest per-frame mean abs difference seen
    skipped: list[str] = dataclasses.field(default_factory=list)  # checks not run, and why
    problems: list[Problem] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["problems"] = [str(p) for p in self.problems]
        d["ok"] = self.ok
        return d


# ----------------------------------------------------------------------------------------------- checks


def _shard_files(root: Path, build: BuildRecord, report: VerifyReport) -> set[str]:
    """sha256/size of every listed tar; returns the names of the tars that are intact."""
    from prep.shards import sha256_file

    listed = {s.name: s for s in build.shard_files}
    intact = set()
    for name, entry in sorted(listed.items()):
        path = root / name
        if not path.is_file():
            report.problems.append(Problem(check="shards", shard=name, sample_id="", detail=f"{path} is missing"))
            continue
        report.shards += 1
        size, sha = path.stat().st_size, sha256_file(path)
        if size != entry.bytes or sha != entry.sha256:
            report.problems.append(Problem(
                check="shards", shard=name, sample_id="",
                detail=f"content changed since the build: sha256 {sha[:16]}... ({size} bytes), build.json "
                       f"recorded {entry.sha256[:16]}... ({entry.bytes} bytes)"))
        else:
            intact.add(name)
    for path in sorted(root.glob("shard-*.tar")):
        if path.name not in listed:
            report.problems.append(Problem(check="shards", shard=path.name, sample_id="",
                                           detail="tar is not listed in build.json (left from another build?)"))
    return intact


def _check_sidecars(root: Path, listed: dict[str, ShardFile], by_shard: dict[str, list[SampleRecord]],
                    rejects: list[RejectRecord], report: VerifyReport) -> dict[tuple[str, str], str]:
    """Each shard's sidecars against build.json (sha256, size) and against the assembled tables, row by row;
    returns (shard, key) -> sample_id of every sidecar row, so tar members can be named by their sample."""
    from prep.shards import sha256_file

    ids: dict[tuple[str, str], str] = {}
    assembled_rejects = Counter(dataclasses.astuple(r) for r in rejects)

    def bad(shard: str, sample_id: str, detail: str) -> None:
        report.problems.append(Problem(check="sidecars", shard=shard, sample_id=sample_id, detail=detail))

    for name, entry in sorted(listed.items()):
        for kind, cls in (("samples", SampleRecord), ("rejects", RejectRecord)):
            side = entry.sidecars[kind]
            path = root / side.name
            if not path.is_file():
                bad(name, "", f"{side.name} is missing (a rerun of the same build rebuilds this shard)")
                continue
            size, sha = path.stat().st_size, sha256_file(path)
            if (size, sha) != (side.bytes, side.sha256):
                bad(name, "", f"{side.name} changed since the build: sha256 {sha[:16]}... ({size} bytes), "
                              f"build.json recorded {side.sha256[:16]}... ({side.bytes} bytes)")
            try:
                rows = read_records(path, cls)
            except (OSError, ValueError) as e:
                bad(name, "", f"{side.name} cannot be read: {e}")
                continue
            if kind == "rejects":
                for r in rows:
                    if assembled_rejects[dataclasses.astuple(r)] == 0:
                        bad(name, r.video_id, f"reject {r.stage}/{r.reason} of {side.name} is not in rejects.parquet")
                continue
            mine = {r.sample_id: r for r in rows}
            ids.update({(name, r.key): r.sample_id for r in rows})
            manifest = {r.sample_id: r for r in by_shard.get(name, [])}
            for sid in sorted(mine.keys() - manifest.keys()):
                bad(name, sid, f"in {side.name} but not in manifest.parquet (lost from the manifest)")
            for sid in sorted(manifest.keys() - mine.keys()):
                bad(name, sid, f"in manifest.parquet but not in {side.name}")
            for sid in sorted(mine.keys() & manifest.keys()):
                a, b = dataclasses.asdict(mine[sid]), dataclasses.asdict(manifest[sid])
                if a != b:
                    bad(name, sid, f"{side.name} and manifest.parquet disagree on {[k for k in a if a[k] != b[k]]}")
    return ids


def _check_members(rec: SampleRecord, reader: ShardReader, report: VerifyReport) -> tuple[ShardSample | None, list]:
    """The sample through the trainer's reader, every problem kept; plus each frame's image format and size.
    Returns the parsed JSON (None when unreadable) and the frames' bytes (None where damaged or missing)."""
    got = reader.check(rec)
    for e in got.errors:
        report.problems.append(Problem(check="members", shard=rec.shard, sample_id=rec.sample_id,
                                       detail=str(e).removeprefix(f"sample {rec.sample_id}: ")))
    for i, data in enumerate(got.frames):
        if data is None:
            continue
        try:
            with Image.open(io.BytesIO(data)) as img:
                image = (img.format, *img.size)
        except (OSError, ValueError) as e:
            report.problems.append(Problem(check="members", shard=rec.shard, sample_id=rec.sample_id,
                                           detail=f"frame {i} of {rec.key} is not an image: {e}"))
            continue
        report.frames += 1
        if image != ("JPEG", rec.width, rec.height):
            report.problems.append(Problem(
                check="members", shard=rec.shard, sample_id=rec.sample_id,
                detail=f"frame {i} of {rec.key} is {image[0]} {image[1]}x{image[2]}, the record says JPEG {rec.width}x{rec.height}"))
    return got.sample, got.frames


def _check_record(rec: SampleRecord, meta: ShardSample | None, budget: VideoBudget, pad_id: int | None,
                  max_input_tokens: int | None, report: VerifyReport) -> None:
    """The row against itself and its own input_ids: the same rule the trainer's pre-flight applies."""
    for detail in rec.problems(patch_size=budget.patch_size, merge_size=SPATIAL_MERGE, max_input_tokens=max_input_tokens,
                               input_ids=meta.input_ids if meta else None,
                               prompt_tokens=meta.prompt_tokens if meta else None, video_token_id=pad_id):
        report.problems.append(Problem(check="record", shard=rec.shard, sample_id=rec.sample_id, detail=detail))


def _expected_plan(rec: SampleRecord, budget: VideoBudget, max_input_tokens: int | None) -> FramePlan:
    """The plan the build should have made; a lower frame count is legal only under --max-input-tokens."""
    kw = dict(height=rec.source_height, width=rec.source_width, fps=rec.source_fps, total_frames=rec.source_frames,
              start_s=rec.window_start_s, end_s=rec.window_end_s)
    full = plan_frames(budget, **kw)
    if max_input_tokens is not None and rec.num_frames < len(full.frame_indices):
        return plan_frames(budget, **kw, max_frames=rec.num_frames)
    return full


def _check_budget(rec: SampleRecord, budget: VideoBudget, max_input_tokens: int | None, report: VerifyReport) -> None:
    def bad(detail: str) -> None:
        report.problems.append(Problem(check="budget", shard=rec.shard, sample_id=rec.sample_id, detail=detail))

    try:
        plan = _expected_plan(rec, budget, max_input_tokens)
    except ValueError as e:
        bad(f"prep.budget refuses this window of the recorded source: {e}")
        return
    report.budget_checked += 1
    if rec.frame_indices != plan.frame_indices:
        bad(f"frame_indices {_short(rec.frame_indices)} != planned {_short(plan.frame_indices)} "
            f"({rec.source_frames} frames at {rec.source_fps:.3f} fps, window {rec.window_start_s}-{rec.window_end_s} s)")
    got = (rec.height, rec.width, rec.grid_t, rec.grid_h, rec.grid_w)
    want = (plan.height, plan.width, plan.grid_t, plan.grid_h, plan.grid_w)
    if got != want:
        bad(f"(height, width, grid_t, grid_h, grid_w) {got} != planned {want} for a "
            f"{rec.source_width}x{rec.source_height} source")
    times = [i / rec.source_fps for i in rec.frame_indices]
    if not _close(rec.frame_times_s, times):
        bad(f"frame_times_s {_short(rec.frame_times_s)} != frame_indices / {rec.source_fps:.3f} fps {_short(times)}")
    elif not _close(rec.group_times_s, group_times(times, rec.window_start_s)):
        bad(f"group_times_s {_short(rec.group_times_s)} != {_short(group_times(times, rec.window_start_s))}")


def _redecode(rec: SampleRecord, source: Path, frames: list[bytes], max_diff: float, report: VerifyReport) -> None:
    """The sample's frames decoded again in one batch (not the build's windowed decoder) by the reference
    decoder of its codec (decord, or PyAV for the codecs decord's seeks get wrong: prep/decoders.py backend_for)
    + PIL bicubic, vs the stored JPEGs."""
    backend = backend_for(REFERENCE_BACKEND, rec.source_codec)
    try:
        reader = open_reader(backend, str(source), rotation=rec.source_rotation)
        try:
            decoded = reader.get_batch(rec.frame_indices)
        finally:
            reader.close()
    except DecodeError as e:
        report.problems.append(Problem(check="redecode", shard=rec.shard, sample_id=rec.sample_id,
                                       detail=f"{backend} cannot decode frames {_short(rec.frame_indices)} of {source}: {e}"))
        return
    diffs = []
    for i, frame in enumerate(decoded):
        img = Image.fromarray(frame)
        if img.size != (rec.width, rec.height):
            img = img.resize((rec.width, rec.height), Image.Resampling.BICUBIC)
        with Image.open(io.BytesIO(frames[i])) as stored:
            diffs.append(float(np.abs(np.asarray(stored.convert("RGB"), np.int16) - np.asarray(img, np.int16)).mean()))
    report.redecoded.append(rec.sample_id)
    report.max_redecode_diff = max(report.max_redecode_diff, *diffs)
    worst = int(np.argmax(diffs))
    if diffs[worst] > max_diff:
        report.problems.append(Problem(
            check="redecode", shard=rec.shard, sample_id=rec.sample_id,
            detail=f"stored frame {worst} (source frame {rec.frame_indices[worst]}) differs from the source by "
                   f"{diffs[worst]:.2f} levels on average (threshold {max_diff}); "
                   f"{sum(d > max_diff for d in diffs)} of {len(diffs)} frames over it"))


def _short(xs: list) -> str:
    xs = [round(x, 3) if isinstance(x, float) else x for x in xs]
    return str(xs) if len(xs) <= 6 else f"[{', '.join(map(str, xs[:3]))}, ..., {', '.join(map(str, xs[-2:]))}] ({len(xs)})"


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=0, abs_tol=TIME_TOL) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------- driver


def verify_shards(
    path: str | Path,
    *,
    redecode: int = 4,
    seed: int = 0,
    videos: str | Path | None = None,
    skip_source: bool = False,
    max_diff: float = DEFAULT_MAX_DIFF,
    progress: bool = False,
) -> VerifyReport:
    """Run every check over the build in `path`. videos: where the sources are now (default: the build's
    --videos); skip_source: do without them (no source recheck, no re-decode; said in report.skipped);
    progress: a bar over the samples on stderr (only when it is a terminal)."""
    from tqdm import tqdm

    root = Path(path)
    report = VerifyReport()
    try:
        build = BuildRecord.read(root)
        records = read_records(root / "manifest.parquet", SampleRecord)
        rejects = read_records(root / "rejects.parquet", RejectRecord)
    except (OSError, ValueError) as e:
        report.problems.append(Problem(check="build", shard="", sample_id="", detail=f"cannot read the build: {e}"))
        return report
    report.samples = len(records)
    budget = VideoBudget(**build.budget)
    max_input_tokens = build.max_input_tokens.tokens  # the bound the build applied (the model's maximum by default)
    layouts = {r.prompt_layout for r in records}
    if layouts - {build.prompt.layout}:
        report.problems.append(Problem(check="build", shard="", sample_id="",
                                       detail=f"build.json records prompt layout {build.prompt.layout}, the manifest "
                                              f"{sorted(layouts)}"))

    intact = _shard_files(root, build, report)
    listed = {s.name: s for s in build.shard_files}
    by_shard: dict[str, list[SampleRecord]] = defaultdict(list)
    for rec in records:
        by_shard[rec.shard].append(rec)
    sidecar_ids = _check_sidecars(root, listed, by_shard, rejects, report)
    for name, entry in listed.items():
        if len(by_shard.get(name, [])) != entry.samples:
            report.problems.append(Problem(check="shards", shard=name, sample_id="",
                                           detail=f"manifest has {len(by_shard.get(name, []))} rows for this shard, "
                                                  f"build.json says {entry.samples} samples"))

    video_root = Path(videos) if videos is not None else Path(build.config.get("videos", "."))
    if skip_source:
        report.skipped.append("source recheck and re-decode: --skip-source")
        sources_ok: set[str] = set()
    else:
        sources_ok = _check_sources(video_root, records, report)
    candidates = sorted(r.sample_id for r in records if r.source_path in sources_ok)
    chosen = set(random.Random(seed).sample(candidates, min(redecode, len(candidates))))

    tokenizer = _tokenizer(build, report)
    pad_id = build.tokenizer.special_token_ids.get("<|video_pad|>")
    reader = ShardReader(root)
    to_redecode: list[tuple[SampleRecord, list[bytes]]] = []
    bar = tqdm(total=len(records) + len(chosen), unit="sample", desc="prep verify", disable=None if progress else True,
               dynamic_ncols=True)
    for name in sorted(by_shard):
        bar.update(len(by_shard[name]))
        rows = by_shard[name]
        if name not in listed:
            for rec in rows:
                report.problems.append(Problem(check="members", shard=name, sample_id=rec.sample_id,
                                               detail="the manifest names a shard build.json does not list"))
            continue
        try:
            member_names = reader.index(name)
        except ShardError as e:
            report.problems.append(Problem(check="members", shard=name, sample_id="",
                                           detail=f"{e}; its {len(rows)} samples are unchecked"))
            continue
        keys = {r.key for r in rows}
        for key in sorted({m.split(".", 1)[0] for m in member_names} - keys):
            report.problems.append(Problem(check="members", shard=name, sample_id=sidecar_ids.get((name, key), ""),
                                           detail=f"members {key}.* belong to no manifest row"))
        for rec in rows:
            meta, frames = _check_members(rec, reader, report)
            _check_record(rec, meta, budget, pad_id, max_input_tokens, report)
            if tokenizer is not None and meta is not None:
                _check_tokens(rec, meta, tokenizer, report)
            if rec.sample_id in chosen and name in intact and all(f is not None for f in frames):
                to_redecode.append((rec, frames))

    for rec in records:
        _check_budget(rec, budget, max_input_tokens, report)
    bar.total = len(records) + len(to_redecode)  # a chosen sample with missing frames is not re-decoded
    for rec, frames in to_redecode:
        _redecode(rec, video_root / rec.source_path, frames, max_diff, report)
        bar.update(1)
    bar.close()
    return report


def _tokenizer(build: BuildRecord, report: VerifyReport):
    """The build's tokenizer when it is still the same file (sha256), else None with a skip note."""
    import hashlib

    from schemas.prompt import BUNDLED_TOKENIZER, load_tokenizer

    info = build.tokenizer
    path = Path(info.path or BUNDLED_TOKENIZER)
    tj = path / "tokenizer.json"
    if not tj.is_file():
        report.skipped.append(f"re-tokenization: {tj} is gone")
        return None
    if hashlib.sha256(tj.read_bytes()).hexdigest() != info.tokenizer_json_sha256:
        report.skipped.append(f"re-tokenization: {tj} changed since the build (sha256 differs)")
        return None
    return load_tokenizer(None if info.bundled else str(path))


def _check_tokens(rec: SampleRecord, meta: ShardSample, tokenizer, report: VerifyReport) -> None:
    from schemas.prompt import tokenize_sample

    try:
        tok = tokenize_sample(tokenizer, query=rec.query, answer=rec.answer, group_times_s=rec.group_times_s,
                              tokens_per_group=rec.grid_h * rec.grid_w // SPATIAL_MERGE**2, layout=rec.prompt_layout)
    except ValueError as e:
        report.problems.append(Problem(check="tokens", shard=rec.shard, sample_id=rec.sample_id, detail=str(e)))
        return
    report.tokens_checked += 1
    if tok.input_ids != meta.input_ids or tok.prompt_tokens != meta.prompt_tokens:
        first = next((i for i, (a, b) in enumerate(zip(tok.input_ids, meta.input_ids)) if a != b),
                     min(len(tok.input_ids), len(meta.input_ids)))
        report.problems.append(Problem(
            check="tokens", shard=rec.shard, sample_id=rec.sample_id,
            detail=f"stored input_ids ({len(meta.input_ids)}, prompt {meta.prompt_tokens}) differ from a fresh "
                   f"tokenization ({len(tok.input_ids)}, prompt {tok.prompt_tokens}) from position {first}"))


def _check_sources(video_root: Path, records: list[SampleRecord], report: VerifyReport) -> set[str]:
    """Probe each source once; it must still have the facts its rows record. Returns the sources that do."""
    from prep.probe import ProbeFailure, probe_video

    ok = set()
    for source in sorted({r.source_path for r in records}):
        path = video_root / source
        rows = [r for r in records if r.source_path == source]
        got = probe_video(path) if path.is_file() else None
        if got is None or isinstance(got, ProbeFailure):
            why = f"{path} is missing" if got is None else f"probe fails now: {got.reason}: {got.detail}"
            report.problems.append(Problem(
                check="source", shard=rows[0].shard, sample_id=rows[0].sample_id,
                detail=f"{why}; re-decode impossible for its {len(rows)} samples (pass --videos DIR, or --skip-source)"))
            continue
        now = {k: getattr(got, k) for k in SOURCE_FACTS}
        changed = sorted({k for r in rows for k in SOURCE_FACTS if getattr(r, f"source_{k}") != now[k]})
        if changed:
            r = rows[0]
            what = ", ".join(f"{k} {getattr(r, 'source_' + k)} -> {now[k]}" for k in changed)
            report.problems.append(Problem(check="source", shard=r.shard, sample_id=r.sample_id,
                                           detail=f"{path} changed since the build: {what}"))
            continue
        ok.add(source)
    return ok


# ----------------------------------------------------------------------------------------------- CLI


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m prep verify", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("shards", type=Path, help="output directory of `python -m prep build`")
    ap.add_argument("--redecode", type=int, default=4, help="samples re-decoded from their source and compared")
    ap.add_argument("--seed", type=int, default=0, help="seed choosing the re-decoded samples")
    ap.add_argument("--videos", type=Path, default=None, help="where the source videos are now (default: the build's --videos)")
    ap.add_argument("--skip-source", action="store_true", help="no source recheck or re-decode (sources not available; the budget is rechecked from the recorded source facts)")
    ap.add_argument("--max-diff", type=float, default=DEFAULT_MAX_DIFF,
                    help="re-decode threshold: mean absolute difference per frame, 0-255 levels")
    ap.add_argument("--json", action="store_true", help="print only the JSON report")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar (stderr, terminals only)")
    return ap


def cli(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.redecode < 0:
        parser().error("--redecode must be >= 0")
    report = verify_shards(args.shards, redecode=args.redecode, seed=args.seed, videos=args.videos,
                           skip_source=args.skip_source, max_diff=args.max_diff, progress=args.progress)
    if not args.json:
        print(f"prep verify {args.shards}: {report.shards} shards, {report.samples} samples, {report.frames} frames, "
              f"{report.budget_checked} budget rechecks, {report.tokens_checked} re-tokenized, "
              f"{len(report.redecoded)} re-decoded (max mean abs diff {report.max_redecode_diff:.2f})")
        for s in report.skipped:
            print(f"  skipped: {s}")
        for p in report.problems:
            print(f"  {p}")
        print(f"prep verify: {'OK' if report.ok else f'FAILED with {len(report.problems)} problems'}")
    print(json.dumps({"event": "prep_verify_done", **report.to_json()}, sort_keys=True))
    return 0 if report.ok else 1


main = cli

if __name__ == "__main__":
    sys.exit(cli())
