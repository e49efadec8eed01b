"""Offline parts of scripts/bench_prep.py and scripts/build_wheelhouse.py (the runs themselves are not CI:
the bench takes minutes, the wheelhouse needs the package registry)."""
from __future__ import annotations

import zipfile

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from scripts.bench_prep import write_annotations, write_markdown
from scripts.build_wheelhouse import applies, pin, target_env, wheel_requirements


def test_markdown_replaces_only_the_prep_section(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    write_markdown(md, "## Prep\n\nfirst\n")
    assert md.read_text().startswith("# Benchmarks") and "first" in md.read_text()
    md.write_text(md.read_text() + "\n## Train\n\ntrain numbers\n")
    write_markdown(md, "## Prep\n\nsecond\n")
    text = md.read_text()
    assert "second" in text and "first" not in text and "## Train\n\ntrain numbers" in text
    assert text.count("## Prep") == 1


def test_bench_annotates_every_video(tmp_path):
    (tmp_path / "a").mkdir()
    for name in ("a/x.mp4", "y.mkv", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert write_annotations(tmp_path, tmp_path / "ann.jsonl") == 2
    assert '"video": "a/x.mp4"' in (tmp_path / "ann.jsonl").read_text()


def test_wheelhouse_markers_follow_the_target_python(tmp_path):
    env = target_env("3.12")
    assert applies(Requirement('tomli; python_version < "3.11"'), set(), target_env("3.10"))
    assert not applies(Requirement('tomli; python_version < "3.11"'), set(), env)
    assert not applies(Requirement('pywin32; sys_platform == "win32"'), set(), env)
    assert applies(Requirement('aiohttp; extra == "http"'), {"http"}, env)
    assert not applies(Requirement('aiohttp; extra == "http"'), set(), env)
    assert pin("packaging", SpecifierSet(">=1")).startswith("packaging==")  # installed here: pinned
    assert pin("no-such-package-xyz", SpecifierSet(">=2")) == "no-such-package-xyz>=2"

    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n"
                                                  "Requires-Dist: numpy>=1.20\nRequires-Dist: torch\n")
    assert [str(r) for r in wheel_requirements(wheel)] == ["numpy>=1.20", "torch"]
