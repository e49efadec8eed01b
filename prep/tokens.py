"""Prompt layout and exact token counts, shared by prep (counting), train (labels) and predict (prompt).

A sample's input is the chat template's user turn with one video item and the query, then the assistant
turn. The video item expands the way the Qwen3-VL processor expands it: one block per temporal group,
`<{t:.1f} seconds><|vision_start|>` + `<|video_pad|>` x tokens_per_group + `<|vision_end|>`, with t the
window-local group time. The supervised span is the answer followed by `<|im_end|>`, always at the end.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path

BUNDLED_TOKENIZER = Path(__file__).resolve().parent / "assets" / "tokenizer"
VIDEO_ITEM = "<|vision_start|><|video_pad|><|vision_end|>"
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


def video_text(group_times_s: list[float], tokens_per_group: int) -> str:
    """The expanded video item, exactly as Qwen3VLProcessor.replace_video_token writes it."""
    block = "<|vision_start|>" + "<|video_pad|>" * tokens_per_group + "<|vision_end|>"
    return "".join(f"<{t:.1f} seconds>" + block for t in group_times_s)


def prompt_text(tokenizer, query: str, group_times_s: list[float], tokens_per_group: int) -> str:
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": query}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if text.count(VIDEO_ITEM) != 1:
        raise ValueError(f"chat template must render one {VIDEO_ITEM} for one video item; got: {text[:200]!r}")
    return text.replace(VIDEO_ITEM, video_text(group_times_s, tokens_per_group))


def tokenize_sample(
    tokenizer, *, query: str, answer: str | None, group_times_s: list[float], tokens_per_group: int
) -> TokenizedSample:
    """input_ids for training (answer given) or generation (answer None: prompt only)."""
    prompt = tokenizer(prompt_text(tokenizer, query, group_times_s, tokens_per_group), add_special_tokens=False)
    ids = list(prompt["input_ids"])
    n_prompt = len(ids)
    if answer is not None:
        ids += tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
    visual = ids.count(special_id(tokenizer, "<|video_pad|>"))
    expected = tokens_per_group * len(group_times_s)
    if visual != expected:
        raise ValueError(f"tokenizer produced {visual} video pad tokens, expected {expected}")
    return TokenizedSample(input_ids=ids, prompt_tokens=n_prompt, visual_tokens=visual)
