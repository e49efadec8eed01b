"""Speed and memory levers, each proven on CPU not to change the loss: the lever against the reference path
on the tiny models (same seed; one forward/backward with gradients compared, or 5 optimizer steps),
relative difference <= 1e-2 (most are exact up to float reassociation). In-process, no DeepSpeed."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from train.loss import LossSpec, causal_lm_loss
from train.models import load_pretrained

REL = 1e-2
TWO = ["vid_a/w0002", "vid_c/w0000"]  # a landscape and a portrait window: different grids and lengths


def _batch(model_dir: Path, shards: Path, ids: list[str]) -> dict[str, torch.Tensor]:
    from transformers import AutoConfig

    from schemas.prompt import load_tokenizer
    from train.data import SampleStore, VisionSpec, collate

    config = AutoConfig.from_pretrained(model_dir)
    store = SampleStore(shards)
    tensors, _ = collate([store.get(i) for i in ids], VisionSpec.from_model_config(config),
                         video_token_id=config.video_token_id, pad_token_id=load_tokenizer(str(model_dir)).pad_token_id)
    return tensors


def _lora(model_dir: Path, *, seed: int = 0, attn: str = "sdpa", checkpointing: bool = True, dropout: float = 0.0):
    """The trainer's LoRA setup in miniature: frozen base, checkpointing, LoRA (no dropout unless asked) on the LLM."""
    from peft import LoraConfig, get_peft_model

    from train.config import DEFAULT_LORA_TARGETS

    model = load_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    model.config.use_cache = False
    for p in model.parameters():
        p.requires_grad_(False)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=DEFAULT_LORA_TARGETS))
    with torch.no_grad():  # lora_B starts at zero: give it values so every gradient path is exercised
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model.train()


def _loss_and_grads(model, batch, spec: LossSpec) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, batch, spec)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same(a: tuple[float, dict], b: tuple[float, dict], rel: float = REL) -> None:
    assert a[0] == pytest.approx(b[0], rel=rel), (a[0], b[0])
    assert a[1].keys() == b[1].keys() and a[1]
    for k in a[1]:
        scale = a[1][k].abs().max().item() + 1e-12
        assert (a[1][k] - b[1][k]).abs().max().item() <= rel * scale, k


REFERENCE = LossSpec(impl="torch", full_logits=True)  # the model's own loss over every position


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_chunked_vision_gives_the_model_own_embeddings(tiny_cache, family):
    """Two videos of different grids; chunks that split a video, span two videos, or hold everything."""

    from train.vision import encode_videos, plan_chunks

    model = load_pretrained(tiny_cache / f"tiny_{family}", dtype=torch.float32).eval()
    grids = torch.tensor([[8, 6, 10], [5, 4, 4]])
    torch.manual_seed(0)
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 16 * 16)
    with torch.no_grad():
        ref = model.model.get_video_features(pixels, grids, return_dict=True)
    assert [[(s.video, s.t0, s.t1) for s in c] for c in plan_chunks([(8, 6, 10), (5, 4, 4)], 3)] == \
        [[(0, 0, 3)], [(0, 3, 6)], [(0, 6, 8), (1, 0, 1)], [(1, 1, 4)], [(1, 4, 5)]]
    for frames in (0, 2, 6, 16, 100):
        got = encode_videos(model, pixels, grids, chunk_frames=frames)
        assert [p.shape for p in got.pooler_output] == [p.shape for p in ref.pooler_output]
        for a, b in zip(got.pooler_output, ref.pooler_output):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for la, lb in zip(getattr(got, "deepstack_features", None) or [], getattr(ref, "deepstack_features", None) or []):
            for a, b in zip(la, lb):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not got.pooler_output[0].requires_grad  # no graph was built
    with pytest.raises(ValueError, match="multiple of the temporal patch size 2"):
        encode_videos(model, pixels, grids, chunk_frames=3)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_vision_levers_and_loss_impls_give_the_model_own_loss_and_gradients(tiny_cache, built_shards, family):
    """One forward/backward of a padded 2-sample batch through LoRA: every loss implementation, with and
    without the vision tower run apart (no grad, 4-frame chunks), against the model's own loss."""
    model_dir = tiny_cache / f"tiny_{family}"
    batch = _batch(model_dir, built_shards, TWO)
    assert batch["attention_mask"].min() == 0  # padded: the two samples differ in length
    model = _lora(model_dir)
    ref = _loss_and_grads(model, batch, REFERENCE)
    levers = [LossSpec(impl="torch"), LossSpec(impl="chunked", chunk_positions=7),
              LossSpec(impl="chunked", vision_no_grad=True, vision_chunk_frames=4),
              LossSpec(impl="torch", vision_no_grad=True)]
    for spec in levers:
        _assert_same(_loss_and_grads(model, batch, spec), ref)


def test_attention_paths_and_checkpointing_levels_give_the_same_loss_and_gradients(tiny_cache, built_shards):
    """sdpa vs eager; checkpointing all / none / every-2 / all-but-1 / all with saved inputs offloaded to host."""
    from train.activations import Checkpointing, apply_checkpointing

    model_dir = tiny_cache / "tiny_qwen3_vl"
    batch = _batch(model_dir, built_shards, TWO)
    spec = LossSpec(impl="chunked", vision_no_grad=True)
    ref = _loss_and_grads(_lora(model_dir, attn="eager"), batch, spec)
    _assert_same(_loss_and_grads(_lora(model_dir, attn="sdpa"), batch, spec), ref)
    for level, offload in (("none", False), ("every-2", False), ("all-but-1", False), ("all", True)):
        model = _lora(model_dir, checkpointing=False)
        chosen = apply_checkpointing(model.get_base_model(), Checkpointing.parse(level), offload=offload)
        assert chosen == {"none": [], "every-2": [0], "all-but-1": [0], "all": [0, 1]}[level]
        if offload:  # every checkpointed layer runs through the host-copy checkpoint (its own code path)
            from train.activations import checkpoint_from_host, decoder_layers

            assert all(layer._gradient_checkpointing_func is checkpoint_from_host
                       for layer in decoder_layers(model.get_base_model()))
        _assert_same(_loss_and_grads(model, batch, spec), ref)
    with pytest.raises(ValueError, match="every-K"):
        Checkpointing.parse("every-0")


