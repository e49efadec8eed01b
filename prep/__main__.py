"""`python -m prep VERB ...`: one command group, one module per verb (energon style).

    build    videos + annotations -> shards, manifest.parquet, rejects.parquet, build.json  (prep/build.py)
    inspect  summary of a build, or one sample with a contact sheet                       (prep/inspect.py)
    verify   recheck shards against the manifest and the budget                           (prep/verify.py)

Each verb module exposes `cli(argv: list[str]) -> int`; it is imported only when its verb runs.
"""
from __future__ import annotations

import importlib
import sys

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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"python -m prep: unknown verb {verb!r}\n\n{usage()}", file=sys.stderr)
        return 2
    name = VERBS[verb][0]
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:  # a missing dependency inside the verb is a real error
            raise
        print(f"python -m prep: verb {verb!r} is not available in this install ({name} is missing)", file=sys.stderr)
        return 2
    return int(module.cli(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
