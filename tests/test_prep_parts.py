"""How a build is cut into work: `prep build --part K/N` (one machine each, e.g. a Slurm array) then
`--assemble` give the same build as one run; a long video spans several shards with the same samples.

Parts share the build lock (shared flock) and each holds its own part lock; a whole build waits for none of
them and is refused while one runs; --assemble refuses while a shard is missing, naming it.
"""
from __future__ import annotations

import json

import pytest

from prep.build import BuildConfig, BuildError, build, cli
from prep.outdir import LOCK_FILE, PLAN_FILE, BuildLock, BuildLocked, part_lock_name
from schemas.build import BuildRecord
from schemas.manifest import SampleRecord, read_records
from conftest import BUILT_SHARDS_ARGS


def cli_args(videos, out, *extra) -> list[str]:
    a = BUILT_SHARDS_ARGS
    return ["--videos", str(videos), "--out", str(out), "--window-seconds", str(a["window_seconds"]),
            "--video-min-tokens", str(a["video_min_tokens"]), "--video-max-tokens", str(a["video_max_tokens"]),
            "--samples-per-shard", str(a["samples_per_shard"]), "--workers", "1", "--no-progress", *extra]


def test_parts_then_assemble_give_the_one_run_build_and_locks_keep_them_apart(synth_videos_dir, built_shards,
                                                                              tmp_path, capsys):
    out = tmp_path / "out"
    # part 2 runs while another process holds part 1's locks (shared build lock + its part lock)
    out.mkdir()
    with BuildLock(out, shared=True), BuildLock(out, name=part_lock_name(1, 2)):
        assert cli(cli_args(synth_videos_dir, out, "--part", "2/2")) == 0
        line = capsys.readouterr().out.splitlines()[0]
        assert line.startswith("prep build --part 2/2: 1 of the build's 2 shards (1 built, 0 already complete)"), line
        with pytest.raises(BuildLocked, match=r"part-1-of-2\.lock"):  # the same part twice
            build(BuildConfig(videos=synth_videos_dir, out=out, part="1/2", **BUILT_SHARDS_ARGS))
        with pytest.raises(BuildLocked, match=LOCK_FILE):  # a whole build while a part runs
            build(BuildConfig(videos=synth_videos_dir, out=out, **BUILT_SHARDS_ARGS))
    assert not (out / "manifest.parquet").exists() and (out / "shard-000001.tar").is_file()
    assert not (out / "shard-000000.tar").exists()
    with pytest.raises(BuildError, match=r"--assemble: 1 of 2 shards are not complete: shard-000000 \(not built\)"):
        build(BuildConfig(videos=synth_videos_dir, out=out, assemble=True, **BUILT_SHARDS_ARGS))
    # a part whose machine decodes with another backend (`--decoder auto` resolves per machine) is refused
    built_with = BuildRecord.read(built_shards).decode.backend  # the default, as part 2's
    other = "pyav" if built_with != "pyav" else "decord"
    with pytest.raises(BuildError, match=rf"different config: it was decoded with {built_with}, this run decodes with "
                                         rf"{other} \(pass --decoder {built_with}\); empty it and run every part again"):
        build(BuildConfig(videos=synth_videos_dir, out=out, part="1/2", decoder=other, **BUILT_SHARDS_ARGS))
    summary = build(BuildConfig(videos=synth_videos_dir, out=out, part="1/2", **BUILT_SHARDS_ARGS))
    assert (summary["shards"], summary["shards_built"], summary["samples"]) == (1, 1, 6)
    summary = build(BuildConfig(videos=synth_videos_dir, out=out, assemble=True, **BUILT_SHARDS_ARGS))
    assert (summary["shards_built"], summary["shards_skipped"], summary["samples"]) == (0, 2, 12)
    ref, got = BuildRecord.read(built_shards), BuildRecord.read(out)
    assert [(s.name, s.sha256) for s in got.shard_files] == [(s.name, s.sha256) for s in ref.shard_files]
    assert read_records(out / "manifest.parquet", SampleRecord) == read_records(built_shards / "manifest.parquet",
                                                                               SampleRecord)
    assert got.config["part"] is None and got.config["assemble"] is True


def test_part_flags_are_checked_up_front(synth_videos_dir, tmp_path):
    for kw, text in ((dict(part="3/2"), "--part must be K/N"), (dict(part="1/2", overwrite=True), "cannot --overwrite"),
                     (dict(part="1/2", assemble=True), "--assemble takes no --part")):
        with pytest.raises(BuildError, match=text):
            build(BuildConfig(videos=synth_videos_dir, out=tmp_path / "out", **{**BUILT_SHARDS_ARGS, **kw}))


def test_a_long_video_spans_several_shards_with_the_same_samples(synth_videos_dir, tmp_path):
    """4 s windows: 5 per video. One shard per video (samples_per_shard 5) vs pieces of <= 2 windows (3 shards
    per video, each decoded from its own seek): the same samples, the same frame bytes."""
    args = {**BUILT_SHARDS_ARGS, "window_seconds": 4.0, "workers": 2}
    whole = build(BuildConfig(videos=synth_videos_dir, out=tmp_path / "whole", **{**args, "samples_per_shard": 5}))
    split = build(BuildConfig(videos=synth_videos_dir, out=tmp_path / "split", **{**args, "samples_per_shard": 2}))
    assert (whole["shards"], split["shards"], whole["samples"], split["samples"]) == (4, 12, 20, 20)
    a = {r.sample_id: r for r in read_records(tmp_path / "whole" / "manifest.parquet", SampleRecord)}
    b = {r.sample_id: r for r in read_records(tmp_path / "split" / "manifest.parquet", SampleRecord)}
    assert a.keys() == b.keys()
    for sid, r in a.items():
        assert (r.frame_indices, r.frame_sha256, r.input_ids_sha256) == (
            b[sid].frame_indices, b[sid].frame_sha256, b[sid].input_ids_sha256), sid
    plan = json.loads((tmp_path / "split" / PLAN_FILE).read_text())["shards"]
    assert plan["shard-000000"] == ["vid_a@w0-1"] and plan["shard-000001"] == ["vid_a@w2-2"]
    # the source seconds of a split video are counted once over its pieces
    stats = [json.loads(p.read_text()) for p in (tmp_path / "split").glob("*.stats.json")]
    assert abs(sum(s["source_s"] for s in stats) - 80.0) < 0.5


def test_build_progress_counts_each_work_unit_once_when_a_shard_is_rerun():
    """After a stall the shard is rebuilt: its units report again, and the bar must not pass its total."""
    from prep.build import BuildProgress

    class Bar:
        n, postfix = 0, ""

        def update(self, k):
            self.n += k

        def set_postfix_str(self, text, refresh):
            self.postfix = text

    bar = Bar()
    progress = BuildProgress(bar)
    first_try = [(("a",), 1, 4, 30.0), (("b", "b2"), 2, 6, 60.0)]
    for item in first_try + first_try + [(("c@w0-3",), 1, 4, 20.0)]:  # the rerun reports a and b again
        progress(item)
    assert bar.n == 4 and (progress.windows, progress.source_s) == (14, 110.0)
    assert "windows/s" in bar.postfix and "x realtime" in bar.postfix
