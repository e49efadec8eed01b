"""Layout of one sample inside a tar shard, and the one reader of it (train, predict, verify, inspect).

Members of a sample share its key (`SampleRecord.key`): `<key>.json` holds the manifest record plus the
exact token ids; `<key>.f000.jpg`, `<key>.f001.jpg`, ... hold the frames in time order as RGB JPEG already
at (height, width). Nothing else is needed to build the model inputs, so train and predict cannot drift
from what prep decided. The record carries a sha256 of every frame member and of the input_ids, so a
flipped byte is caught when the sample is read, naming shard, member and sample, before a model sees it.

Why our own reader and not webdataset's: the trainer follows a plan (which sample on which rank at which
step, a resumable ledger), so it needs random access to named samples; webdataset is a streaming reader
(shard lists, shuffles, splitters) with no lookup by key. `ShardReader` indexes a plain tar by member
offset once (headers only) and then reads a sample with a few seeks. The tars stay ordinary WebDataset
tars (keys without dots, `<key>.<ext>` members), which tests/test_shard_reader.py proves by reading every
sample back with `webdataset.WebDataset`; webdataset is therefore a test dependency, not a runtime one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import tarfile
from pathlib import Path

from schemas.manifest import SampleRecord, from_dict

JSON_EXT = "json"


def frame_ext(i: int) -> str:
    return f"f{i:03d}.jpg"


def ids_sha256(ids: list[int]) -> str:
    """The digest of a token id list that SampleRecord.input_ids_sha256 records."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


@dataclasses.dataclass(kw_only=True)
class ShardSample:
    """What `<key>.json` holds."""

    record: SampleRecord
    input_ids: list[int]  # the whole sequence: prompt (video blocks expanded) + answer + <|im_end|>
    prompt_tokens: int  # leading positions without a label; the rest are supervised

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self.record), "input_ids": self.input_ids, "prompt_tokens": self.prompt_tokens}

    @classmethod
    def from_json(cls, data: dict) -> "ShardSample":
        return cls(record=from_dict(SampleRecord, data), input_ids=data["input_ids"], prompt_tokens=data["prompt_tokens"])


class ShardError(RuntimeError):
    """A sample (or a whole shard) cannot be read as recorded; the message names shard, member and sample."""

    def __init__(self, message: str, *, shard: str, member: str = "", sample_id: str = ""):
        super().__init__(message)
        self.shard, self.member, self.sample_id = shard, member, sample_id

    def __reduce__(self):
        # Picklable with its fields, so it can leave a DataLoader worker as itself (the default reduce would
        # call ShardError(message) without the keyword-only fields and fail).
        return _shard_error, (type(self), str(self), self.shard, self.member, self.sample_id)


def _shard_error(cls: type, message: str, shard: str, member: str, sample_id: str) -> ShardError:
    return cls(message, shard=shard, member=member, sample_id=sample_id)


@dataclasses.dataclass(frozen=True)
class _Index:
    members: dict[str, tuple[int, int]]  # member name -> (data offset, size)
    file_bytes: int
    error: str = ""  # why the scan stopped early ("" when the whole tar was read)


@dataclasses.dataclass(kw_only=True)
class ReadResult:
    """Everything `ShardReader.check` found for one sample: what it could read and every problem."""

    sample: ShardSample | None  # the parsed `<key>.json`, None when it is missing or unreadable
    frames: list[bytes | None]  # JPEG bytes per frame, None where the member is missing or damaged
    errors: list[ShardError]  # in member order; empty when the sample is exactly as recorded


