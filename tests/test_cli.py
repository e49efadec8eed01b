"""The `video-ora` console entry point: every verb reaches its module's own CLI, exit codes pass through."""
import sys
import tomllib
from pathlib import Path

import pytest

from video_ora import cli

REPO = Path(__file__).resolve().parents[1]


def test_pyproject_declares_the_entry_point_and_packages_it():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["video-ora"] == "video_ora.cli:main"
    assert "video_ora*" in project["tool"]["setuptools"]["packages"]["find"]["include"]


def test_help_explains_every_verb_and_the_prep_verbs(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for verb, (_, line) in cli.VERBS.items():
        assert f"  {verb:<15} {line}" in text
    for verb in ("build", "inspect", "verify"):
        assert f"  {verb:<15}" in text
    assert cli.main([]) == 2  # no verb: usage, and a usage error


@pytest.mark.parametrize("verb,flag", [("train", "--micro-batch-size"), ("predict", "--max-new-tokens"), ("evaluate", "--top1"),
                                       ("export", "--format"), ("verify-adapter", "--base")])
def test_each_verb_is_its_module_cli(verb, flag, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # run_module rewrites argv: restore it afterwards
    assert cli.main([verb, "--help"]) == 0
    out = capsys.readouterr().out
    assert flag in out  # a flag only that module's argparse has


def test_prep_goes_through_preps_own_dispatcher(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert cli.main(["prep", "--help"]) == 0
    assert "python -m prep VERB --help" in capsys.readouterr().out
    assert cli.main(["prep", "build", "--help"]) == 0
    assert "--window-seconds" in capsys.readouterr().out
    assert cli.main(["prep", "nosuchverb"]) == 2


def test_exit_codes_and_unknown_verbs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert cli.main(["verify-adapter", str(tmp_path)]) == 2  # no run.json: the module's own error code
    assert "run.json not found" in capsys.readouterr().err
    assert cli.main(["nosuch"]) == 2
    assert "unknown verb 'nosuch'" in capsys.readouterr().err


def test_prep_build_help_imports_no_torch_and_the_build_parent_imports_it_once_for_its_workers():
    """`--help` answers without torch (1 s); a build's parent imports it before it forks (warm_before_fork), so
    no worker imports it again."""
    import subprocess

    code = (
        "import contextlib, io, sys\n"
        "from prep.__main__ import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
        "    main(['build', '--help'])\n"
        "assert '--decoder' in out.getvalue() and 'torch' not in sys.modules, sorted(sys.modules)\n"
        "from prep.build import warm_before_fork\n"
        "from schemas.prompt import DEFAULT_LAYOUT\n"
        "warm_before_fork(None, DEFAULT_LAYOUT)\n"
        "print(' '.join(m for m in ('torch', 'decord', 'av') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["torch", "decord", "av"]