def test_no_dense_mask_reaches_attention_when_causal_suffices(tiny_cache, built_shards):
    """One unpadded sample: the language model's attention gets no mask (sdpa runs is_causal); a padded
    batch still gets one."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    seen = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        if getattr(module, "is_causal", False):  # language-model layers (the vision tower is bidirectional)
            seen.append(None if attention_mask is None else tuple(attention_mask.shape))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("probe_sdpa", probe)
    AttentionMaskInterface.register("probe_sdpa", sdpa_mask)
    model_dir = tiny_cache / "tiny_qwen3_vl"
    model = load_pretrained(model_dir, dtype=torch.float32, attn_implementation="probe_sdpa")
    with torch.no_grad():
        causal_lm_loss(model, _batch(model_dir, built_shards, TWO[:1]), LossSpec(impl="torch"))
        assert seen and all(s is None for s in seen), seen
        seen.clear()
        causal_lm_loss(model, _batch(model_dir, built_shards, TWO), LossSpec(impl="torch"))
        assert seen and all(s is not None and len(s) == 4 for s in seen), seen


def test_chunked_loss_trains_a_trainable_lm_head_like_the_model_loss(tiny_cache, built_shards):
    """Full fine-tune (lm_head tied to the trained embeddings): its gradient through the chunked loss too."""

    model_dir = tiny_cache / "tiny_qwen3_vl"
    batch = _batch(model_dir, built_shards, TWO)
    model = load_pretrained(model_dir, dtype=torch.float32).train()
    for name, p in model.named_parameters():
        p.requires_grad_(".visual." not in f".{name}")
    ref = _loss_and_grads(model, batch, REFERENCE)
    assert "lm_head.weight" in ref[1] or "model.language_model.embed_tokens.weight" in ref[1]
    _assert_same(_loss_and_grads(model, batch, LossSpec(impl="chunked", chunk_positions=5, vision_no_grad=True)), ref)


def _packed_batch(model_dir: Path, shards: Path, ids: list[str]) -> dict[str, torch.Tensor]:
    from transformers import AutoConfig

    from schemas.prompt import load_tokenizer
    from train.data import SampleStore, VisionSpec, collate

    config = AutoConfig.from_pretrained(model_dir)
    store = SampleStore(shards)
    tensors, meta = collate([store.get(i) for i in ids], VisionSpec.from_model_config(config),
                            video_token_id=config.video_token_id,
                            pad_token_id=load_tokenizer(str(model_dir)).pad_token_id, pack=True)
    assert tensors["input_ids"].shape == (1, sum(meta.input_tokens)) == (1, meta.padded_tokens)
    return tensors


@pytest.mark.parametrize("attn,checkpointing", [("sdpa", True), ("eager", True), ("sdpa", False)])
def test_packed_row_gives_the_padded_batch_loss_and_gradients(tiny_cache, built_shards, attn, checkpointing):
    """Three samples of different lengths and grids in one row: the same loss (per supervised token) and
    LoRA gradients as the right-padded batch, i.e. per-sample positions and no attention across samples.
    Without checkpointing too: transformers finds the boundaries only when no KV cache is passed, and the
    text model's own config would create one."""
    from train.packing import packed_position_ids
    from train.vision import inner_model

    ids = TWO + ["vid_b/w0001"]
    model_dir = tiny_cache / "tiny_qwen3_vl"
    model = _lora(model_dir, attn=attn, checkpointing=checkpointing)
    padded, packed = _batch(model_dir, built_shards, ids), _packed_batch(model_dir, built_shards, ids)
    # positions: each sample numbered as alone (text row restarts; mRoPE rows equal the padded batch's)
    lengths = packed["pack_lengths"].tolist()
    pos = packed_position_ids(model, packed["input_ids"], packed["mm_token_type_ids"], packed["video_grid_thw"], lengths)
    ref_pos, _ = inner_model(model).get_rope_index(padded["input_ids"], padded["mm_token_type_ids"],
                                                   video_grid_thw=padded["video_grid_thw"],
                                                   attention_mask=padded["attention_mask"])
    start = 0
    for i, n in enumerate(lengths):
        assert pos[0, 0, start:start + n].tolist() == list(range(n))
        assert torch.equal(pos[1:, 0, start:start + n], ref_pos[:, i, :n])
        start += n
    spec = LossSpec(impl="chunked", vision_no_grad=True, vision_chunk_frames=4)
    ref, got = _loss_and_grads(model, padded, REFERENCE), _loss_and_grads(model, packed, spec)
    _assert_same(got, ref)
    # without the per-sample positions and boundaries the samples see each other: far larger differences
    leaky = _loss_and_grads(model, {k: v for k, v in packed.items() if k != "pack_lengths"}, spec)

    def worst(a):
        return max((a[1][k] - ref[1][k]).abs().max().item() / ref[1][k].abs().max().item() for k in ref[1])

    assert worst(leaky) > 100 * max(worst(got), 1e-7), (worst(leaky), worst(got))


