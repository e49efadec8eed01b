"""Export: keep-list JSON, CMX3600 EDL timecodes (read back with OpenTimelineIO's CMX3600 reader), unique
output names, no overwrite without --overwrite, and an ffmpeg command that really cuts a video."""
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.manifest import Segment
from schemas.predictions import PredictionRow, write_predictions
from scripts.synth_videos import VideoSpec, write_video
from train import export as ex
from train.segments import to_source

REPO = Path(__file__).resolve().parent.parent


def S(a, b):
    return Segment(start_s=a, end_s=b)


def row(video_id, index, start, end, pairs, source_path=None, status="valid", fps=25.0):
    segs = [S(a, b) for a, b in pairs]
    return PredictionRow(
        sample_id=f"{video_id}/w{index:04d}", video_id=video_id, source_path=source_path or f"{video_id}.mp4",
        window_index=index, window_start_s=start, window_end_s=end, raw_output="", status=status, degenerate=[],
        repairs=[], segments=segs, segments_source=to_source(segs, start), source_fps=fps,
    )


def keep(video_id="v", segs=((1.0, 2.0),), fps=25.0, path=None, audio=False):
    return ex.VideoKeep(video_id=video_id, source_path=f"{video_id}.mp4", path=path or f"{video_id}.mp4", fps=fps,
                        has_audio=audio, keep=[S(a, b) for a, b in segs], windows=1, failed_windows=0)


def find_ffmpeg():
    exe = shutil.which("ffmpeg")
    if exe:
        return exe
    try:
        import imageio_ffmpeg
    except ImportError:
        return None
    return imageio_ffmpeg.get_ffmpeg_exe()


def test_timecode():
    assert ex.timecode(0, 25) == "00:00:00:00"
    assert ex.timecode(25 * 3661 + 7, 25) == "01:01:01:07"
    assert ex.timecode(30, 29.97) == "00:00:01:00"  # NDF: base 30


def test_edl_events_and_timecodes():
    edl = ex.to_edl(keep(segs=[(1.0, 2.5), (10.0, 10.4)], fps=25.0))
    lines = edl.splitlines()
    assert lines[0] == "TITLE: v" and lines[1] == "FCM: NON-DROP FRAME"
    events = [ln.split() for ln in lines if ln[:3].isdigit()]
    # event, reel, track, transition, src in, src out, rec in, rec out
    assert events[0] == ["001", "AX", "V", "C", "00:00:01:00", "00:00:02:13", "00:00:00:00", "00:00:01:13"]
    assert events[1] == ["002", "AX", "V", "C", "00:00:10:00", "00:00:10:10", "00:00:01:13", "00:00:01:23"]
    assert edl.count("* FROM CLIP NAME: v.mp4") == 2


def test_edl_needs_fps_and_skips_sub_frame_segments():
    with pytest.raises(ValueError, match="no fps"):
        ex.to_edl(keep(fps=None))
    edl = ex.to_edl(keep(segs=[(1.0, 1.01), (2.0, 3.0)], fps=10.0))
    assert sum(ln[:3].isdigit() for ln in edl.splitlines()) == 1


def test_collect_merges_windows_and_json(tmp_path):
    rows = [row("a", 0, 0.0, 10.0, [[8.0, 10.0]]), row("a", 1, 10.0, 20.0, [[0.0, 3.0], [5.0, 6.0]]),
            row("b", 0, 0.0, 10.0, [], status="failed")]
    videos = ex.collect(rows)
    assert [v.video_id for v in videos] == ["a", "b"]
    assert videos[0].keep == [S(8.0, 13.0), S(15.0, 16.0)]
    assert (videos[1].keep, videos[1].failed_windows) == ([], 1)
    data = ex.to_json(videos, 0.1)
    assert data["videos"][0]["keep"] == [[8.0, 13.0], [15.0, 16.0]] and data["videos"][0]["kept_s"] == 6.0


