"""A model's shape as the memory planner and the FLOP counter need it, read off the transformers model built
on the meta device from its config (no weights, exact parameter counts, both families)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerShape:
    """One language-model decoder layer (widths in elements)."""

    kind: str  # "full_attention" or "linear_attention"
    params: int
    q: int  # query width (heads x head_dim); full attention only
    kv: int  # key (= value) width
    gate: int  # output-gate width (Qwen3.5 full attention: q_proj also yields a gate), else 0
    conv: int  # linear attention: conv1d channels (2 x key width + value width)
    value: int  # linear attention: value width (in_proj_z / out_proj width)
    v_heads: int  # linear attention: value heads
    lora_inputs: dict  # LoRA-targeted projections of this layer: {input width: how many}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What memory and FLOPs depend on."""

    family: str
    hidden: int
    intermediate: int
    vocab: int
    layers: tuple[LayerShape, ...]
    heads: int
    head_dim: int
    params_total: int
    params_vision: int
    params_embedding: int  # input embeddings (+ the output head when untied)
    largest_param: int  # elements of the largest single tensor (ZeRO-3 gathers it whole)
    vision_hidden: int
    vision_intermediate: int
    vision_depth: int
    vision_heads: int
    vision_out: int  # merged token width (= hidden)
    deepstack: int  # deepstack feature levels (Qwen3-VL: 3; Qwen3.5: 0)
    merge: int  # spatial merge (2: 4 patches per LLM token)
    lora_width: int  # sum of (in + out) over the LoRA-targeted projections: LoRA parameters = r x this
    linear_params: int  # elements in the language model's nn.Linear weights (what --quantize-base quantizes)

    def lora_params(self, r: int) -> int:
        return r * self.lora_width

    @property
    def params_llm_layers(self) -> int:
        return sum(layer.params for layer in self.layers)

    @classmethod
    def from_config(cls, config, *, lora_targets: str | None = None) -> "ModelShape":
        from transformers import AutoModelForImageTextToText

        from train.config import DEFAULT_LORA_TARGETS

        targets = re.compile(lora_targets or DEFAULT_LORA_TARGETS)
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
        text = config.text_config
        lm = model.model.language_model
        layers = []
        lora_total = 0
        for i, layer in enumerate(lm.layers):
            lora_inputs: dict[int, int] = {}
            for name, mod in layer.named_modules():
                if isinstance(mod, torch.nn.Linear) and targets.fullmatch(f"model.language_model.layers.{i}.{name}"):
                    lora_inputs[mod.in_features] = lora_inputs.get(mod.in_features, 0) + 1
                    lora_total += mod.in_features + mod.out_features
            attn = getattr(layer, "self_attn", None)
            lin = getattr(layer, "linear_attn", None)
            heads = getattr(text, "num_attention_heads", 1)
            head_dim = getattr(text, "head_dim", text.hidden_size // heads)
            if attn is not None:
                q = heads * head_dim
                layers.append(LayerShape(kind="full_attention", params=_count(layer), q=q, kv=attn.k_proj.out_features,
                                         gate=attn.q_proj.out_features - q, conv=0, value=0, v_heads=0,
                                         lora_inputs=lora_inputs))
            else:
                layers.append(LayerShape(kind="linear_attention", params=_count(layer), q=0, kv=0, gate=0,
                                         conv=lin.in_proj_qkv.out_features, value=lin.in_proj_z.out_features,
                                         v_heads=lin.in_proj_b.out_features, lora_inputs=lora_inputs))
        vision = config.vision_config
        params = dict(model.named_parameters())
        emb = model.get_input_embeddings().weight.numel()
        if not getattr(config, "tie_word_embeddings", False):
            emb += model.get_output_embeddings().weight.numel()
        linear = sum(m.weight.numel() for m in lm.modules() if isinstance(m, torch.nn.Linear))
        return cls(
            family=config.model_type, hidden=text.hidden_size, intermediate=text.intermediate_size,
            vocab=text.vocab_size, layers=tuple(layers), heads=heads, head_dim=head_dim,
            params_total=sum(p.numel() for p in model.parameters()),
            params_vision=sum(p.numel() for n, p in params.items() if ".visual." in f".{n}"),
            params_embedding=emb, largest_param=max(p.numel() for p in model.parameters()),
            vision_hidden=vision.hidden_size, vision_intermediate=vision.intermediate_size, vision_depth=vision.depth,
            vision_heads=vision.num_heads, vision_out=vision.out_hidden_size,
            deepstack=len(getattr(vision, "deepstack_visual_indexes", None) or []), merge=vision.spatial_merge_size,
            lora_width=lora_total, linear_params=linear)

    @classmethod
    def from_dir(cls, model_dir: str | Path, **kw) -> "ModelShape":
        from transformers import AutoConfig

        return cls.from_config(AutoConfig.from_pretrained(model_dir), **kw)

    @classmethod
    def from_shape_file(cls, name: str, **kw) -> "ModelShape":
        """A shape in train/configs (e.g. qwen3_vl_4b), with the bundled tokenizer's special ids."""
        from schemas.prompt import load_tokenizer
        from train.models import build_config, load_shape

        family, shape = load_shape(name)
        return cls.from_config(build_config(family, shape, load_tokenizer()), **kw)


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())