class ShardReader:
    """Random access to the samples of one build directory by tar member offset.

    Picklable (no open files are kept): DataLoader workers get a copy; `index(shard)` in the parent first
    lets them inherit the offsets instead of rescanning the tars.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._index: dict[str, _Index] = {}

    def _scan(self, shard: str) -> _Index:
        if shard not in self._index:
            path = self.root / shard
            if not path.is_file():
                raise ShardError(f"shard {path} named by the manifest does not exist", shard=shard)
            size = path.stat().st_size
            members: dict[str, tuple[int, int]] = {}
            error = ""
            try:
                # "r:" refuses compressed tars: offsets are only meaningful in a plain tar.
                with tarfile.open(path, "r:") as tar:
                    for info in tar:
                        if info.isfile():
                            members[info.name] = (info.offset_data, info.size)
            except tarfile.TarError as e:
                if not members:
                    raise ShardError(f"shard {path} is not a readable tar: {e}", shard=shard) from e
                error = f"the tar stops being readable after member {next(reversed(members))}: {e}"
            cut = next((n for n, (off, n_bytes) in members.items() if off + n_bytes > size), None)
            if cut is not None:  # the precise reason, whatever tarfile said about the missing rest
                error = f"the shard file ends at byte {size}, inside member {cut} (truncated)"
            self._index[shard] = _Index(members=members, file_bytes=size, error=error)
        return self._index[shard]

    def index(self, shard: str) -> dict[str, tuple[int, int]]:
        """member name -> (data offset, size) of a shard (scanned once, headers only)."""
        return self._scan(shard).members

    def check(self, record: SampleRecord, *, frames: bool = True) -> ReadResult:
        """Read a sample's members and check each against the record; every problem is returned. frames=False:
        the JSON member only (its frames are neither read nor checked; `frames` of the result is empty), for a
        reader that has what it derives from them already (the trainer's vision cache)."""
        errors: list[ShardError] = []
        shard, sid = record.shard, record.sample_id
        try:
            idx = self._scan(shard)
        except ShardError as e:
            return ReadResult(sample=None, frames=[None] * record.num_frames,
                              errors=[ShardError(f"sample {sid}: {e}", shard=shard, sample_id=sid)])

        def fail(name: str, why: str) -> None:
            errors.append(ShardError(f"sample {sid}: {shard}:{name} {why}", shard=shard, member=name, sample_id=sid))

        def member(f, name: str) -> bytes | None:
            if name not in idx.members:
                why = f"; {idx.error}" if idx.error else ""
                errors.append(ShardError(f"sample {sid}: member {name} is missing from shard {shard}{why}",
                                         shard=shard, member=name, sample_id=sid))
                return None
            offset, size = idx.members[name]
            f.seek(offset)
            data = f.read(size)
            if len(data) != size:
                fail(name, f"is truncated: {len(data)} of {size} bytes (the shard file has {idx.file_bytes} bytes)")
                return None
            return data

        sample = None
        frame_bytes: list[bytes | None] = []
        with open(self.root / shard, "rb") as f:
            json_name = f"{record.key}.{JSON_EXT}"
            raw = member(f, json_name)
            if raw is not None:
                try:
                    sample = ShardSample.from_json(json.loads(raw))
                except (ValueError, KeyError, TypeError) as e:
                    fail(json_name, f"is not a sample record ({type(e).__name__}: {e})")
            if sample is not None:
                if sample.record != record:
                    a, b = dataclasses.asdict(sample.record), dataclasses.asdict(record)
                    fail(json_name, f"disagrees with the manifest on {[k for k in b if a[k] != b[k]]}; the manifest "
                                    "and the shards come from different builds")
                elif ids_sha256(sample.input_ids) != record.input_ids_sha256:
                    fail(json_name, "holds input_ids whose sha256 differs from the one recorded at build time "
                                    "(damaged after the build)")
            for i in range(record.num_frames if frames else 0):
                name = f"{record.key}.{frame_ext(i)}"
                data = member(f, name)
                if data is not None and i < len(record.frame_sha256) and hashlib.sha256(data).hexdigest() != record.frame_sha256[i]:
                    fail(name, "differs from the bytes written at build time (sha256 mismatch: damaged after the build)")
                    data = None
                frame_bytes.append(data)
        if len(record.frame_sha256) != record.num_frames:
            errors.append(ShardError(f"sample {sid}: the record lists {len(record.frame_sha256)} frame digests for "
                                     f"num_frames={record.num_frames}", shard=shard, sample_id=sid))
        expected = {json_name} | {f"{record.key}.{frame_ext(i)}" for i in range(record.num_frames)}
        for name in sorted(n for n in idx.members if n.split(".", 1)[0] == record.key and n not in expected):
            fail(name, f"is not part of the sample (num_frames={record.num_frames})")
        return ReadResult(sample=sample, frames=frame_bytes, errors=errors)

    def read(self, record: SampleRecord, *, frames: bool = True) -> tuple[ShardSample, list[bytes]]:
        """The sample's JSON and JPEG bytes (frames=False: no JPEG bytes, see `check`), exactly as recorded;
        raises the first ShardError otherwise."""
        got = self.check(record, frames=frames)
        if got.errors:
            raise got.errors[0]
        return got.sample, got.frames
