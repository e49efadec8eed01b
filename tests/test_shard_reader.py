"""schemas.shard.ShardReader, the one tar reader: digests checked at read time, damage named by shard, member and
sample, and the tars stay plain WebDataset tars. Also: shards of an older schema or another prompt layout are
refused by train and predict with the command that rebuilds them."""
from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from schemas.build import BuildRecord, rebuild_command
from schemas.manifest import SampleRecord, SchemaError, read_records
from schemas.shard import ShardError, ShardReader, ShardSample, frame_ext, ids_sha256
from tests.train_helpers import REPO, train_env

V2_COLUMNS = ("source_fps", "source_frames", "source_width", "source_height", "source_codec", "source_rotation",
              "prompt_layout", "frame_sha256", "input_ids_sha256")


@pytest.fixture
def shards_copy(built_shards, tmp_path) -> Path:
    return Path(shutil.copytree(built_shards, tmp_path / "shards"))


def records(root: Path) -> list[SampleRecord]:
    return read_records(root / "manifest.parquet", SampleRecord)


def test_every_sample_reads_back_with_webdataset_too(built_shards):
    """Our offset reader and webdataset's streaming reader see the same bytes for every sample."""
    import webdataset as wds

    recs = records(built_shards)
    ours = ShardReader(built_shards)
    seen = {}
    urls = sorted(str(p) for p in built_shards.glob("shard-*.tar"))
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        seen[sample["__key__"]] = sample
    assert sorted(seen) == sorted(r.key for r in recs)
    for r in recs:
        meta, jpegs = ours.read(r)
        theirs = seen[r.key]
        assert ShardSample.from_json(json.loads(theirs["json"])) == meta and meta.record == r
        assert [theirs[frame_ext(i)] for i in range(r.num_frames)] == jpegs
        assert [hashlib.sha256(b).hexdigest() for b in jpegs] == r.frame_sha256
        assert ids_sha256(meta.input_ids) == r.input_ids_sha256


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_jpeg_byte_fails_before_decoding_naming_shard_member_and_sample(shards_copy):
    from prep.verify import verify_shards
    from train.data import SampleError, SampleStore

    rec = records(shards_copy)[3]
    member = f"{rec.key}.{frame_ext(2)}"
    offset, size = ShardReader(shards_copy).index(rec.shard)[member]
    _flip(shards_copy / rec.shard, offset + size // 2)  # inside the entropy-coded data: PIL may still decode it
    with pytest.raises(SampleError) as e:
        SampleStore(shards_copy).get(rec.sample_id)
    assert (e.value.shard, e.value.member, e.value.sample_id) == (rec.shard, member, rec.sample_id)
    assert f"sample {rec.sample_id}: {rec.shard}:{member} differs from the bytes written at build time" in str(e.value)
    others = [r for r in records(shards_copy) if r.sample_id != rec.sample_id]
    assert all(SampleStore(shards_copy).get(r.sample_id) for r in others)  # nothing else is affected
    report = verify_shards(shards_copy, redecode=0, skip_source=True)
    assert {(p.check, p.sample_id) for p in report.problems if p.check == "members"} == {("members", rec.sample_id)}


def test_flipped_input_ids_are_caught_by_their_digest(shards_copy):
    rec = records(shards_copy)[0]
    offset, size = ShardReader(shards_copy).index(rec.shard)[f"{rec.key}.json"]
    raw = (shards_copy / rec.shard).read_bytes()[offset: offset + size]
    at = raw.index(b'"input_ids":[') + len(b'"input_ids":[') + 1  # a digit inside the first id (JSON stays valid)
    data = bytearray((shards_copy / rec.shard).read_bytes())
    data[offset + at] = ord("7") if data[offset + at] != ord("7") else ord("3")
    (shards_copy / rec.shard).write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"{rec.key}\.json holds input_ids whose sha256 differs"):
        ShardReader(shards_copy).read(rec)