@pytest.mark.parametrize("checkpointing", [True, False])
def test_segment_attention_gives_the_padded_batch_loss_without_a_mask(tiny_cache, built_shards, checkpointing,
                                                                       monkeypatch):
    """--segment-attention: the packed row's loss and LoRA gradients equal the right-padded batch's, and every
    language-model sdpa call is causal over one sample with no mask (flash / cuDNN territory); the dense-mask
    path it replaces hands sdpa an [L, L] mask. Checkpointing recomputes the attention in backward from the
    same positions."""
    import torch.nn.functional as F

    from train.packing import SEGMENT_ATTENTION, use_segment_attention
    from train.vision import inner_model

    ids = TWO + ["vid_b/w0001"]
    model_dir = tiny_cache / "tiny_qwen3_vl"
    padded, packed = _batch(model_dir, built_shards, ids), _packed_batch(model_dir, built_shards, ids)
    lengths = packed["pack_lengths"].tolist()
    spec = LossSpec(impl="chunked", vision_no_grad=True, vision_chunk_frames=4)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, is_causal=False, **kwargs):
        calls.append((q.shape[2], attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask, *args, is_causal=is_causal, **kwargs)

    model = _lora(model_dir, checkpointing=checkpointing)
    ref = _loss_and_grads(model, padded, REFERENCE)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    masked = _loss_and_grads(model, packed, spec)  # transformers' block mask over the whole row
    assert {c[0] for c in calls if c[0] > 200} == {sum(lengths)} and not any(c[1] for c in calls if c[0] > 200)
    assert use_segment_attention(model) == {"language_model": SEGMENT_ATTENTION, "was": "sdpa"}
    assert inner_model(model).visual.config._attn_implementation == "sdpa"  # the tower keeps its own
    calls.clear()
    got = _loss_and_grads(model, packed, spec)
    _assert_same(got, ref)
    _assert_same(got, masked)
    layers = len(inner_model(model).language_model.layers)
    text = [c for c in calls if c[0] in lengths]
    per_pass = layers * len(lengths)
    assert len(text) == per_pass * (2 if checkpointing else 1), (len(text), per_pass)
    assert all(no_mask and causal for _, no_mask, causal in text)
    assert sorted(c[0] for c in text[:per_pass]) == sorted(lengths * layers)
    assert not any(c[0] == sum(lengths) for c in calls)  # the whole row is never one attention call


def test_row_lengths_follow_the_text_positions():
    from train.packing import row_lengths

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert row_lengths(pos) == [3, 2, 4]
    assert row_lengths(pos) is row_lengths(pos)  # read to the host once per row, not once per layer
    assert row_lengths(torch.arange(5).view(1, 5)) == [5]


def test_packing_plans_by_the_sum_of_tokens_and_the_ledger_stays_exact(built_shards):
    from schemas.manifest import SampleRecord, read_records
    from train.plan import PlanConfig, PlanError, plan_epoch

    records = read_records(built_shards / "manifest.parquet", SampleRecord)
    tokens = {r.sample_id: r.input_tokens for r in records}
    budget = 1100  # lengths 187..324: packing fits 4 samples of 315/196 where padding fits 3
    padded = plan_epoch(records, PlanConfig(world_size=1, max_tokens_per_batch=budget, tail="pad"), 0)
    packed = plan_epoch(records, PlanConfig(world_size=1, max_tokens_per_batch=budget, tail="pad", pack=True), 0)
    mbs = [mb for step in packed.steps for rank in step for mb in rank]
    assert all(sum(tokens[s] for s in mb.sample_ids) <= budget for mb in mbs)
    # counted without padding: some packed micro-batch would not fit as a padded batch (longest x samples)
    assert any(max(tokens[s] for s in mb.sample_ids) * len(mb.sample_ids) > budget for mb in mbs)
    assert all(max(tokens[s] for s in mb.sample_ids) * len(mb.sample_ids) <= budget
               for step in padded.steps for rank in step for mb in rank)
    assert sorted(packed.sample_ids()) == sorted(tokens)  # every sample exactly once (the ledger's proof)
    assert "packed row <= " in packed.describe()
    with pytest.raises(PlanError, match="pack needs max_tokens_per_batch"):
        PlanConfig(world_size=1, pack=True)


def test_gpu_only_levers_are_refused_on_cpu_with_the_reason(tmp_path, built_shards):
    from train.config import ConfigError, parse_config
    from train.kernels import KernelError, attention_problem, route_linear_attention
    from train.loss import liger_problem

    cpu = torch.device("cpu")
    assert attention_problem("sdpa", "cpu") is None and attention_problem("eager", "cpu") is None
    assert "needs a CUDA device" in attention_problem("flash_attention_2", "cpu")
    assert "--loss-impl liger needs CUDA" in liger_problem()
    with pytest.raises(KernelError, match="--linear-attention fla: flash-linear-attention is Triton code and needs a CUDA"):
        route_linear_attention("fla", cpu)
    base = ["--shards", str(built_shards), "--output-dir", str(tmp_path)]
    with pytest.raises(ConfigError) as e:
        parse_config(base + ["--finetune", "full", "--quantize-base", "nf4", "--zero-stage", "3", "--loss-impl", "liger",
                             "--pack", "--unfreeze-merger", "--vision-no-grad", "--gradient-checkpointing", "every-0",
                             "--vision-chunk-frames", "3", "--preset", "video-ora-zero3"])
    msg = str(e.value)
    for part in ("--quantize-base trains LoRA adapters", "cannot be ZeRO-3 partitioned", "--loss-impl liger computes",
                 "--pack fills micro-batches up to a token budget", "a trained tower needs its gradients",
                 "choose auto|all|none|every-K", "--vision-chunk-frames must be 0 or a positive even number"):
        assert part in msg, msg
    with pytest.raises(ConfigError, match="--preset video-ora-zero3 is ZeRO-3; --zero-stage 2 contradicts it"):
        parse_config(base + ["--preset", "video-ora-zero3", "--zero-stage", "2"])
    assert parse_config(base + ["--zero-stage", "auto"]).zero_stage is None
    assert parse_config(base + ["--no-gradient-checkpointing"]).gradient_checkpointing == "none"
    assert parse_config(base + ["--gradient-checkpointing"]).gradient_checkpointing == "all"
    frozen = parse_config(base)
    assert frozen.vision_without_grad and not parse_config(base + ["--unfreeze-merger"]).vision_without_grad


def test_linear_attention_routing_and_its_correctness_probe():
    """torch forces the plain bodies (fla or not); the probe passes an identical implementation and catches
    one that is 5% off (what a wrong-gradient Triton kernel would look like)."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as mod

    from train.kernels import LINEAR_FUNCTIONS, probe_gated_delta_rule, route_linear_attention

    choice = route_linear_attention("auto", torch.device("cpu"))
    assert choice.implementation == "torch" and "CUDA" in choice.reason
    for name in LINEAR_FUNCTIONS:
        fn = getattr(mod, name)
        assert inspect.unwrap(fn) is fn, name  # the plain torch body, no dispatching wrapper
    body = mod.torch_chunk_gated_delta_rule
    ok, worst = probe_gated_delta_rule(body, body, torch.device("cpu"))
    assert ok and worst == 0.0

    def off(q, k, v, **kw):
        out, state = body(q, k, v, **kw)
        return out * 1.05, state

    ok, worst = probe_gated_delta_rule(off, body, torch.device("cpu"))
    assert not ok and worst == pytest.approx(0.1025, rel=1e-3)  # output 5% off, gradients of out^2 10.25%


def test_zero3_sharding_check_fails_with_the_numbers_when_nothing_is_partitioned():
    """The passing case runs for real in test_train_main's 2-rank ZeRO-3 run; here a model DeepSpeed never
    partitioned, as 2 ranks would see it."""
    from train.zero import sharding_report

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    report = sharding_report(model, rank=1, world=2)
    assert not report.ok and report.resident_bytes == report.total_bytes == report.unpartitioned_bytes
    assert "rank 1 of 2: holds 0.02 MiB of 0.02 MiB" in report.message() and "NOT SHARDED" in report.message()
    assert sharding_report(model, rank=0, world=1).ok  # one rank: the whole model is the partition


def test_quantized_base_config_plumbing_and_refusal_on_cpu():
    from train.quantize import SKIP_MODULES, from_pretrained_kwargs, quantization_kwargs, quantize_problem

    nf4 = quantization_kwargs("nf4")
    assert nf4["load_in_4bit"] and nf4["bnb_4bit_quant_type"] == "nf4" and nf4["bnb_4bit_compute_dtype"] == torch.bfloat16
    assert quantization_kwargs("int8")["load_in_8bit"] and nf4["llm_int8_skip_modules"] == SKIP_MODULES
    assert "visual" in SKIP_MODULES and "lm_head" in SKIP_MODULES  # frozen tower and the chunked loss's weight stay bf16
    assert from_pretrained_kwargs(None, 0) == {}
    assert "needs a CUDA device" in quantize_problem("cpu")
    with pytest.raises(ValueError, match="choose nf4 or int8"):
        quantization_kwargs("fp8")


def test_load_check_reads_a_4bit_packed_weight_and_its_quant_state_entries():
    """bitsandbytes packs a 4-bit weight into [n/2, 1] storage and adds q_proj.weight.absmax-style state-dict
    entries (measured on the H200: the load check raised on them before the first step)."""
    from train.load_check import _persistent_buffer, logical_shape

    class QuantState:
        shape = torch.Size([8, 4])

    packed = torch.nn.Parameter(torch.zeros(16, 1, dtype=torch.uint8), requires_grad=False)
    packed.quant_state = QuantState()
    assert logical_shape(packed) == (8, 4) and logical_shape(torch.zeros(3, 5)) == (3, 5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8))
    model.register_buffer("scale", torch.ones(1))
    assert not _persistent_buffer(model, "0.weight.absmax")  # a tensor's attribute, not a module's buffer
    assert _persistent_buffer(model, "scale")


def test_trainer_refuses_levers_this_device_or_family_cannot_run(tmp_path, built_shards):
    """The trainer's own check (before any weight loads): Qwen3.5 packing, and the CUDA-only flags on CPU."""
    from train.config import ConfigError, parse_config
    from train.main import Recipe

    class Log:
        def event(self, *a, **k):
            pass

        def say(self, *a):
            pass

    def check(family: str, *flags: str):
        recipe = Recipe(parse_config(["--shards", str(built_shards), "--output-dir", str(tmp_path), *flags]))
        recipe.device, recipe.family, recipe.log = torch.device("cpu"), family, Log()
        recipe._check_levers()

    check("qwen3_vl", "--pack", "--max-tokens-per-batch", "2000")  # fine
    with pytest.raises(ConfigError) as e:
        check("qwen3_5", "--pack", "--max-tokens-per-batch", "2000", "--mem-cap-gib", "12", "--quantize-base", "nf4",
              "--zero-stage", "2", "--attention", "flash_attention_2", "--liger-kernels")
    msg = str(e.value)
    for part in ("--pack with Qwen3.5: its linear-attention layers", "--mem-cap-gib needs a CUDA device",
                 "--liger-kernels needs a CUDA device",
                 "--quantize-base needs a CUDA device", "--attention flash_attention_2 needs a CUDA device"):
        assert part in msg, msg


def test_liger_falls_back_to_its_ops_function_when_its_transformers_patches_do_not_import(monkeypatch):
    """liger-kernel 0.8.5's transformers integration fails on transformers 5.24; its ops-level function is called
    by parameter name instead (here a stand-in with liger's signature computing the same cross-entropy)."""
    import sys
    import types

    import torch.nn.functional as F

    from train import loss

    class FakeFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, _input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
                    label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False):
            assert ignore_index == -100 and reduction == "mean" and bias is None
            return F.cross_entropy(F.linear(_input, weight).float(), target), None

    ops = types.ModuleType("liger_kernel.ops.fused_linear_cross_entropy")
    ops.LigerFusedLinearCrossEntropyFunction = FakeFunction
    broken = types.ModuleType("liger_kernel.transformers.fused_linear_cross_entropy")
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.ops", types.ModuleType("liger_kernel.ops"))
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_linear_cross_entropy", ops)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.fused_linear_cross_entropy", broken)  # no class in it
    fn, errors = loss._liger_loss_fn()
    assert fn is not None and "liger_kernel.transformers" in errors[0]
    torch.manual_seed(0)
    w, h, t = torch.randn(50, 8), torch.randn(6, 8), torch.randint(0, 50, (6,))
    torch.testing.assert_close(fn(w, h, t), F.cross_entropy(F.linear(h, w), t))


