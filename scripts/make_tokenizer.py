"""Build the small tokenizer the package ships (schemas/assets/tokenizer).

A byte-level BPE (digits split one by one, as Qwen does) trained on the kind of text the task uses, plus the
Qwen special tokens and a Qwen3-VL style chat template. Tests and the demo use it so nothing needs a hub.
Run: python scripts/make_tokenizer.py [--out schemas/assets/tokenizer]
"""
import argparse
import json
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]

# Qwen3-VL's template, reduced to what video-ora uses: text and video items, no tools.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def corpus(n: int = 4000):
    rng = random.Random(0)
    words = ("keep cut segment segments seconds video window watch the a of and to in is are which parts "
             "worth keeping answer with time times start end none event shape colored moving scene shot "
             "highlight highlights return list json format user assistant system please").split()
    for _ in range(n):
        segs = [[round(rng.uniform(0, 60), 1), round(rng.uniform(0, 60), 1)] for _ in range(rng.randint(0, 3))]
        yield json.dumps(segs)
        yield " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        yield f"<{rng.uniform(0, 60):.1f} seconds>"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "schemas/assets/tokenizer"))
    ap.add_argument("--vocab-size", type=int, default=640)
    args = ap.parse_args()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[1:], model_max_length=262144)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(args.out)
    print(f"wrote {args.out}: {len(fast)} tokens")


if __name__ == "__main__":
    main()