def test_a_truncated_tar_names_shard_member_and_sample(shards_copy):
    recs = [r for r in records(shards_copy) if r.shard == "shard-000001.tar"]
    path = shards_copy / "shard-000001.tar"
    index = ShardReader(shards_copy).index(path.name)
    cut_rec = recs[len(recs) // 2]
    cut_member = f"{cut_rec.key}.{frame_ext(1)}"
    offset, size = index[cut_member]
    path.write_bytes(path.read_bytes()[: offset + size // 2])  # cut in the middle of that frame
    reader = ShardReader(shards_copy)
    with pytest.raises(ShardError) as e:
        reader.read(cut_rec)
    assert (e.value.shard, e.value.member, e.value.sample_id) == (path.name, cut_member, cut_rec.sample_id)
    assert "is truncated" in str(e.value)
    after = recs[-1]
    with pytest.raises(ShardError, match=rf"sample {after.sample_id}: member {after.key}\.json is missing from shard "
                                         rf"shard-000001\.tar; the shard file ends at byte \d+, inside member "
                                         rf"{cut_member} \(truncated\)"):
        reader.read(after)
    assert reader.read(recs[0])  # samples before the cut still read
    path.write_bytes(b"not a tar at all" * 64)
    with pytest.raises(ShardError, match=rf"sample {recs[0].sample_id}: shard .*shard-000001\.tar is not a readable tar"):
        ShardReader(shards_copy).read(recs[0])


# ------------------------------------------------------------------------------ older schema, other layout


def make_v1(root: Path) -> None:
    """Turn a build into what the previous package version wrote: manifest without the v2 columns (schema
    version 1 in its metadata), build.json with its untyped top-level summary."""
    table = pq.read_table(root / "manifest.parquet")
    table = table.drop_columns(list(V2_COLUMNS))
    meta = {**table.schema.metadata, b"video_ora.schema_version": b"1"}
    pq.write_table(table.replace_schema_metadata(meta), root / "manifest.parquet")
    build = json.loads((root / "build.json").read_text())
    old = {**build.pop("summary"), **build, "schema_version": "1"}
    (root / "build.json").write_text(json.dumps(old))


def test_rebuild_command_reproduces_the_recorded_config(built_shards, tmp_path):
    cmd = rebuild_command(built_shards)
    config = BuildRecord.read(built_shards).config
    assert cmd.startswith(f"python -m prep build --videos {config['videos']} --out {built_shards} ")
    assert cmd.endswith(" --overwrite") and "--window-seconds 8.0" in cmd and "--video-max-tokens 64" in cmd
    assert "--workers" not in cmd and "--progress" not in cmd
    from prep.build import config_from_args, parser

    again = config_from_args(parser().parse_args(shlex.split(cmd)[4:-1]))  # the build's own CLI takes it back
    assert {k: v for k, v in again.to_json().items() if k not in ("workers", "progress")} == {
        k: v for k, v in config.items() if k not in ("workers", "progress")}


def _train(shards: Path, run: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train.main", "--shards", str(shards), "--output-dir", str(run),
                           "--num-workers", "0", *extra], cwd=REPO, env=train_env(), capture_output=True, text=True,
                          timeout=300)


def _predict(shards: Path, model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train.predict", "--model", str(model), "--shards", str(shards),
                           "--out", str(out), *extra], cwd=REPO, env=train_env(), capture_output=True, text=True,
                          timeout=300)


def test_a_v1_build_is_refused_by_train_and_predict_with_the_rebuild_command(shards_copy, tiny_cache, tmp_path):
    make_v1(shards_copy)
    with pytest.raises(SchemaError, match="schema version 1"):
        records(shards_copy)
    rebuild = rebuild_command(shards_copy)
    trained = _train(shards_copy, tmp_path / "run", "--cache-dir", str(tiny_cache))
    assert trained.returncode == 2, trained.stderr[-3000:]
    assert "schema version 1" in trained.stderr and rebuild in trained.stderr
    predicted = _predict(shards_copy, tiny_cache / "tiny_qwen3_vl", tmp_path / "preds.jsonl")
    assert predicted.returncode == 2, predicted.stderr[-3000:]
    assert "schema version 1" in predicted.stderr and rebuild in predicted.stderr
    assert not (tmp_path / "preds.jsonl").exists()


def test_shards_of_another_prompt_layout_are_refused(built_shards, tiny_cache, tmp_path):
    """Shards built in the installed transformers' layout, asked for in the other (as after an upgrade across 5.25)."""
    from schemas.prompt import DEFAULT_LAYOUT, LAYOUTS

    (other,) = set(LAYOUTS) - {DEFAULT_LAYOUT}
    rebuild = rebuild_command(built_shards, prompt_layout=other)
    trained = _train(built_shards, tmp_path / "run", "--cache-dir", str(tiny_cache), "--prompt-layout", other)
    assert trained.returncode == 2, trained.stderr[-3000:]
    assert f"tokenized with prompt layout {DEFAULT_LAYOUT}" in trained.stderr and f"--prompt-layout {other}" in trained.stderr
    assert rebuild in trained.stderr
    predicted = _predict(built_shards, tiny_cache / "tiny_qwen3_vl", tmp_path / "p.jsonl", "--prompt-layout", other)
    assert predicted.returncode == 2 and rebuild in predicted.stderr, predicted.stderr[-3000:]
