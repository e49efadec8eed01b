"""The one package-version collection: build.json, run.json and the benchmark notes all record it this way."""
from __future__ import annotations

import sys
from importlib import metadata

# What decides the bytes of a build or the numbers of a run: decoding, resizing, tokenization, the model
# code, the distributed engine, the serialization.
PACKAGES = ("video-ora", "torch", "transformers", "tokenizers", "deepspeed", "peft", "accelerate", "safetensors",
            "webdataset", "decord", "torchcodec", "av", "pillow", "numpy", "pyarrow")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """{"python": "3.11.9", name: installed version or None} for each name, in order."""
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
