"""NVDEC stand-ins for CPU tests of the code around it, run in a fresh interpreter (tests/test_gpu.py runs this
module in subprocesses: the test process has long imported decord and PyAV, and the point is to see what the
processes that open NVDEC have loaded). PyAV decodes the file to NV12 (the layout NVDEC hands out) in a child
process of its own, so, like NVDEC, the stand-in loads neither library into the process that calls it; each
open logs, before anything is decoded, which of them that process had loaded: the tests assert nothing.

    python -m tests.nvdec_standin build VIDEOS OUT CONFIG_JSON LOG   a --device cuda build (prints its summary)
    python -m tests.nvdec_standin call FUNCTION ARGS RESULT LOG      scripts.gpu_decode_probe.FUNCTION(*ARGS),
                                                                     arguments and result as pickle files
"""
from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import types

import numpy as np
import torch

from prep import gpu

_NV12 = """
import sys
import av
import numpy as np
with av.open(sys.argv[1]) as container:
    frames = [f.to_ndarray(format="nv12") for f in container.decode(video=0)]
np.save(sys.stdout.buffer, np.stack(frames))
"""
LOG = {"path": ""}  # JSON lines: each open's pid, file and the decoders its process had loaded


def nv12_frames(path: str) -> list[torch.Tensor]:
    """Every frame of `path` as an NV12 uint8 tensor, decoded by PyAV in a child process; the open is logged."""
    loaded = gpu.clashing_modules()  # before anything is decoded
    with open(LOG["path"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "path": path, "loaded": loaded}) + "\n")
    run = subprocess.run([sys.executable, "-c", _NV12, path], capture_output=True, check=True)
    return [torch.from_numpy(f) for f in np.load(io.BytesIO(run.stdout))]


class PipedNv12Reader(gpu.NvdecReader):
    """NvdecReader with the stand-in's NV12 frames in place of NVDEC's surfaces."""

    def _open(self) -> None:
        self._frames = iter(nv12_frames(self.path))
        self._next = 0

    def close(self) -> None:
        self._frames = None


class _Demuxer:
    def __init__(self, filename: str):
        self._frames = nv12_frames(filename)

    def GetNvCodecId(self) -> int:
        return 0

    def __iter__(self):
        return iter(self._frames)  # one "packet" per frame


class _Decoder:
    def Decode(self, packet) -> list:
        return [] if packet is None else [packet]  # PacketData(): the flush


def standin_nvc() -> types.SimpleNamespace:
    """What prep.gpu.nvc() returns, for the calls prep/gpu.py and the device probe make."""
    return types.SimpleNamespace(CreateDemuxer=lambda filename: _Demuxer(filename),
                                 CreateDecoder=lambda **kw: _Decoder(), PacketData=lambda: None)


def build(videos: str, out: str, config: str) -> None:
    import prep.build

    prep.build.gpu_available = lambda: None  # the rest of the cuda path runs: forked workers inherit these
    gpu.NvdecReader = PipedNv12Reader
    summary = prep.build.build(prep.build.BuildConfig(videos=videos, out=out, device="cuda", **json.loads(config)))
    print(json.dumps(summary))


def call(function: str, args: str, result: str) -> None:
    from scripts import gpu_decode_probe

    gpu.nvc = standin_nvc
    with open(args, "rb") as f:
        value = getattr(gpu_decode_probe, function)(*pickle.load(f))
    with open(result, "wb") as f:
        pickle.dump(value, f)


if __name__ == "__main__":
    verb, *rest, LOG["path"] = sys.argv[1:]
    {"build": build, "call": call}[verb](*rest)
