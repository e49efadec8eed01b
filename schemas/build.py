"""SHARDS/build.json: what a build was made with, as one typed record written and read only here.

prep build writes it last (`BuildRecord.write`); prep verify, prep inspect, the trainer and predict read
it (`BuildRecord.read`), which refuses a file of another schema version with the command that rebuilds the
shards. `config` and `budget` are prep's own dataclasses serialized verbatim (`BuildConfig.to_json()`,
`dataclasses.asdict(VideoBudget)`): only prep reads them back; everything another stage needs has a typed
field here (model family, prompt layout, tokenizer ids, shard digests).
"""
from __future__ import annotations

import dataclasses
import json
import shlex
import typing
from pathlib import Path
from typing import Any

from schemas.manifest import SCHEMA_VERSION, SchemaError

BUILD_JSON = "build.json"
# BuildConfig fields that do not decide the content of the shards (left out of a rebuild command)
_NOT_CONTENT = ("workers", "overwrite", "progress", "ray", "part", "assemble")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerInfo:
    """Which tokenizer produced the input_ids."""

    path: str  # tokenizer directory used (the bundled one when bundled)
    bundled: bool  # True: the small tokenizer shipped in schemas/assets/tokenizer
    tokenizer_json_sha256: str  # sha256 of its tokenizer.json, so a changed file is noticed
    special_token_ids: dict[str, int]  # <|video_pad|>, <|vision_start|>, ... -> id


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptInfo:
    """How the video item was expanded into input_ids (schemas/prompt.py)."""

    layout: str  # nested | flat
    transformers: str | None  # transformers version installed at build time (its processor defines `nested`)


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputBound:
    """The longest sample a build writes, in tokens, and where that number comes from (prep.build.input_bound)."""

    tokens: int | None  # None: nothing declares a maximum
    source: str  # "--max-input-tokens", "tokenizer model_max_length", "config.json max_position_embeddings", ...

    def __str__(self) -> str:
        return f"--max-input-tokens {self.tokens}" if self.source == "--max-input-tokens" else \
            f"the model's maximum {self.tokens} ({self.source}; --max-input-tokens overrides)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeInfo:
    """How frames went from the source to the stored JPEGs."""

    backend: str  # decoder, e.g. decord (--decoder)
    resize: str  # resize rule, in words
    jpeg_quality: int  # JPEG quality of the stored frames
    # where decode, resize and JPEG ran, and what wrote the JPEG bytes: always cpu and PIL now; a build of
    # sessions 6-15 made with the experimental `--device cuda` (NVDEC + nvjpeg, removed: BENCHMARKS.md, GPU
    # decode) says cuda and nvjpeg
    device: str = "cpu"
    jpeg_encoder: str = "PIL (libjpeg-turbo)"
    # codec (PyAV name) -> the backend that decoded the build's files of it: decord hands the codecs it gets
    # wrong to PyAV (prep/decoders.py backend_for); older files: {}
    backends: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file of a shard, as its stats file and build.json record it."""

    name: str  # file name, relative to the build directory
    bytes: int  # size
    sha256: str  # of the whole file


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardFile:
    """One tar of the build, with its sidecars."""

    name: str  # file name, relative to the build directory
    sha256: str  # of the whole tar
    bytes: int  # size of the tar
    samples: int  # samples it holds
    sidecars: dict[str, FileEntry]  # "samples" / "rejects" -> the shard's parquet sidecar


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timings:
    probe: float  # seconds probing sources
    shards: float  # seconds building shards
    assemble: float  # seconds assembling manifest.parquet and rejects.parquet
    total: float  # wall seconds of the whole build
    setup: float | None = None  # seconds before the probes: out dir, tokenizer, first calls, annotations (None: older build)
    plan: float | None = None  # seconds between the probes and the shards: windows, shard plan, input rejects


@dataclasses.dataclass(frozen=True, kw_only=True)
class Throughput:
    videos_per_s: float | None  # over the shards built by this run (None: nothing built)
    windows_per_s: float | None
    realtime_factor: float | None  # source seconds per build second


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildSummary:
    """Counts of one build (also what `prep build` prints as its JSON event)."""

    schema_version: str  # manifest/build.json schema version
    samples: int  # rows of manifest.parquet
    videos: int  # distinct video ids with at least one sample
    annotations_matched: int  # annotation rows that matched a video file
    shards: int  # tars in the build
    samples_per_shard: int | None = None  # the most a shard holds: --samples-per-shard or the default it got
    shards_built: int  # tars built by this run
    shards_skipped: int  # tars already complete (resume)
    frames: int  # stored frames
    visual_tokens: int  # video pad tokens over all samples
    input_tokens: int  # tokens over all samples
    negatives: int  # samples whose answer is []
    negatives_dropped: int  # windows left out by --negatives drop
    rejects: int  # rows of rejects.parquet
    rejects_by_reason: dict[str, int]  # reason -> count
    timings_s: Timings
    throughput: Throughput


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildRecord:
    """Everything build.json holds."""

    summary: BuildSummary
    model_family: str  # patch geometry the build planned for (qwen3_vl, qwen3_5, qwen2_5_vl)
    prompt: PromptInfo
    tokenizer: TokenizerInfo
    decode: DecodeInfo
    answer_format: str  # schemas.answer.DESCRIPTION
    versions: dict[str, str | None]  # schemas.versions.package_versions() at build time
    shard_files: list[ShardFile]
    config: dict[str, Any]  # prep's BuildConfig.to_json(), verbatim (read back by prep only)
    budget: dict[str, Any]  # prep's VideoBudget as used, verbatim (read back by prep only)
    max_input_tokens: InputBound  # the bound applied to every sample (config holds only the flag)

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **dataclasses.asdict(self)}

    def write(self, root: str | Path, *, tmp: Path) -> Path:
        """Write SHARDS/build.json atomically: to `tmp` (a name only this writer uses), then rename."""
        path = Path(root) / BUILD_JSON
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)
        return path

    @classmethod
    def read(cls, root: str | Path) -> "BuildRecord":
        """Read SHARDS/build.json, refusing another schema version (with the rebuild command)."""
        path = Path(root) / BUILD_JSON
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise SchemaError(f"{path} not found: {root} is not the output of `python -m prep build`") from None
        except json.JSONDecodeError as e:
            raise SchemaError(f"{path} is not JSON ({e}); rebuild: {rebuild_command(root)}") from e
        version = str(data.get("schema_version", "?"))
        if version != SCHEMA_VERSION:
            raise SchemaError(f"{path}: build of schema version {version}; this package reads version "
                              f"{SCHEMA_VERSION}. Rebuild the shards: {rebuild_command(root)}")
        try:
            return _from_json(cls, {k: v for k, v in data.items() if k != "schema_version"})
        except (KeyError, TypeError, ValueError) as e:
            raise SchemaError(f"{path}: not a build record ({e}); rebuild: {rebuild_command(root)}") from e


def _from_json(cls: type, data: Any) -> Any:
    """A dataclass (nested dataclasses and lists of them included) from its JSON; unknown keys are errors, and
    so are missing ones, except fields added later with a default (a file written before them gets it)."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields if f.name in data or f.default is dataclasses.MISSING]
    extra = set(data) - {f.name for f in fields}
    if extra:
        raise ValueError(f"{cls.__name__} has no fields {sorted(extra)}")
    values = {}
    for name in names:
        hint, v = hints[name], data[name]
        if dataclasses.is_dataclass(hint):
            v = _from_json(hint, v)
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            v = [_from_json(typing.get_args(hint)[0], x) for x in v]
        elif typing.get_origin(hint) is dict and dataclasses.is_dataclass(typing.get_args(hint)[1]):
            v = {k: _from_json(typing.get_args(hint)[1], x) for k, x in v.items()}
        values[name] = v
    return cls(**values)


def rebuild_command(root: str | Path, *, prompt_layout: str | None = None) -> str:
    """The `prep build` command line that rebuilds the shards in `root` from scratch with the recorded
    settings (read leniently, so it also works on a build.json of an older schema)."""
    root = Path(root)
    try:
        config = dict(json.loads((root / BUILD_JSON).read_text()).get("config") or {})
    except (OSError, ValueError, AttributeError):
        config = {}
    config.setdefault("videos", "VIDEOS")
    config["out"] = str(root)
    if prompt_layout is not None:
        config["prompt_layout"] = prompt_layout
    args = ["python", "-m", "prep", "build"]
    for key in ("videos", "out", *sorted(k for k in config if k not in ("videos", "out"))):
        value = config[key]
        if key in _NOT_CONTENT:
            continue
        if isinstance(value, bool):  # the build's store_true flags (--allow-outside-videos)
            args += [f"--{key.replace('_', '-')}"] if value else []
            continue
        if key == "shard_size_mb" and value is None:
            value = 0
        if value is None:
            continue
        args += [f"--{key.replace('_', '-')}", str(value)]
    return " ".join(shlex.quote(a) for a in args + ["--overwrite"])