def test_zero3_keeps_parameters_whole_only_on_one_rank_without_offload_or_an_explicit_threshold(tmp_path, built_shards):
    from train.config import ONE_RANK_PERSISTENCE, parse_config, resolve_deepspeed_config

    def threshold(world: int, *flags: str) -> float:
        cfg = parse_config(["--shards", str(built_shards), "--output-dir", str(tmp_path), "--zero-stage", "3", *flags])
        return resolve_deepspeed_config(cfg, world, 10)["zero_optimization"]["stage3_param_persistence_threshold"]

    assert threshold(1) == ONE_RANK_PERSISTENCE
    assert threshold(2) == 1e4  # partitioning is the point with more ranks
    assert threshold(1, "--param-persistence-threshold", "1e5") == 1e5
    assert threshold(1, "--offload-params") == 1e4
    assert threshold(1, "--preset", "video-ora-zero3") == 1e4  # the original run's config, as it was
    from train.config import ConfigError

    with pytest.raises(ConfigError, match="--compile and --liger-kernels both fuse"):
        parse_config(["--shards", str(built_shards), "--output-dir", str(tmp_path), "--compile", "--liger-kernels"])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_decoder_layers_give_the_eager_loss_and_gradients(tiny_cache, built_shards, checkpointing):
    """--compile: every Qwen3-VL decoder layer compiled in place, with LoRA and checkpointing inside, gives the
    eager loss and LoRA gradients. Traced with the aot_eager backend on CPU (dynamo + AOTAutograd, the parts
    that meet PEFT and checkpointing; inductor's kernels are compared by the GPU bench's loss column)."""
    import torch._dynamo

    from train.kernels import compile_layers

    model_dir = tiny_cache / "tiny_qwen3_vl"
    batch = _batch(model_dir, built_shards, TWO)
    spec = LossSpec(impl="chunked", vision_no_grad=True)
    ref = _loss_and_grads(_lora(model_dir, checkpointing=checkpointing), batch, spec)
    model = _lora(model_dir, checkpointing=checkpointing)
    torch._dynamo.reset()
    assert compile_layers(model, backend="aot_eager") == 2  # the two text layers, not the vision blocks
    torch._dynamo.utils.counters.clear()
    _assert_same(_loss_and_grads(model, batch, spec), ref, rel=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the layers really ran compiled
    torch._dynamo.reset()


def test_models_load_with_the_hubs_kernels_off(tiny_cache):
    """transformers >= 5.25 kernelizes every model from_pretrained loads unless told not to (kernels fetched
    from the Hub, which offline clusters never reach): the package's one loader tells it not to."""
    assert not load_pretrained(tiny_cache / "tiny_qwen3_vl", dtype=torch.float32).use_kernels


def test_offloaded_checkpoints_save_host_copies_not_the_layer_inputs(tiny_cache, built_shards):
    """--offload-activations: among every tensor autograd keeps for backward (seen through saved-tensor hooks
    around the forward), none shares storage with a decoder layer's input; each checkpointed layer keeps its
    own host copy instead (on CPU the copy is forced, so the check means the same as on a GPU)."""
    from train.activations import Checkpointing, apply_checkpointing, decoder_layers

    model_dir = tiny_cache / "tiny_qwen3_vl"
    batch = _batch(model_dir, built_shards, TWO)
    model = _lora(model_dir, checkpointing=False)
    layers = decoder_layers(model.get_base_model())
    apply_checkpointing(model.get_base_model(), Checkpointing.parse("all"), offload=True)
    layer_inputs: list[torch.Tensor] = []  # held, so no later tensor can reuse their memory (and address)
    for layer in layers:
        layer.register_forward_pre_hook(lambda m, args: layer_inputs.append(args[0]))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = causal_lm_loss(model, batch, LossSpec(impl="chunked", vision_no_grad=True))
    assert len(layer_inputs) == len(layers) == 2
    inputs = {t.untyped_storage().data_ptr() for t in layer_inputs}
    assert not [t.shape for t in saved if t.untyped_storage().data_ptr() in inputs]
    hidden = [t for t in saved if t.dim() == 3 and t.shape[-1] == model.config.text_config.hidden_size]
    assert len(hidden) >= len(layers)  # the host copies (and the final norm's input)
    loss.backward()  # and backward still runs from them


def test_fused_grad_checks_give_deepspeeds_norm_and_overflow_verdict_in_a_few_ops(tmp_path):
    """A real one-rank ZeRO-2 bf16 engine on CPU: the fused norm equals DeepSpeed's per-tensor one, both see a
    NaN gradient (norm -> DeepSpeed's -1 sentinel, overflow -> the step is skipped), and the fused checks issue
    a constant number of ops where DeepSpeed's grow with the tensor count."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "checks.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    subprocess.run([sys.executable, "-m", "tests.grad_checks_worker", str(out)], check=True, timeout=240, env=env,
                   cwd=Path(__file__).resolve().parents[1])
    r = json.loads(out.read_text())
    assert r["replaced"] == ["has_overflow_partitioned_grads_serial", "get_grad_norm_direct"]
    assert r["tensors"] == 48
    ds, fused = r["finite"]["deepspeed"], r["finite"]["fused"]
    assert ds["overflow"] is fused["overflow"] is False
    assert fused["norm"] == pytest.approx(ds["norm"], rel=1e-6) and ds["norm"] > 0
    assert r["nan"]["deepspeed"]["overflow"] is r["nan"]["fused"]["overflow"] is True
    assert r["nan"]["deepspeed"]["norm"] == r["nan"]["fused"]["norm"] == -1.0
    assert r["nan_step_skipped"] and r["grad_norm_after_nan"] == float("inf")
    assert fused["ops"] <= 30 < 4 * r["tensors"] < ds["ops"], (fused["ops"], ds["ops"])  # 23 vs 831 measured
    z3 = r["stage3"]  # ZeRO-3: only the norm is replaced (its inf/NaN check reads one flat buffer already)
    assert z3["replaced"] == ["get_grad_norm_direct"] and z3["tensors"] == 48
    assert z3["finite"]["fused"]["norm"] == pytest.approx(z3["finite"]["deepspeed"]["norm"], rel=1e-6)
    assert z3["finite"]["deepspeed"]["norm"] > 0
    assert z3["nan"]["fused"]["norm"] == z3["nan"]["deepspeed"]["norm"] == -1.0
    assert z3["finite"]["fused"]["ops"] <= 20 < 2 * z3["tensors"] <= z3["finite"]["deepspeed"]["ops"]  # 13 vs 107


def test_one_rank_allreduce_skip_steps_the_parameters_as_deepspeed_does(tmp_path):
    """ZeRO-0 on one rank: the all-reduce replaced by its one lasting effect (a trainable tensor without a gradient
    gets zeros) gives the same parameters after every step as DeepSpeed's own (clipping and weight decay on)."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "allreduce.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    subprocess.run([sys.executable, "-m", "tests.grad_checks_worker", str(out), "allreduce"], check=True, timeout=240,
                   env=env, cwd=Path(__file__).resolve().parents[1])
    r = json.loads(out.read_text())
    assert r["skipped"] == [False, True]
    assert r["equal"] == [True, True, True]
    assert r["unused_moved"] == [[True, True]] * 3  # weight decay stepped the zero-gradient tensor in both


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_batched_vision_attention_gives_the_tower_own_features_in_one_call_per_block(tiny_cache, family):
    """Equal temporal groups (one video, or two of the same size) run one sdpa call per block and give the
    model's own features; unequal groups (two grids) fall back to transformers' forward, same features."""
    from unittest import mock


    from train.kernels import batch_vision_attention

    model = load_pretrained(tiny_cache / f"tiny_{family}", dtype=torch.float32,
                                                        attn_implementation="sdpa").eval()
    blocks = len(model.model.visual.blocks)
    cases = {"one video": [[6, 4, 6]], "two equal videos": [[4, 4, 6], [2, 4, 6]], "two grids": [[4, 6, 10], [3, 4, 4]]}
    torch.manual_seed(0)
    with torch.no_grad():
        inputs = {k: (torch.tensor(g), torch.randn(int(torch.tensor(g).prod(-1).sum()), 3 * 2 * 16 * 16))
                  for k, g in cases.items()}
        refs = {k: model.model.get_video_features(p, g, return_dict=True) for k, (g, p) in inputs.items()}
        assert batch_vision_attention(model) == blocks
        sdpa = torch.nn.functional.scaled_dot_product_attention
        for k, (g, p) in inputs.items():
            with mock.patch("torch.nn.functional.scaled_dot_product_attention", side_effect=sdpa) as spy:
                got = model.model.get_video_features(p, g, return_dict=True)
            segments = int(g[:, 0].sum())
            assert spy.call_count == (blocks * segments if k == "two grids" else blocks), (k, spy.call_count)
            for a, b in zip(got.pooler_output, refs[k].pooler_output):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            for la, lb in zip(getattr(got, "deepstack_features", None) or [], getattr(refs[k], "deepstack_features", None) or []):
                for a, b in zip(la, lb):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_kept_attention_is_not_recomputed_and_gives_the_same_loss_and_gradients(tiny_cache, built_shards):
    """--no-recompute-attention: every checkpointed layer's sdpa op runs once (not again in backward), and the
    loss and LoRA gradients equal full recomputation."""
    from train.activations import SDPA_OPS, Checkpointing, apply_checkpointing, decoder_layers

    model_dir = tiny_cache / "tiny_qwen3_vl"
    batch = _batch(model_dir, built_shards, TWO[:1])  # one unpadded sample: no mask, the sdpa kernel runs
    spec = LossSpec(impl="chunked", vision_no_grad=True)
    from tests.train_helpers import op_counter

    runs, calls = {}, {}
    for keep in (False, True):
        model = _lora(model_dir, checkpointing=False)
        chosen = apply_checkpointing(model.get_base_model(), Checkpointing.parse("all"), keep_attention=keep)
        with op_counter(lambda name: name in SDPA_OPS) as counter:
            runs[keep] = _loss_and_grads(model, batch, spec)
        calls[keep] = counter.ops
    layers = len(decoder_layers(model.get_base_model()))
    assert chosen == list(range(layers)) and calls[True] > 0
    assert calls[False] - calls[True] == layers, calls  # the recomputation's attention calls are gone
    _assert_same(runs[True], runs[False], rel=1e-5)


