"""Layout of one sample inside a WebDataset tar shard.

Members of a sample share its key (`SampleRecord.key`): `<key>.json` holds the manifest record plus the
exact token ids; `<key>.f000.jpg`, `<key>.f001.jpg`, ... hold the frames in time order as RGB JPEG already
at (height, width). Nothing else is needed to build the model inputs, so train and predict cannot drift
from what prep decided.
"""
from __future__ import annotations

import dataclasses

from schemas.manifest import SampleRecord, from_dict

JSON_EXT = "json"


def frame_ext(i: int) -> str:
    return f"f{i:03d}.jpg"


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
