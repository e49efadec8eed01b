"""Offline wheelhouse for air-gapped GPU nodes (which already have a CUDA torch installed).

    python -m scripts.build_wheelhouse [--out wheelhouse] [--python-version 3.12]
    # then, on the node (torch present):  pip install --no-index --find-links wheelhouse video-ora

What it does, on a machine with the package registry:
  1. the project's own wheel (`pip wheel --no-deps --no-build-isolation` of a copy of the git-tracked and
     untracked-but-not-ignored files, so no stale build/ leaks in);
  2. every dependency of video-ora except torch and what only torch needs (CUDA libraries, triton), walked
     level by level from the wheels' own metadata with markers evaluated for the target Python on
     manylinux x86_64, downloaded as binary wheels (`pip download --no-deps --only-binary=:all:
     --platform ... --python-version ...`). A package installed in this environment is pinned to its
     installed version (the tested combination) when that satisfies the requirement;
  3. deepspeed, published only as an sdist: `pip wheel --no-deps --no-build-isolation deepspeed==<version>`
     turns it into a py3-none-any wheel (its setup.py imports torch, which is installed here; no ops are
     prebuilt, they JIT-compile on the node like in any pip install). Any other sdist-only dependency is
     built the same way;
  4. an offline dry run of that install command for the target (only the wheelhouse, plus a metadata-only
     stand-in for torch) must resolve, or the script fails.
The output folder (default wheelhouse/) is git-ignored. Not part of CI: it needs the registry.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[1]
SKIP = {"torch"}  # the node brings its own CUDA build; its dependency subtree is not walked
SDIST_ONLY = {"deepspeed"}
PLATFORMS = ["manylinux2010_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_34_x86_64", "linux_x86_64"]


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def target_env(python_version: str) -> dict:
    env = default_environment()
    env.update(python_version=python_version, python_full_version=f"{python_version}.0", implementation_name="cpython",
               platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
               platform_machine="x86_64", os_name="posix")
    return env


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(name).decode())
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def applies(req: Requirement, extras: set[str], env: dict) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""}))


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def pin(name: str, spec: SpecifierSet) -> str:
    """name==installed when the installed version satisfies spec, else name<spec> for pip to choose."""
    v = installed_version(name)
    return f"{name}=={v}" if v is not None and spec.contains(v, prereleases=True) else f"{name}{spec}"


def wheels_by_name(folder: Path) -> dict[str, Path]:
    return {canonicalize_name(parse_wheel_filename(p.name)[0]): p for p in folder.glob("*.whl")}


def download(reqs: list[str], out: Path, python_version: str) -> None:
    abi = "cp" + python_version.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(out),
           "--python-version", python_version, "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    run(cmd + reqs)


def build_from_sdist(req: str, out: Path) -> None:
    """pip wheel from source; for a registry requirement the sdist is forced (no published or cached wheel)."""
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out)]
    if not Path(req).exists():
        cmd += ["--no-binary", Requirement(req).name, "--no-cache-dir"]
    run(cmd + [req])


def build_wheelhouse(out: Path, python_version: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    env = target_env(python_version)
    with tempfile.TemporaryDirectory() as src:  # the project itself, from a clean copy: no build/ or egg-info here
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                               capture_output=True, text=True).stdout.split()
        for f in files:
            if (REPO / f).is_file():
                (Path(src) / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / f, Path(src) / f)
        build_from_sdist(src, out)
    project = wheels_by_name(out)[canonicalize_name("video-ora")]
    todo: dict[str, tuple[SpecifierSet, set[str]]] = {}

    def want(reqs: list[Requirement], parent_extras: set[str]) -> None:
        for r in reqs:
            name = canonicalize_name(r.name)
            if name in SKIP or not applies(r, parent_extras, env):
                continue
            spec, extras = todo.get(name, (SpecifierSet(), set()))
            todo[name] = (spec & r.specifier, extras | set(r.extras))

    want(wheel_requirements(project), set())
    walked: dict[str, set[str]] = {}  # name -> extras whose requirements were already followed
    while True:
        have = wheels_by_name(out)
        level = {n: v for n, v in todo.items() if n not in walked or not v[1] <= walked[n]}
        if not level:
            break
        missing = [n for n in level if n not in have]
        binary = [pin(n, level[n][0]) for n in missing if n not in SDIST_ONLY]
        if binary:
            try:
                download(binary, out, python_version)
            except subprocess.CalledProcessError:
                # one of them has no wheel for this target: fetch one by one, building sdists where needed
                for req in binary:
                    try:
                        download([req], out, python_version)
                    except subprocess.CalledProcessError:
                        build_from_sdist(req, out)
        for n in missing:
            if n in SDIST_ONLY:
                build_from_sdist(pin(n, level[n][0]), out)
        have = wheels_by_name(out)
        for n, (spec, extras) in level.items():
            if n not in have:
                raise SystemExit(f"no wheel for {n}{spec} after download/build")
            walked[n] = walked.get(n, set()) | extras
            want(wheel_requirements(have[n]), extras)
    return sorted(out.glob("*.whl"))


def check_resolves(out: Path, python_version: str) -> None:
    """Offline dry run of the node's install for the target Python/platform, with only this wheelhouse and a
    metadata-only stand-in for the node's torch (no config files, no index, no other find-links): fails if
    any needed wheel is missing."""
    import os

    torch_version = installed_version("torch") or "2.6.0"
    with tempfile.TemporaryDirectory() as tmp:
        stub = Path(tmp) / f"torch-{torch_version}-py3-none-any.whl"
        info = f"torch-{torch_version}.dist-info"
        with zipfile.ZipFile(stub, "w") as z:
            z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
            z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            z.writestr(f"{info}/RECORD", "")
        abi = "cp" + python_version.replace(".", "")
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-index",
               "--find-links", str(out), "--find-links", tmp, "--only-binary=:all:", "--python-version", python_version,
               "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none", "--target", str(Path(tmp) / "t")]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
        print("+", " ".join(cmd + ["video-ora"]), flush=True)
        subprocess.run(cmd + ["video-ora"], check=True, env=env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "wheelhouse", help="wheelhouse folder (git-ignored)")
    ap.add_argument("--python-version", default="3.12", help="target Python, major.minor")
    args = ap.parse_args(argv)
    wheels = build_wheelhouse(args.out.resolve(), args.python_version)
    check_resolves(args.out.resolve(), args.python_version)
    total = sum(p.stat().st_size for p in wheels)
    print(f"\n{len(wheels)} wheels, {total / 2**20:.0f} MiB in {args.out}:")
    for p in wheels:
        print(f"  {p.name}")
    print("\nOn the air-gapped node (with torch already installed, Python "
          f"{args.python_version}, x86_64):\n  pip install --no-index --find-links {args.out} video-ora")
    return 0


if __name__ == "__main__":
    sys.exit(main())