def test_liger_kernels_default_covers_qwen3_5_only_where_its_entry_point_imports(monkeypatch):
    import importlib.machinery
    import sys
    import types

    from train.kernels import liger_kernels_default

    def fake_liger(with_qwen3_5: bool):
        root, sub = types.ModuleType("liger_kernel"), types.ModuleType("liger_kernel.transformers")
        root.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
        if with_qwen3_5:
            sub.apply_liger_kernel_to_qwen3_5 = lambda **kw: None
        root.transformers = sub
        monkeypatch.setitem(sys.modules, "liger_kernel", root)
        monkeypatch.setitem(sys.modules, "liger_kernel.transformers", sub)

    fake_liger(True)
    assert liger_kernels_default("qwen3_5", compile=False, device_type="cuda")
    assert liger_kernels_default("qwen3_vl", compile=False, device_type="cuda")
    assert not liger_kernels_default("qwen3_5", compile=True, device_type="cuda")
    assert not liger_kernels_default("qwen3_5", compile=False, device_type="cpu")
    fake_liger(False)  # a liger older than 0.8.0: Qwen3.5 stays off, Qwen3-VL on
    assert not liger_kernels_default("qwen3_5", compile=False, device_type="cuda")
    assert liger_kernels_default("qwen3_vl", compile=False, device_type="cuda")


