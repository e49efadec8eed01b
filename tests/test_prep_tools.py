"""`python -m prep inspect` and `python -m prep verify` over the session's real build (tests/conftest.py).

built_shards is shared and read-only: every test that damages a build works on a copy in tmp_path.
"""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from prep.inspect import inspect_shards, inspect_sample
from prep.verify import verify_shards
from schemas.manifest import SampleRecord, read_records

REPO = Path(__file__).resolve().parents[1]


def run_prep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prep", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def shards_copy(built_shards, tmp_path) -> Path:
    return Path(shutil.copytree(built_shards, tmp_path / "shards"))


def records(root: Path) -> list[SampleRecord]:
    return read_records(root / "manifest.parquet", SampleRecord)


def rewrite_tar(path: Path, drop: str) -> None:
    """Write the tar again without member `drop` (same order and headers otherwise)."""
    with tarfile.open(path, "r:") as src:
        members = [(info, src.extractfile(info).read()) for info in src if info.name != drop]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as dst:
        for info, data in members:
            dst.addfile(info, io.BytesIO(data))


# ----------------------------------------------------------------------------------------------- verify


def test_verify_passes_on_a_fresh_build(built_shards):
    result = run_prep("verify", built_shards, "--redecode", "12")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["problems"] == [] and report["skipped"] == []
    n = len(records(built_shards))
    assert (report["samples"], report["budget_checked"], report["tokens_checked"]) == (n, n, n)
    assert report["frames"] == sum(r.num_frames for r in records(built_shards))
    assert len(report["redecoded"]) == n and 0 < report["max_redecode_diff"] < 6.0