def test_ffmpeg_args_quote_hostile_paths():
    v = keep(path="-my dir/it's $(rm -rf x).mp4", segs=[(1.0, 2.0), (3.0, 4.0)], audio=True)
    argv = ex.ffmpeg_args(v, "cut/o ut.mp4")
    assert argv[argv.index("-i") + 1] == "file:-my dir/it's $(rm -rf x).mp4"
    graph = argv[argv.index("-filter_complex") + 1]
    assert "[0:v]trim=start=1.000:end=2.000,setpts=PTS-STARTPTS[v0]" in graph
    assert "[0:a]atrim=start=3.000:end=4.000,asetpts=PTS-STARTPTS[a1]" in graph
    assert graph.endswith("[v0][a0][v1][a1]concat=n=2:v=1:a=1[outv][outa]")
    script = ex.ffmpeg_script([v, keep("empty", segs=[])])
    cmd = next(ln for ln in script.splitlines() if ln.startswith("ffmpeg"))
    assert shlex.split(cmd)[:-1] == argv[:-1]  # the shell reads back exactly the argv
    assert "# empty: nothing to keep" in script


def _duration(path):
    import av

    with av.open(str(path)) as c:
        s = c.streams.video[0]
        frames = sum(1 for _ in c.decode(s))
        return frames / float(s.average_rate)