def _saved_activation_bytes(model, batch, spec: LossSpec) -> int:
    """Bytes of the distinct storages autograd keeps for backward over one forward, parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # held, so no storage is freed and its address reused mid-forward

    def pack(t):
        keep.append(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        causal_lm_loss(model, batch, spec)
    return sum(saved.values())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_recomputed_lora_dropout_draws_peft_masks_and_keeps_only_the_inputs(tiny_cache, built_shards, checkpointing):
    """--recompute-lora-dropout: the same loss and gradients as PEFT's branch with the same dropout seed (a
    different seed moves them, so the masks really matter here), and autograd keeps what LoRA without dropout
    keeps instead of one dropout output and mask per projection."""
    from train.lora_dropout import recompute_lora_dropout

    model_dir = tiny_cache / "tiny_qwen3_vl"
    batch = _batch(model_dir, built_shards, TWO)
    spec = LossSpec(impl="chunked", vision_no_grad=True)
    peft = _lora(model_dir, checkpointing=checkpointing, dropout=0.3)
    lever = _lora(model_dir, checkpointing=checkpointing, dropout=0.3)
    n = recompute_lora_dropout(lever)
    assert n == {"projections": sum(1 for name, _ in peft.named_modules() if name.endswith(".lora_A")), "mlps": 0,
                 "sibling_groups": 0, "single_groups": 0}
    assert n["projections"] > 0
    runs = {}
    for name, model, seed in (("peft", peft, 5), ("lever", lever, 5), ("other_seed", lever, 6)):
        torch.manual_seed(seed)
        runs[name] = _loss_and_grads(model, batch, spec)
    _assert_same(runs["lever"], runs["peft"], rel=1e-5)
    moved = max(((runs["other_seed"][1][k] - g).abs().max() / g.abs().max()).item() for k, g in runs["peft"][1].items())
    assert moved > 1e-2, moved
    if not checkpointing:
        no_dropout = _saved_activation_bytes(_lora(model_dir, checkpointing=False), batch, spec)
        kept = {name: _saved_activation_bytes(m, batch, spec) for name, m in (("peft", peft), ("lever", lever))}
        assert kept["lever"] <= 1.01 * no_dropout < kept["peft"], (kept, no_dropout)


@pytest.mark.parametrize("family,checkpointing", [("qwen3_vl", False), ("qwen3_vl", True), ("qwen3_5", False)])
def test_down_projection_keeping_gate_and_up_gives_peft_loss_and_drops_the_product(tiny_cache, built_shards, family,
                                                                                 checkpointing):
    """Where a run checkpoints (train/lora_dropout.py keeps_product_inputs): each SwiGLU MLP's down projection
    keeps gate and up instead of their product and computes it again in backward: PEFT's loss and gradients
    (masks included), and autograd keeps one [tokens, intermediate] tensor less per MLP than the recomputed
    dropout alone."""
    from train.lora_dropout import keeps_product_inputs, recompute_lora_dropout

    assert keeps_product_inputs("all") and keeps_product_inputs("all-but-3") and not keeps_product_inputs("none")
    model_dir = tiny_cache / f"tiny_{family}"
    batch = _batch(model_dir, built_shards, TWO)
    spec = LossSpec(impl="chunked", vision_no_grad=True)
    peft = _lora(model_dir, checkpointing=checkpointing, dropout=0.3)
    lever = _lora(model_dir, checkpointing=checkpointing, dropout=0.3)
    n = recompute_lora_dropout(lever, product_inputs=True)
    layers = peft.base_model.model.config.text_config.num_hidden_layers
    assert n["mlps"] == layers
    assert n["projections"] == sum(1 for name, _ in peft.named_modules() if name.endswith(".lora_A"))
    runs = {}
    for name, model in (("peft", peft), ("lever", lever)):
        torch.manual_seed(5)
        runs[name] = _loss_and_grads(model, batch, spec)
    _assert_same(runs["lever"], runs["peft"], rel=1e-5)
    if not checkpointing:
        inputs_only = _lora(model_dir, checkpointing=False, dropout=0.3)
        recompute_lora_dropout(inputs_only)
        tokens = batch["input_ids"].numel()
        product = tokens * peft.base_model.model.config.text_config.intermediate_size * 4  # fp32 on CPU
        kept = {name: _saved_activation_bytes(m, batch, spec) for name, m in (("inputs", inputs_only), ("lever", lever))}
        assert kept["lever"] <= kept["inputs"] - 0.99 * layers * product, (kept, layers * product)


@pytest.mark.parametrize("family,checkpointing,product", [("qwen3_vl", False, False), ("qwen3_vl", True, True),
                                                           ("qwen3_5", False, True)])
def test_sibling_lora_gives_peft_loss_and_gradients_in_one_node_per_group(tiny_cache, built_shards, family,
                                                                          checkpointing, product):
    """--sibling-lora: q/k/v and gate/up each run as one autograd node with PEFT's masks (same seed: the same loss
    and gradients as PEFT's branches; another seed moves them), and backward sums the shared input's gradients
    inside the GEMMs instead of with separate adds."""
    from tests.train_helpers import op_counter
    from train.lora_dropout import recompute_lora_dropout

    model_dir = tiny_cache / f"tiny_{family}"
    batch = _batch(model_dir, built_shards, TWO)
    spec = LossSpec(impl="chunked", vision_no_grad=True)
    peft = _lora(model_dir, checkpointing=checkpointing, dropout=0.3)
    alone = _lora(model_dir, checkpointing=checkpointing, dropout=0.3)
    grouped = _lora(model_dir, checkpointing=checkpointing, dropout=0.3)
    recompute_lora_dropout(alone, product_inputs=product)
    n = recompute_lora_dropout(grouped, product_inputs=product, siblings=True)
    text = peft.base_model.model.config.text_config
    full = sum(1 for t in getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
               if t == "full_attention")
    assert n["sibling_groups"] == full + text.num_hidden_layers, n  # q/k/v per attention layer, gate/up per MLP
    # every other routed projection alone in one node, but a down projection that keeps gate and up
    grouped_members = 3 * full + 2 * text.num_hidden_layers + (text.num_hidden_layers if product else 0)
    assert n["single_groups"] == n["projections"] - grouped_members > 0, n
    adds = {}
    runs = {}
    for name, model, seed in (("peft", peft, 5), ("alone", alone, 5), ("grouped", grouped, 5), ("other_seed", grouped, 6)):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        loss = causal_lm_loss(model, batch, spec)
        with op_counter(lambda op: op in ("add", "add_")) as counter:
            loss.backward()
        adds[name] = counter.ops
        runs[name] = (loss.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad})
    _assert_same(runs["grouped"], runs["peft"], rel=1e-5)
    moved = max(((runs["other_seed"][1][k] - g).abs().max() / g.abs().max()).item() for k, g in runs["peft"][1].items())
    assert moved > 1e-2, moved
    # the shared inputs' gradient sums move into the GEMMs (tiny Qwen3-VL: 22 -> 11 adds, the rest are the
    # residual stream's and the norms' own)
    assert adds["grouped"] <= adds["alone"] - 4 * text.num_hidden_layers, adds


def test_sibling_lora_runs_a_member_alone_when_called_with_another_input(tiny_cache):
    """The group's first member computes q, k and v for its input; k called with another input runs alone (the
    next mask), and v still gets its share: the outputs of PEFT-order single branches drawing the same masks."""
    from train.lora_dropout import _forward, recompute_lora_dropout
    from train.vision import inner_model

    model = _lora(tiny_cache / "tiny_qwen3_vl", checkpointing=False, dropout=0.3).train()
    attn = inner_model(model).language_model.layers[0].self_attn
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    x, y = torch.randn(2, 1, 5, q.in_features).unbind(0)
    with torch.no_grad():
        torch.manual_seed(0)
        ref = [_forward(q, x), _forward(k, x), _forward(v, x), _forward(k, y)]  # masks drawn q, k, v, then k(y)
        recompute_lora_dropout(model, siblings=True)
        torch.manual_seed(0)
        q_x, k_y, v_x = q(x), k(y), v(x)
    assert torch.allclose(q_x, ref[0], atol=1e-6) and torch.allclose(v_x, ref[2], atol=1e-6)
    assert torch.allclose(k_y, ref[3], atol=1e-6) and not torch.allclose(k_y, _forward(k, y), atol=1e-6)


@pytest.mark.parametrize("impl", ["chunked", "torch"])
def test_inputs_prepared_on_the_host_leave_the_loss_no_value_reads(tiny_cache, built_shards, impl):
    """model_inputs makes every decision that reads the batch's values (positions, padding, supervised positions)
    on the host batch; causal_lm_loss on the prepared batch reads none of them again in train/ code (on a GPU each
    read would be a host sync), and gives the raw batch's loss and gradients."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    from train.loss import model_inputs
    from train.positions import PositionCache

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ours = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("_local_scalar_dense", "nonzero", "is_nonzero"):
                caller = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-1]
                if "/train/" in caller.filename:  # read by train/ code itself (the model's own reads are its own)
                    self.ours.append(f"{func.__name__} at {caller.filename}:{caller.lineno}")
            return func(*args, **(kwargs or {}))

    model_dir = tiny_cache / "tiny_qwen3_vl"
    spec = LossSpec(impl=impl, vision_no_grad=True)
    ids = TWO
    raw = _batch(model_dir, built_shards, ids)
    model = _lora(model_dir, checkpointing=False)
    ref_loss, ref_grads = _loss_and_grads(model, raw, spec)
    prepared = model_inputs(model, raw, positions=PositionCache(), sample_ids=ids)
    model.zero_grad(set_to_none=True)
    with Reads() as reads:
        loss = causal_lm_loss(model, dict(prepared), spec, sample_ids=ids)
    loss.backward()
    assert reads.ours == []
    with Reads() as reads_raw:  # the mode does see them where they happen: the raw batch's reads
        causal_lm_loss(model, dict(raw), spec, sample_ids=ids)
    assert reads_raw.ours
    assert abs(loss.item() - ref_loss) <= 1e-6 * abs(ref_loss)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-5, atol=1e-7)


