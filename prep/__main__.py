"""`python -m prep VERB ...`: one command group, one module per verb (energon style).

    build    videos + annotations -> shards, manifest.parquet, rejects.parquet, build.json  (prep/build.py)
    inspect  summary of a build, or one sample with a contact sheet                       (prep/inspect.py)
    verify   recheck shards against the manifest and the budget                           (prep/verify.py)

Each verb module exposes `cli(argv: list[str]) -> int`; it is imported only when its verb runs.
"""
from __future__ import annotations

import gc
import importlib
import sys

from prep.workers import loading

VERBS = {
    "build": ("prep.build", "decode videos into token-budgeted shards + manifest"),
    "inspect": ("prep.inspect", "summarize a build or show one sample"),
    "verify": ("prep.verify", "check shards, manifest and budget agree"),
}


def usage() -> str:
    lines = ["usage: python -m prep {" + ",".join(VERBS) + "} [-h] ...", "", "verbs:"]
    lines += [f"  {verb:<8} {text}" for verb, (_, text) in VERBS.items()]
    lines += ["", "Run `python -m prep VERB --help` for the verb's flags."]
    return "\n".join(lines)


def pick_verb(prog: str, verbs: dict, argv: list[str], usage_text: str) -> tuple[str, list[str]] | int:
    """(verb, its arguments), or the exit code once help or an unknown verb has been answered.
    Shared by `python -m prep` and the `video-ora` entry point, so both answer the same way."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage_text)
        return 0 if argv else 2
    if argv[0] not in verbs:
        print(f"{prog}: unknown verb {argv[0]!r}\n\n{usage_text}", file=sys.stderr)
        return 2
    return argv[0], argv[1:]


def main(argv: list[str] | None = None) -> int:
    picked = pick_verb("python -m prep", VERBS, sys.argv[1:] if argv is None else list(argv), usage())
    if isinstance(picked, int):
        return picked
    verb, rest = picked
    name = VERBS[verb][0]
    try:
        with loading():  # the verb's modules (pyarrow, numpy, ...): collected only at exit, which freezing skips
            module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:  # a missing dependency inside the verb is a real error
            raise
        print(f"python -m prep: verb {verb!r} is not available in this install ({name} is missing)", file=sys.stderr)
        return 2
    code = int(module.cli(rest) or 0)
    gc.freeze()  # the interpreter's exit would walk every object the verb made (0.6 s on the 2-core box)
    return code


if __name__ == "__main__":
    sys.exit(main())
