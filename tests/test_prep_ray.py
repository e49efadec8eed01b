"""`prep build --ray` on a real Ray cluster on loopback (ray.init: a local cluster of 2 CPUs on 127.0.0.1, no
dashboard), against the local build of the same inputs: same manifest, rejects and byte-identical shards; a
Ray worker killed mid-shard is retried and its rejects arrive once; a hung decoder on the cluster is rejected
by the same watchdog. One cluster for the module, always shut down; every build has a bound."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import ray  # in the test extra: a missing Ray fails here, it is never skipped

from prep import ray_distributor
from prep.build import BuildConfig, build
from prep.faults import FAULT_ENV, FAULT_ONCE_ENV
from schemas.build import BuildRecord
from schemas.manifest import RejectRecord, SampleRecord, read_records
from conftest import BUILT_SHARDS_ARGS


ARGS = {**BUILT_SHARDS_ARGS, "max_input_tokens": 1000}
BOUND_S = 90  # one build on the loaded 2-core CI box takes ~5-10 s
pytestmark = pytest.mark.timeout(300)  # cluster start, fixtures and test together: a hang fails, never stalls CI


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray cluster of 2 CPUs (2 worker processes) on 127.0.0.1, shut down after the module."""
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no phone-home
    t0 = time.monotonic()
    for attempt in (1, 2):  # a start-up that fails under load (a raylet too slow to register) gets one more try
        try:
            ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", object_store_memory=80 * 2**20,
                     _temp_dir=str(tmp_path_factory.mktemp("ray")), log_to_driver=True, configure_logging=False)
            break
        except Exception as e:  # noqa: BLE001 (any start-up failure; the second one is raised)
            ray.shutdown()
            if attempt == 2:
                mp.undo()
                raise
            print(f"ray.init failed ({type(e).__name__}: {e}); retrying once")
    try:
        print(f"ray.init took {time.monotonic() - t0:.1f} s")
        yield ray
    finally:
        ray.shutdown()
        mp.undo()


@pytest.fixture(scope="module")
def inputs(synth_videos_dir, tmp_path_factory):
    """The 4 synthetic videos + a second annotation of vid_d whose query is over the 1000-token bound (its 3
    windows are rejected inside the shard worker: rejects that travel in sidecars) + an empty file (an input
    reject)."""
    d = tmp_path_factory.mktemp("ray_videos")
    for p in synth_videos_dir.glob("*.mp4"):
        shutil.copy(p, d / p.name)
    (d / "empty.mp4").write_bytes(b"")
    lines = (synth_videos_dir / "annotations.jsonl").read_text().splitlines()
    lines.append(json.dumps({"id": "vid_d_long", "video": "vid_d.mp4", "segments": [], "query": "word " * 1200}))
    lines.append(json.dumps({"id": "empty", "video": "empty.mp4", "segments": []}))
    (d / "annotations.jsonl").write_text("\n".join(lines) + "\n")
    return d


@pytest.fixture(scope="module")
def local(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("local_build")
    build(BuildConfig(videos=inputs, out=out, **{**ARGS, "workers": 2}))
    return out


def snapshot(out):
    record = BuildRecord.read(out)
    return ({s.name: s.sha256 for s in record.shard_files},
            [r for r in read_records(out / "manifest.parquet", SampleRecord)],
            [(r.video_id, r.stage, r.reason, r.detail) for r in read_records(out / "rejects.parquet", RejectRecord)])


def timed_build(**kw) -> dict:
    t0 = time.monotonic()
    summary = build(BuildConfig(**kw))
    assert time.monotonic() - t0 < BOUND_S
    return summary


def test_a_ray_build_gives_the_local_builds_samples_rejects_and_byte_identical_shards(cluster, inputs, local, tmp_path):
    out = tmp_path / "out"
    summary = timed_build(videos=inputs, out=out, ray="", **{**ARGS, "workers": None})  # no cap on tasks in flight
    shards, samples, rejects = snapshot(out)
    ref_shards, ref_samples, ref_rejects = snapshot(local)
    assert shards == ref_shards and len(shards) == 3
    assert samples == ref_samples and len(samples) == 12
    assert rejects == ref_rejects
    assert sorted({(v, r) for v, _, r, _ in rejects}) == [("empty", "zero_byte_file"), ("vid_d_long", "over_token_budget")]
    assert [r[0] for r in rejects].count("vid_d_long") == 3
    assert summary["shards_built"] == 3 and not list(out.glob("*.tmp"))
    assert BuildRecord.read(out).config["ray"] == ""


def test_a_killed_ray_worker_is_retried_and_a_hung_decoder_is_rejected_on_the_cluster(
        cluster, inputs, local, tmp_path, monkeypatch, capfd):
    # vid_c's Ray worker is SIGKILLed after vid_c's first window (its half-written tar left behind), once;
    # vid_b's decoder blocks after its first window: the watchdog inside the Ray task rejects it
    once = tmp_path / "once"
    once.mkdir()
    monkeypatch.setenv(FAULT_ENV, "kill_worker:vid_c.mp4,decode_hang:vid_b.mp4")
    monkeypatch.setenv(FAULT_ONCE_ENV, str(once))
    out = tmp_path / "out"
    timed_build(videos=inputs, out=out, ray="", **{**ARGS, "decode_timeout": 4.0})
    assert (once / "kill_worker-vid_c.mp4").exists()  # the kill happened (the retry found the marker)
    shards, samples, rejects = snapshot(out)
    ref_shards, ref_samples, ref_rejects = snapshot(local)
    vid_b_shard = {r.shard for r in ref_samples if r.video_id == "vid_b"}
    assert vid_b_shard == {"shard-000000.tar"}
    # the retried shard (vid_c) and the others are byte-identical to the local build; only vid_b's shard differs
    assert {k: v for k, v in shards.items() if k not in vid_b_shard} == {k: v for k, v in ref_shards.items()
                                                                         if k not in vid_b_shard}
    assert samples == [r for r in ref_samples if r.video_id != "vid_b"]
    timeouts = [r for r in rejects if r[2] == "decode_timeout"]
    assert [(v, s) for v, s, _, _ in timeouts] == [("vid_b", "decode")] * 3
    assert sorted(set(rejects) - set(timeouts)) == sorted(ref_rejects)  # every other reject exactly once
    assert len(rejects) == len(ref_rejects) + 3
    assert not list(out.glob("*.tmp"))  # the killed attempt's temp tar was swept at the end
    err = capfd.readouterr().err
    assert "decoding" in err and "vid_b.mp4 made no progress" in err


def test_a_ray_worker_keeps_its_forked_child_for_its_next_task(cluster):
    # each task reports the process it ran in and that process's parent (the Ray worker): one child per Ray worker,
    # however many tasks it ran (a fork per task gives six children)
    stats = dict(ray_distributor.distribute(Path.read_text, [Path("/proc/self/stat")] * 6, in_flight=1))
    assert sorted(stats) == list(range(6))
    # /proc/self/stat: "pid (comm) state ppid ..."
    runs = [(int(s.rsplit(")", 1)[1].split()[1]), int(s.split()[0])) for s in stats.values()]
    ray_workers = {parent for parent, _ in runs}
    assert len(set(runs)) == len(ray_workers) < 6
    assert all(child != parent for parent, child in runs)