def test_loader_workers_prepare_what_the_forward_would_read(tiny_cache, built_shards):
    """WorkerInputs in the loader's worker process (its own meta-device model) gives each micro-batch exactly what
    model_inputs gives with the real model, and the loss on it is the raw batch's."""
    from transformers import AutoConfig

    from schemas.prompt import load_tokenizer
    from train.data import MicroBatch, SampleStore, VisionSpec, rank_loader
    from train.loss import SUPERVISED_KEY, WorkerInputs, model_inputs
    from train.positions import PositionCache

    model_dir = tiny_cache / "tiny_qwen3_vl"
    config = AutoConfig.from_pretrained(model_dir)
    order = [MicroBatch(sample_ids=TWO, repeat=[False, False]), MicroBatch(sample_ids=TWO[:1], repeat=[False])]
    loader = rank_loader(SampleStore(built_shards), order, VisionSpec.from_model_config(config),
                         video_token_id=config.video_token_id, pad_token_id=load_tokenizer(str(model_dir)).pad_token_id,
                         num_workers=1, inputs=WorkerInputs(config))
    model = _lora(model_dir, checkpointing=False)
    spec = LossSpec(impl="chunked", vision_no_grad=True)
    for (got, meta), mb in zip(loader, order):
        raw = _batch(model_dir, built_shards, mb.sample_ids)
        want = model_inputs(model, raw, positions=PositionCache(), sample_ids=mb.sample_ids)
        assert SUPERVISED_KEY in got and got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
        with torch.no_grad():
            assert causal_lm_loss(model, got, spec).item() == causal_lm_loss(model, raw, spec).item()
