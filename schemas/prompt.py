"""The prompt layout and its exact tokenization, shared by prep (counting), train (labels) and predict (prompt).

A sample's input is the chat template's user turn with one video item and the query, then the assistant
turn. The chat template renders the video item as `<|vision_start|><|video_pad|><|vision_end|>`; it is
expanded into one block per temporal group, `<{t:.1f} seconds><|vision_start|>` + `<|video_pad|>` x
tokens_per_group + `<|vision_end|>`, with t the window-local group time. Serving stacks and transformers
releases disagree on what happens to the template's own wrapper, so there are two named layouts:

    nested  transformers 5.0-5.24 `Qwen3VLProcessor` (Qwen3-VL and Qwen3.5): only `<|video_pad|>` is
            replaced, the outer `<|vision_start|>`...`<|vision_end|>` stays around the group blocks:
            `<|vision_start|><0.5 seconds><|vision_start|><|video_pad|>...<|vision_end|>...<|vision_end|>`
    flat    transformers >= 5.25 (seen 2026-12-03), 4.57, and vLLM before PR 46957 (issue 46817): the whole
            wrapper is replaced by the group blocks

The default is the installed transformers' own (`processor_layout`), so a build's ids are what that
processor gives. A model only ever sees one of them: the layout a build uses is recorded per sample and in
build.json (with the transformers version), and train/predict refuse shards whose layout differs from the
one asked for, so a transformers upgrade across 5.25 is refused with the rebuild command, never trained on
silently. tests/test_prompt_parity.py compares the default layout's ids with the installed processor's,
token for token.

The supervised span is the answer followed by `<|im_end|>`, always at the end.
"""
from __future__ import annotations

import dataclasses
import re
from functools import lru_cache
from pathlib import Path

BUNDLED_TOKENIZER = Path(__file__).resolve().parent / "assets" / "tokenizer"
VIDEO_ITEM = "<|vision_start|><|video_pad|><|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
LAYOUTS = {
    "nested": "transformers 5.0-5.24 Qwen3VLProcessor (Qwen3-VL, Qwen3.5): the template's "
              "<|vision_start|>...<|vision_end|> kept around the per-group blocks",
    "flat": "transformers >= 5.25 and 4.57, vLLM before PR 46957: the template's wrapper replaced by the per-group "
            "blocks",
}


def processor_layout(transformers_version: str) -> str:
    """The layout transformers' Qwen3VLProcessor of this version expands a video into."""
    release = tuple(int(x) for x in re.findall(r"\d+", transformers_version)[:2])
    return "nested" if (5, 0) <= release < (5, 25) else "flat"


def _installed_layout() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return processor_layout(version("transformers"))
    except PackageNotFoundError:  # a dependency of this package; without it nothing here tokenizes anyway
        return "nested"


DEFAULT_LAYOUT = _installed_layout()
DEFAULT_QUERY = (
    "Watch the video and list the time segments worth keeping, "
    "as JSON [[start, end], ...] in seconds from the start of the clip."
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizedSample:
    input_ids: list[int]
    prompt_tokens: int  # positions before the supervised span (labels -100)
    visual_tokens: int

    @property
    def supervised_tokens(self) -> int:
        return len(self.input_ids) - self.prompt_tokens

    @property
    def text_tokens(self) -> int:
        return len(self.input_ids) - self.visual_tokens


@lru_cache(maxsize=8)
def load_tokenizer(path: str | None = None):
    """The tokenizer at `path` (a model or tokenizer directory), or the small one the package ships."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path or BUNDLED_TOKENIZER))


def special_id(tokenizer, token: str) -> int:
    ids = tokenizer.convert_tokens_to_ids([token])
    if not ids or ids[0] is None or ids[0] == tokenizer.unk_token_id:
        raise ValueError(f"tokenizer has no {token} token; it is not a Qwen-VL tokenizer")
    return ids[0]


def control_tokens_in(tokenizer, text: str) -> list[str]:
    """The tokenizer's added tokens (<|im_end|>, <|video_pad|>, ...) written in `text`. Tokenized, each becomes that
    control token, not its characters, so a query holding one would change the prompt instead of saying something:
    end the user turn early, open a fake assistant turn, add a video pad no frame fills."""
    return sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.content in text})


def check_layout_name(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown prompt layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def group_blocks(group_times_s: list[float], tokens_per_group: int) -> str:
    """The per-group blocks, exactly as Qwen3VLProcessor.replace_video_token writes them."""
    block = "<|vision_start|>" + VIDEO_PAD * tokens_per_group + "<|vision_end|>"
    return "".join(f"<{t:.1f} seconds>" + block for t in group_times_s)


def video_text(group_times_s: list[float], tokens_per_group: int, layout: str) -> str:
    """What the chat template's video item becomes in `layout`."""
    check_layout_name(layout)
    blocks = group_blocks(group_times_s, tokens_per_group)
    return VIDEO_ITEM.replace(VIDEO_PAD, blocks) if layout == "nested" else blocks


def prompt_text(tokenizer, query: str, group_times_s: list[float], tokens_per_group: int, *, layout: str) -> str:
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": query}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if text.count(VIDEO_ITEM) != 1:
        raise ValueError(f"chat template must render one {VIDEO_ITEM} for one video item; got: {text[:200]!r}")
    return text.replace(VIDEO_ITEM, video_text(group_times_s, tokens_per_group, layout))


def tokenize_sample(
    tokenizer, *, query: str, answer: str | None, group_times_s: list[float], tokens_per_group: int, layout: str
) -> TokenizedSample:
    """input_ids for training (answer given) or generation (answer None: prompt only).

    The prompt text is tokenized with one <|video_pad|> per group, repeated tokens_per_group times in the ids: the
    tokenizer splits an added token off before its model sees the text, so these are the ids of the whole text
    (tests/test_prompt_parity.py: the processor's), and a window of 16 groups of 220 pads costs ~0.3 ms instead
    of 3.5 (BENCHMARKS.md, Prep, session 20)."""
    pad = special_id(tokenizer, VIDEO_PAD)
    ids: list[int] = []
    text = prompt_text(tokenizer, query, group_times_s, 1, layout=layout)
    for i in tokenizer(text, add_special_tokens=False)["input_ids"]:
        if i == pad:
            ids += [pad] * tokens_per_group
        else:
            ids.append(i)
    n_prompt = len(ids)
    if answer is not None:
        ids += tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
    visual = ids.count(pad)
    expected = tokens_per_group * len(group_times_s)
    if visual != expected:
        raise ValueError(f"tokenizer produced {visual} video pad tokens, expected {expected}")
    return TokenizedSample(input_ids=ids, prompt_tokens=n_prompt, visual_tokens=visual)


def layout_refusal(found: set[str], asked: str, shards: str | Path, rebuild: str) -> str | None:
    """Why shards tokenized in another layout than `asked` cannot be used (None when they can); `rebuild` is
    the command that rebuilds them in `asked`."""
    if found == {asked}:
        return None
    other = next(iter(sorted(found - {asked})), asked)
    return (f"{shards}: the samples were tokenized with prompt layout {', '.join(sorted(found)) or 'none'}, this run "
            f"asks for --prompt-layout {asked} ({LAYOUTS[asked]}). A model trained on one layout sees tokens it never "
            f"saw when served with the other. Rebuild the shards in this layout: {rebuild}; or pass "
            f"--prompt-layout {other} if your serving stack produces that one")