def test_verify_names_the_shard_whose_byte_flipped(shards_copy):
    victim = sorted(shards_copy.glob("shard-*.tar"))[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    result = run_prep("verify", shards_copy, "--redecode", "0")
    assert result.returncode == 1
    assert f"[shards] {victim.name}: content changed since the build" in result.stdout
    others = [p.name for p in shards_copy.glob("shard-*.tar") if p != victim]
    assert not any(name in result.stdout for name in others)


def test_verify_names_the_sample_whose_member_is_missing(shards_copy):
    rec = records(shards_copy)[4]
    rewrite_tar(shards_copy / rec.shard, drop=f"{rec.key}.f003.jpg")
    report = verify_shards(shards_copy, redecode=0)
    assert not report.ok
    missing = [p for p in report.problems if p.check == "members"]
    assert [(p.shard, p.sample_id) for p in missing] == [(rec.shard, rec.sample_id)]
    assert f"{rec.key}.f003.jpg is missing" in missing[0].detail
    assert {p.check for p in report.problems} == {"members", "shards"}  # and the tar's sha256 changed
    result = run_prep("verify", shards_copy, "--redecode", "0")
    assert result.returncode == 1 and rec.sample_id in result.stdout


def test_verify_rechecks_grids_against_the_budget(shards_copy):
    build = json.loads((shards_copy / "build.json").read_text())
    # built at 16-64 tokens/frame, which upsamples the 160x96 sources to 192x128; at a 4 token minimum the
    # plan keeps 160x96: every row must be flagged
    build["budget"]["video_min_tokens"] = 4
    (shards_copy / "build.json").write_text(json.dumps(build))
    report = verify_shards(shards_copy, redecode=0)
    flagged = {p.sample_id for p in report.problems if p.check == "budget"}
    assert flagged == {r.sample_id for r in records(shards_copy)}


def test_verify_redecode_catches_frames_from_another_video(shards_copy, synth_videos_dir, tmp_path):
    videos = Path(shutil.copytree(synth_videos_dir, tmp_path / "videos"))
    shutil.copyfile(videos / "vid_b.mp4", videos / "vid_a.mp4")  # same geometry and length, other pixels
    report = verify_shards(shards_copy, redecode=100, videos=videos)
    assert len(report.redecoded) == len(records(shards_copy))
    flagged = {p.sample_id for p in report.problems}
    assert {p.check for p in report.problems} == {"redecode"}
    assert flagged == {r.sample_id for r in records(shards_copy) if r.video_id == "vid_a"}


def test_verify_without_sources(shards_copy, tmp_path):
    missing = verify_shards(shards_copy, redecode=2, videos=tmp_path / "nowhere")
    assert {p.check for p in missing.problems} == {"source"} and len(missing.problems) == 4  # one per video
    skipped = verify_shards(shards_copy, redecode=2, videos=tmp_path / "nowhere", skip_source=True)
    # the budget is rechecked from the source facts the manifest records, so it needs no source
    n = len(records(shards_copy))
    assert skipped.ok and skipped.budget_checked == n and skipped.redecoded == [] and skipped.skipped


def test_verify_names_a_source_that_changed_since_the_build(shards_copy, synth_videos_dir, tmp_path):
    from scripts.synth_videos import VideoSpec, write_video

    videos = Path(shutil.copytree(synth_videos_dir, tmp_path / "videos"))
    write_video(VideoSpec(name="vid_b", duration_s=20.0, fps=10.0, width=160, height=96, seed=2), videos)
    report = verify_shards(shards_copy, redecode=0, videos=videos)
    (problem,) = report.problems
    assert problem.check == "source" and problem.sample_id.startswith("vid_b/")
    assert "changed since the build: fps 8.0 -> 10.0, frames 160 -> 200" in problem.detail


def test_verify_catches_a_manifest_row_that_disagrees_with_its_tar(shards_copy):
    table = pq.read_table(shards_copy / "manifest.parquet")
    rows = table.to_pylist()
    rows[0]["answer"] = "[[0.0, 1.0]]"
    pq.write_table(type(table).from_pylist(rows, schema=table.schema), shards_copy / "manifest.parquet")
    report = verify_shards(shards_copy, redecode=0)
    assert {(p.check, p.sample_id) for p in report.problems} == {("members", rows[0]["sample_id"]),
                                                                  ("sidecars", rows[0]["sample_id"]),
                                                                  ("tokens", rows[0]["sample_id"])}


# ----------------------------------------------------------------------------------------------- inspect


def test_inspect_prints_the_counts(built_shards):
    recs = records(built_shards)
    result = run_prep("inspect", built_shards)
    assert result.returncode == 0, result.stderr
    negatives = sum(1 for r in recs if not r.segments)
    assert f"{len(recs)} samples ({len(recs) - negatives} with segments, {negatives} negatives) from 4 videos" in result.stdout
    assert f"num_frames: total {sum(r.num_frames for r in recs)}" in result.stdout
    assert "num_frames per sample:" in result.stdout and "rejects: 0" in result.stdout
    built_with = json.loads((built_shards / "build.json").read_text())["decode"]["backend"]
    assert built_with in ("torchcodec", "decord")  # --decoder auto: torchcodec where it loads
    assert f"decoded by: h264 -> {built_with}" in result.stdout
    s = inspect_shards(built_shards)
    assert s["input_tokens"]["total"] == sum(r.input_tokens for r in recs)
    assert s["budget"]["video_max_tokens"] == 64
    assert sum(count for _, count in s["histograms"]["visual_tokens"]) == len(recs)


def test_inspect_sample_writes_a_contact_sheet(built_shards, tmp_path):
    rec = next(r for r in records(built_shards) if r.segments)
    out = tmp_path / "sheet.png"
    result = run_prep("inspect", built_shards, "--sample", rec.sample_id, "--out", out)
    assert result.returncode == 0, result.stderr
    assert f"answer: {rec.answer}" in result.stdout and f"grid_h: {rec.grid_h}" in result.stdout
    with Image.open(out) as img:
        assert img.format == "PNG" and img.width > 8 * 100 and img.height > rec.height
    meta, png = inspect_sample(built_shards, rec.key, tmp_path / "by_key.png")
    assert meta["sample_id"] == rec.sample_id and png.is_file()
    assert run_prep("inspect", built_shards, "--sample", "no_such/w9999").returncode == 2