def test_ffmpeg_command_cuts_a_real_video_and_never_overwrites_unasked(tmp_path):
    exe = find_ffmpeg()
    if exe is None:
        pytest.skip("no ffmpeg binary (neither on PATH nor from imageio-ffmpeg): the cut cannot be run here")
    videos = tmp_path / "my videos"
    videos.mkdir()
    spec = VideoSpec(name="it's a clip", duration_s=6.0, fps=10.0, events=((1.0, 2.5),))
    write_video(spec, videos)
    rows = [row("clip", 0, 0.0, 4.0, [[1.0, 2.5]], source_path=spec.filename),
            row("clip", 1, 4.0, 6.0, [[0.0, 1.0]], source_path=spec.filename)]
    preds = tmp_path / "preds.jsonl"
    write_predictions(preds, rows)
    script = tmp_path / "cut.sh"
    cut_dir = tmp_path / "cut dir"
    assert ex.main([str(preds), "--format", "ffmpeg", "--videos", str(videos), "--out", str(script),
                    "--cut-dir", str(cut_dir), "--ffmpeg", exe]) == 0
    subprocess.run(["bash", str(script)], check=True, capture_output=True, timeout=120)
    out = cut_dir / "clip.keep.mp4"
    assert _duration(out) == pytest.approx(1.5 + 1.0, abs=0.11)  # 1.0-2.5 s and 4.0-5.0 s
    # EDL from the probed fps (10) via the CLI
    edl_dir = tmp_path / "edl"
    assert ex.main([str(preds), "--format", "edl", "--videos", str(videos), "--out", str(edl_dir)]) == 0
    events = [ln.split() for ln in (edl_dir / "clip.edl").read_text().splitlines() if ln[:3].isdigit()]
    assert [e[4:] for e in events] == [["00:00:01:00", "00:00:02:05", "00:00:00:00", "00:00:01:05"],
                                       ["00:00:04:00", "00:00:05:00", "00:00:01:05", "00:00:02:05"]]

    # nothing existing is overwritten unasked: not the script, not the EDLs, not a cut made before
    cut_bytes = out.read_bytes()
    again = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and f"error: {out} exists; nothing was cut" in again.stderr, again.stderr
    assert out.read_bytes() == cut_bytes
    for fmt, dest in (("ffmpeg", script), ("edl", edl_dir)):
        proc = subprocess.run([sys.executable, "-m", "train.export", str(preds), "--format", fmt, "--videos",
                               str(videos), "--out", str(dest), "--cut-dir", str(cut_dir), "--ffmpeg", exe],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
        assert proc.returncode == ex.EXIT_EXISTS and "exists; pass --overwrite" in proc.stderr, proc.stderr
    # with --overwrite the script replaces the cut (through its .partial file, gone afterwards)
    assert ex.main([str(preds), "--format", "ffmpeg", "--videos", str(videos), "--out", str(script),
                    "--cut-dir", str(cut_dir), "--ffmpeg", exe, "--overwrite"]) == 0
    before = out.stat().st_mtime_ns
    subprocess.run(["bash", str(script)], check=True, capture_output=True, timeout=120)
    assert out.stat().st_mtime_ns != before and sorted(p.name for p in cut_dir.iterdir()) == ["clip.keep.mp4"]


def test_cli_json_to_stdout(tmp_path, capsys):
    preds = tmp_path / "preds.jsonl"
    write_predictions(preds, [row("a", 0, 0.0, 10.0, [[1.0, 2.0]])])
    assert ex.main([str(preds), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["videos"][0]["keep"] == [[1.0, 2.0]] and data["videos"][0]["fps"] == 25.0


def read_cmx3600(edl: str, fps: float):
    """The EDL as OpenTimelineIO's CMX3600 reader sees it: [(clip name, source in/out, record in) in frames]."""
    import opentimelineio as otio  # the test extra installs it with otio-cmx3600-adapter (not in the core package, 0.18.1)

    assert "cmx_3600" in [a.name for a in otio.plugins.ActiveManifest().adapters], "pip install otio-cmx3600-adapter"
    timeline = otio.adapters.read_from_string(edl, "cmx_3600", rate=fps)
    clips = []
    for c in timeline.find_clips():
        src, rec = c.source_range, c.range_in_parent()
        clips.append((c.name, src.start_time.value, src.end_time_exclusive().value, rec.start_time.value))
    return timeline, clips


def test_edl_with_hostile_names_parses_with_a_cmx3600_reader_with_exactly_the_expected_events():
    injected = "001  AX       V     C        00:00:00:00 00:00:09:00 00:00:00:00 00:00:09:00"
    v = keep(segs=[(1.0, 2.0), (3.0, 4.5)], fps=25.0)
    v.video_id = f"evil\r\n{injected}\u2028title"
    v.source_path = f"dir/clip\n{injected}\x0bname\u2029.mp4"
    edl = ex.to_edl(v)
    assert len(edl.splitlines()) == 3 + 2 * 2  # title, FCM, blank, then two lines per event
    timeline, clips = read_cmx3600(edl, 25.0)
    flat = " ".join(injected.split())  # line breaks became spaces, runs of spaces collapsed
    assert clips == [(f"clip {flat} name .mp4", 25, 50, 0), (f"clip {flat} name .mp4", 75, 113, 25)]
    assert timeline.name == f"evil {flat} title"[:70]


def test_non_ascii_and_colliding_ids_get_distinct_names_and_files(tmp_path):
    ids = ["東京", "大阪", "a b", "a_b", "A_B", "-rf", "clip", "..", "Ünïcode"]
    stems = ex.output_stems([keep(i) for i in ids])
    assert len({s.casefold() for s in stems.values()}) == len(ids)
    assert stems["clip"] == "clip" and stems["-rf"] == "rf"  # a clean, unique name stays readable
    assert stems["東京"] == f"video-{ex.short_hash('東京')}" and stems[".."] == f"video-{ex.short_hash('..')}"
    assert stems["a b"] == f"a_b-{ex.short_hash('a b')}" and stems["A_B"] == f"A_B-{ex.short_hash('A_B')}"
    assert stems == ex.output_stems([keep(i) for i in reversed(ids)])  # not order dependent

    preds = tmp_path / "preds.jsonl"
    write_predictions(preds, [row("東京", 0, 0.0, 10.0, [[1.0, 2.0]]), row("大阪", 0, 0.0, 10.0, [[3.0, 4.0]])])
    assert ex.main([str(preds), "--format", "edl", "--out", str(tmp_path / "edl")]) == 0
    files = sorted((tmp_path / "edl").iterdir())
    assert len(files) == 2
    by_title = {read_cmx3600(f.read_text(), 25.0)[0].name: read_cmx3600(f.read_text(), 25.0)[1] for f in files}
    assert by_title == {"東京": [("東京.mp4", 25, 50, 0)], "大阪": [("大阪.mp4", 75, 100, 0)]}
    script = ex.ffmpeg_script(ex.collect([row("東京", 0, 0.0, 10.0, [[1.0, 2.0]]),
                                          row("大阪", 0, 0.0, 10.0, [[3.0, 4.0]])]))
    cuts = [shlex.split(ln)[-1] for ln in script.splitlines() if ln.startswith("mv ")]
    assert len(set(cuts)) == 2 and all(c.startswith("cut/video-") for c in cuts)
