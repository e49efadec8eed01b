"""TrainConfig: every knob of `train.main`, typed, parsed from the command line and validated up front.

`parse_config(argv)` returns a TrainConfig or raises ConfigError listing every problem at once, so a
run never gets as far as loading weights with a bad combination. The resolved config is written to
RUN/run.json; nothing deeper in the trainer reads argparse output or nested dicts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

from schemas.prompt import DEFAULT_LAYOUT, LAYOUTS
from train.plan import TAILS, batching_problems

FINETUNE = ("lora", "full")
PRESETS = ("video-ora-zero3",)  # the original Video-ORA ZeRO-3 DeepSpeed config (default_deepspeed_config at stage 3)
QUANTIZE = ("nf4", "int8")
DTYPES = ("bf16", "fp32")
ZERO_STAGES = (0, 1, 2, 3)
FAMILIES = ("qwen3_vl", "qwen3_5")
# Language-model linear layers of both families (Qwen3.5's linear-attention projections included); the
# vision tower ("model.visual.*") never matches because the path must contain "language_model".
DEFAULT_LORA_TARGETS = (
    r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj"
    r"|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)"
)


# The flags that shape the DeepSpeed config, their values when not given, and where each lives in
# zero_optimization. With --deepspeed FILE the file decides them: a flag given with a file that sets the
# same key otherwise (or not at all, so DeepSpeed's own default would apply) is an error naming both.
ONE_RANK_PERSISTENCE = 1e15  # elements: above any parameter, so on one rank ZeRO-3 keeps all of them whole
ZERO_DEFAULTS = {"zero_stage": 3, "reduce_bucket_size": 5e6, "prefetch_bucket_size": 5e6, "param_persistence_threshold": 1e4}
ZERO_KEYS = {"zero_stage": "stage", "reduce_bucket_size": "reduce_bucket_size",
             "prefetch_bucket_size": "stage3_prefetch_bucket_size",
             "param_persistence_threshold": "stage3_param_persistence_threshold",
             "offload_optimizer": "offload_optimizer", "offload_params": "offload_param"}


class ConfigError(ValueError):
    """The command line asks for something impossible; the message lists every problem."""


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """One training run, as resolved from the command line (written to RUN/run.json)."""

    shards: Path  # prep build output: manifest.parquet, build.json, *.tar
    output_dir: Path  # RUN: logs, ledger, checkpoints, adapter or model, run.json
    model: Path | None = None  # save_pretrained directory; None = the bundled tiny random model
    model_family: str | None = None  # qwen3_vl | qwen3_5: only picks the tiny model, or overrides detection
    cache_dir: Path | None = None  # where the tiny model is created (default RUN/../.video_ora_cache)
    epochs: int | None = None  # passes over the manifest (default 1 when --max-steps is not given)
    max_steps: int | None = None  # stop after this many optimizer steps (the last epoch may end early)
    micro_batch_size: int = 1  # samples per forward on one rank
    grad_accum: int = 1  # micro-batches per rank per optimizer step
    lr: float = 1e-4  # peak learning rate
    warmup_steps: int | None = None  # linear warmup steps (overrides warmup_ratio)
    warmup_ratio: float = 0.05  # warmup as a fraction of all optimizer steps
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    decay_ratio: float = 1.0  # the cosine takes this last fraction of the steps; before it the peak rate holds
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping (0 disables)
    tail: str = "error"  # samples that do not fill a whole global step: error|pad|drop
    max_tokens_per_batch: int | None = None  # token budget per micro-batch (length grouping); None = fixed size
    finetune: str = "lora"  # lora | full
    lora_r: int = 8
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_targets: str = DEFAULT_LORA_TARGETS  # regex over module names (PEFT target_modules)
    unfreeze_vision: bool = False  # train the vision tower (blocks and patch embedding)
    unfreeze_merger: bool = False  # train the vision-to-language merger
    deepspeed: Path | None = None  # DeepSpeed JSON; "auto" values are filled from this config
    zero_stage: int | None = None  # ZeRO stage; None = auto: the memory planner picks (3 where it cannot, e.g. CPU)
    reduce_bucket_size: float | None = None  # reduce_bucket_size (None: 5e6, what Video-ORA used)
    prefetch_bucket_size: float | None = None  # stage3_prefetch_bucket_size (None: 5e6)
    param_persistence_threshold: float | None = None  # stage3_param_persistence_threshold (None: 1e4)
    offload_optimizer: bool = False  # ZeRO optimizer state on CPU
    zero3_leaf_layers: bool | None = None  # ZeRO-3 hooks per decoder layer / vision block (None: on, off for the preset)
    offload_params: bool = False  # ZeRO-3 parameters on CPU
    preset: str | None = None  # named DeepSpeed config: video-ora-zero3 (the original Video-ORA run's)
    mem_cap_gib: float | None = None  # CUDA: cap this process's memory (torch memory fraction): a small card
    # Speed and memory levers, each behind its switch (README "Speed and memory levers")
    attention: str = "sdpa"  # sdpa | eager | flash_attention_2 (train/kernels.py)
    gradient_checkpointing: str = "auto"  # auto | all | none | every-K (train/activations.py)
    offload_activations: bool = False  # checkpointed layers' saved inputs in host memory
    # False: checkpointed layers keep their sdpa outputs (train/activations.py); None: the planner decides on CUDA
    # (train/memplan.py: the fewer recomputed FLOPs among what fits), recomputed elsewhere
    recompute_attention: bool | None = None
    vision_no_grad: bool | None = None  # frozen vision tower without autograd (None: on when it is all frozen)
    vision_chunk_frames: int = 64  # frames per vision-tower pass (0: a micro-batch's videos at once)
    vision_cache_gib: float = 0.0  # keep the frozen vision blocks' outputs per sample, up to this many GiB (0: off)
    loss_impl: str = "auto"  # auto | torch | chunked | liger (train/loss.py)
    pack: bool = False  # pack a micro-batch's samples into one row (needs --max-tokens-per-batch)
    segment_attention: bool = True  # packed rows: sdpa per sample, no [L, L] mask (train/packing.py)
    sequence_parallel: int = 1  # ranks one sample's tokens are split over (train/sequence_parallel.py)
    quantize_base: str | None = None  # nf4 | int8: the frozen base in bitsandbytes (CUDA, LoRA)
    linear_attention: str = "auto"  # Qwen3.5: auto | fla | torch (train/kernels.py)
    liger_kernels: bool | None = None  # liger's RMSNorm / rotary / SwiGLU (None: on for Qwen3-VL on CUDA where it imports)
    compile: bool = False  # torch.compile each decoder layer (ZeRO <= 2; train/kernels.py)
    batched_vision_attention: bool = True  # one sdpa call per vision block over equal segments (train/kernels.py)
    recompute_lora_dropout: bool = True  # LoRA keeps its input, not dropout's output + mask (train/lora_dropout.py)
    sibling_lora: bool = True  # q/k/v and gate/up LoRA as one autograd node each, with it (train/lora_dropout.py)
    plain_adamw: bool = True  # stage 0: DeepSpeed steps the trainer's fp32-master AdamW (train/adamw.py)
    fused_grad_checks: bool = True  # ZeRO gradient norm (+ ZeRO-1/2 overflow check) in multi-tensor kernels (train/zero.py)
    profile_steps: int = 0  # torch.profiler over this many steps after the first (train/profile.py)
    save_every: int = 0  # checkpoint every N optimizer steps (0: never; the final weights are always saved)
    resume: Path | None = None  # RUN directory to resume from (its latest checkpoint)
    verify_load: bool = False  # compare every checkpoint tensor against the loaded (gathered) parameters
    seed: int = 0
    dtype: str = "bf16"  # bf16 | fp32 (parameters and compute; master weights stay fp32 in the optimizer)
    log_every: int = 1  # rank 0 prints every Nth step line (every line still goes to the per-rank log)
    progress: bool = True  # rank 0's progress bar on stderr (drawn only when stderr is a terminal)
    num_workers: int = 2  # data loader worker processes per rank (0 = read in the training process)
    full_logits: bool = False  # compute logits at every position (HF loss) instead of supervised ones only
    prompt_layout: str = DEFAULT_LAYOUT  # the layout the shards must have been tokenized in (schemas/prompt.py)

    @property
    def lora(self) -> bool:
        return self.finetune == "lora"

    def plan_config(self, dp_world: int):
        """The data plan's settings for `dp_world` data-parallel slots (train.main and train.plan)."""
        from train.plan import PlanConfig

        return PlanConfig(world_size=dp_world, micro_batch_size=self.micro_batch_size, grad_accum=self.grad_accum,
                          seed=self.seed, tail=self.tail, max_tokens_per_batch=self.max_tokens_per_batch, pack=self.pack)

    def zero(self, name: str) -> float:
        """A ZeRO flag's value, its default when not given."""
        value = getattr(self, name)
        return ZERO_DEFAULTS[name] if value is None else value

    def to_json(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()}

    def validate(self) -> None:
        """Raise ConfigError naming every problem (not just the first)."""
        p: list[str] = []
        if not self.shards.is_dir():
            p.append(f"--shards {self.shards}: not a directory")
        elif not (self.shards / "manifest.parquet").exists():
            p.append(f"--shards {self.shards}: no manifest.parquet (run `python -m prep build` first)")
        if self.model is not None and not (self.model / "config.json").exists():
            p.append(f"--model {self.model}: no config.json (expected a save_pretrained directory)")
        if self.model_family is not None and self.model_family not in FAMILIES:
            p.append(f"--model-family {self.model_family!r}: choose one of {', '.join(FAMILIES)}")
        if self.epochs is not None and self.epochs < 1:
            p.append(f"--epochs must be >= 1, got {self.epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            p.append(f"--max-steps must be >= 1, got {self.max_steps}")
        for name in ("micro_batch_size", "grad_accum", "log_every", "lora_r"):
            if getattr(self, name) < 1:
                p.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("save_every", "num_workers"):
            if getattr(self, name) < 0:
                p.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            p.append(f"--lr must be > 0, got {self.lr}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            p.append(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.warmup_ratio < 1:
            p.append(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 <= self.min_lr_ratio <= 1:
            p.append(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.decay_ratio <= 1:
            p.append(f"--decay-ratio must be in (0, 1], got {self.decay_ratio}")
        if self.weight_decay < 0:
            p.append(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.max_grad_norm < 0:
            p.append(f"--max-grad-norm must be >= 0, got {self.max_grad_norm}")
        p += batching_problems(tail=self.tail, micro_batch_size=self.micro_batch_size,
                               max_tokens_per_batch=self.max_tokens_per_batch)
        if self.finetune not in FINETUNE:
            p.append(f"--finetune {self.finetune!r}: choose one of {'|'.join(FINETUNE)}")
        if not 0 <= self.lora_dropout < 1:
            p.append(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        try:
            re.compile(self.lora_targets)
        except re.error as e:
            p.append(f"--lora-targets is not a valid regex: {e}")
        if self.zero_stage is not None and self.zero_stage not in ZERO_STAGES:
            p.append(f"--zero-stage {self.zero_stage}: choose one of {ZERO_STAGES}")
        if self.offload_params and self.zero("zero_stage") != 3 and self.deepspeed is None:
            p.append("--offload-params needs ZeRO stage 3")
        if self.compile and self.liger_kernels is True:
            p.append("--compile and --liger-kernels both fuse the same elementwise work: choose one")
        if self.profile_steps < 0:
            p.append(f"--profile-steps {self.profile_steps}: give a number of steps >= 0")
        if self.offload_optimizer and self.zero("zero_stage") == 0 and self.deepspeed is None:
            p.append("--offload-optimizer needs ZeRO stage >= 1")
        for name in ("reduce_bucket_size", "prefetch_bucket_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                p.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.deepspeed is not None:
            if not self.deepspeed.is_file():
                p.append(f"--deepspeed {self.deepspeed}: no such file")
            else:
                try:
                    p += deepspeed_conflicts(self, json.loads(self.deepspeed.read_text()))
                except json.JSONDecodeError as e:
                    p.append(f"--deepspeed {self.deepspeed}: not valid JSON ({e})")
        if self.resume is not None and not (self.resume / "checkpoints").is_dir():
            p.append(f"--resume {self.resume}: no checkpoints/ directory (was it run with --save-every?)")
        if self.resume is None and any((self.output_dir / "ledger").glob("rank*.jsonl")):
            # a second run would append to its ledger and fail the coverage check after all its training
            p.append(f"--output-dir {self.output_dir}: holds an earlier run (ledger/); pass --resume {self.output_dir} "
                     "to continue it, or choose a new --output-dir")
        if self.dtype not in DTYPES:
            p.append(f"--dtype {self.dtype!r}: choose one of {'|'.join(DTYPES)}")
        p += self.lever_problems()
        p += self.sequence_parallel_problems()
        if p:
            raise ConfigError("invalid training config:\n  - " + "\n  - ".join(p))


    def sequence_parallel_problems(self) -> list[str]:
        """--sequence-parallel's rules (the world size, heads and the batch are checked at setup and per step)."""
        n = self.sequence_parallel
        if n < 1:
            return [f"--sequence-parallel must be >= 1, got {n}"]
        if n == 1:
            return []
        p = []
        if self.micro_batch_size != 1 or self.max_tokens_per_batch is not None or self.pack:
            p.append("--sequence-parallel splits one sample: use --micro-batch-size 1 without "
                     "--max-tokens-per-batch / --pack")
        if not self.lora:
            p.append("--sequence-parallel supports --finetune lora (the loss gathers a frozen lm_head)")
        if not self.vision_frozen:
            p.append("--sequence-parallel needs a frozen vision tower (its sharded outputs are exchanged without "
                     "autograd): drop --unfreeze-vision / --unfreeze-merger")
        return p

    @property
    def vision_frozen(self) -> bool:
        return not (self.unfreeze_vision or self.unfreeze_merger)

    @property
    def zero3_leaf(self) -> bool:
        """The resolved --zero3-leaf-layers."""
        return (self.preset is None) if self.zero3_leaf_layers is None else self.zero3_leaf_layers

    @property
    def vision_without_grad(self) -> bool:
        """The resolved --vision-no-grad: on by default when the whole vision tower is frozen."""
        return self.vision_frozen if self.vision_no_grad is None else self.vision_no_grad

    def lever_problems(self) -> list[str]:
        """The speed and memory levers' own rules (device-dependent ones are checked at setup)."""
        from train.activations import problem as checkpointing_problem
        from train.kernels import ATTENTIONS, LINEAR_ATTENTION
        from train.loss import LOSS_IMPLS

        p: list[str] = []
        if self.attention not in ATTENTIONS:
            p.append(f"--attention {self.attention!r}: choose one of {'|'.join(ATTENTIONS)}")
        if (why := checkpointing_problem(self.gradient_checkpointing)) is not None:
            p.append(why)
        if self.offload_activations and self.gradient_checkpointing == "none":
            p.append("--offload-activations offloads the checkpointed layers' inputs: it needs --gradient-checkpointing "
                     "other than none")
        if self.recompute_attention is False and (self.gradient_checkpointing == "none" or self.attention != "sdpa"):
            p.append("--no-recompute-attention keeps the checkpointed layers' sdpa outputs: it needs "
                     "--gradient-checkpointing other than none and --attention sdpa")
        if self.vision_no_grad and not self.vision_frozen:
            p.append("--vision-no-grad with --unfreeze-vision/--unfreeze-merger: a trained tower needs its gradients")
        if self.vision_chunk_frames < 0 or self.vision_chunk_frames % 2:
            p.append(f"--vision-chunk-frames must be 0 or a positive even number (temporal patch of 2 frames), "
                     f"got {self.vision_chunk_frames}")
        if self.vision_cache_gib < 0:
            p.append(f"--vision-cache-gib must be >= 0 (0: off), got {self.vision_cache_gib}")
        if self.vision_cache_gib and self.sequence_parallel > 1:
            p.append("--vision-cache-gib with --sequence-parallel: the sharded tower does not read the cache")
        if self.loss_impl not in LOSS_IMPLS:
            p.append(f"--loss-impl {self.loss_impl!r}: choose one of {'|'.join(LOSS_IMPLS)}")
        if self.loss_impl == "liger" and not self.lora:
            p.append("--loss-impl liger computes the loss with a frozen lm_head (LoRA); with --finetune full use "
                     "--loss-impl chunked")
        if self.pack and self.max_tokens_per_batch is None:
            p.append("--pack fills micro-batches up to a token budget: give --max-tokens-per-batch")
        if self.quantize_base is not None:
            if self.quantize_base not in QUANTIZE:
                p.append(f"--quantize-base {self.quantize_base!r}: choose one of {'|'.join(QUANTIZE)}")
            if not self.lora:
                p.append("--quantize-base trains LoRA adapters on a quantized frozen base: not with --finetune full")
            if self.zero_stage == 3 or self.preset == "video-ora-zero3":
                p.append("--quantize-base: bitsandbytes weights cannot be ZeRO-3 partitioned; use --zero-stage 2 (or auto)")
        if self.linear_attention not in LINEAR_ATTENTION:
            p.append(f"--linear-attention {self.linear_attention!r}: choose one of {'|'.join(LINEAR_ATTENTION)}")
        if self.mem_cap_gib is not None and not self.mem_cap_gib > 0:
            p.append(f"--mem-cap-gib must be > 0, got {self.mem_cap_gib}")
        if self.preset is not None:
            if self.preset not in PRESETS:
                p.append(f"--preset {self.preset!r}: choose one of {'|'.join(PRESETS)}")
            if self.deepspeed is not None:
                p.append(f"--preset {self.preset} and --deepspeed {self.deepspeed}: choose one DeepSpeed config")
            if self.zero_stage not in (None, 3):
                p.append(f"--preset {self.preset} is ZeRO-3; --zero-stage {self.zero_stage} contradicts it")
        return p


def _zero_stage(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: auto or one of {ZERO_STAGES}") from None


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig(shards=Path("."), output_dir=Path("."))
    ap = argparse.ArgumentParser(
        prog="train.main",
        description="Fine-tune a Qwen3-VL / Qwen3.5 video model on a `prep build` output with DeepSpeed. "
        "Launch with `deepspeed --module train.main ...`, `torchrun -m train.main ...` or plain `python -m train.main` "
        "(one process). On CPU set DS_ACCELERATOR=cpu.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = ap.add_argument_group("data")
    g.add_argument("--shards", type=Path, required=True, help="prep build output directory (manifest.parquet, build.json, tars)")
    g.add_argument("--output-dir", type=Path, required=True, help="run directory: logs, ledger, checkpoints, saved weights, run.json")
    g.add_argument("--tail", choices=TAILS, default=d.tail,
                   help="samples that do not fill whole global steps: error (stop and say the numbers), "
                   "pad (repeat samples, counted as repeats), drop (leave them out, ids listed)")
    g.add_argument("--max-tokens-per-batch", type=int, default=None,
                   help="token budget per micro-batch (padded length x samples); groups samples by length. "
                   "Default: fixed --micro-batch-size")
    g.add_argument("--num-workers", type=int, default=d.num_workers, help="data loader workers per rank")
    g.add_argument("--prompt-layout", choices=sorted(LAYOUTS), default=d.prompt_layout,
                   help="prompt layout the shards must have (`prep build --prompt-layout`): nested = what "
                   "transformers 5.0-5.24's Qwen3VLProcessor produces; flat = transformers >= 5.25 and 4.57, vLLM "
                   f"before PR 46957. Default: the installed transformers' ({d.prompt_layout}). Shards of another "
                   "layout are refused")
    g = ap.add_argument_group("model")
    g.add_argument("--model", type=Path, default=None,
                   help="save_pretrained model directory; default: the bundled tiny random model (created on first use)")
    g.add_argument("--model-family", choices=FAMILIES, default=None,
                   help="which tiny model to create when --model is not given; with --model it must match config.json")
    g.add_argument("--cache-dir", type=Path, default=None, help="where the tiny model is created (default: OUTPUT_DIR/../.video_ora_cache)")
    g.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="parameter and compute dtype")
    g.add_argument("--verify-load", action="store_true",
                   help="after loading, compare every checkpoint tensor numerically with the (gathered) parameter")
    g = ap.add_argument_group("schedule")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--epochs", type=int, default=None, help="passes over the manifest (default 1)")
    x.add_argument("--max-steps", type=int, default=None, help="optimizer steps to run (epochs repeat as needed)")
    g.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size, help="samples per forward on one rank")
    g.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per rank per optimizer step")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    g.add_argument("--warmup-steps", type=int, default=None, help="linear warmup steps (overrides --warmup-ratio)")
    g.add_argument("--warmup-ratio", type=float, default=d.warmup_ratio, help="warmup as a fraction of all steps")
    g.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="cosine decays to lr x this")
    g.add_argument("--decay-ratio", type=float, default=d.decay_ratio,
                   help="the cosine decay spans this last fraction of the steps; the peak rate holds until then "
                   "(1: cosine right after warmup; 0.3: warmup-stable-decay)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    g.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm, help="gradient clipping norm (0: off)")
    g.add_argument("--seed", type=int, default=d.seed, help="plan shuffle, LoRA init and dropout seed")
    g = ap.add_argument_group("fine-tuning")
    g.add_argument("--finetune", choices=FINETUNE, default=d.finetune, help="LoRA adapter or full fine-tune")
    g.add_argument("--lora-r", type=int, default=d.lora_r, help="LoRA rank")
    g.add_argument("--lora-alpha", type=int, default=d.lora_alpha, help="LoRA alpha (scale = alpha / r)")
    g.add_argument("--lora-dropout", type=float, default=d.lora_dropout, help="dropout on the LoRA input")
    g.add_argument("--lora-targets", default=d.lora_targets,
                   help="regex over module names that get LoRA (default: the language model's linear layers)")
    g.add_argument("--unfreeze-vision", action="store_true", help="also train the vision blocks (frozen by default in both modes; the mergers need --unfreeze-merger)")
    g.add_argument("--unfreeze-merger", action="store_true", help="also train the vision-to-language merger(s) (frozen by default)")
    g.add_argument("--full-logits", action="store_true",
                   help="compute logits at every position and use the model's own loss (default: only at "
                   "supervised positions, which saves the largest activation)")
    g = ap.add_argument_group("deepspeed")
    g.add_argument("--deepspeed", type=Path, default=None,
                   help="DeepSpeed JSON config; 'auto' values are filled from these flags. Default: the original "
                   "Video-ORA config (ZeRO-3, 5e6 buckets, no offload) with the stage/bucket/offload flags below")
    with_file = " (with --deepspeed: only where the file says \"auto\"; a file that sets it otherwise is an error)"
    g.add_argument("--zero-stage", type=_zero_stage, choices=(None, *ZERO_STAGES), default=None, metavar="auto|0|1|2|3",
                   help="ZeRO stage. auto (default): on CUDA the memory planner (python -m train.plan) picks the fastest "
                   "that fits the device's free memory or --mem-cap-gib; elsewhere 3" + with_file)
    g.add_argument("--preset", choices=PRESETS, default=None,
                   help="a named DeepSpeed config: video-ora-zero3 = the original Video-ORA run's ZeRO-3 config "
                   "(5e6 buckets, 1e4 persistence, no offload)")
    g.add_argument("--reduce-bucket-size", type=float, default=None, help="reduce_bucket_size (default 5e6)" + with_file)
    g.add_argument("--prefetch-bucket-size", type=float, default=None,
                   help="stage3_prefetch_bucket_size (default 5e6)" + with_file)
    g.add_argument("--param-persistence-threshold", type=float, default=None,
                   help="stage3_param_persistence_threshold (default 1e4)" + with_file)
    g.add_argument("--zero3-leaf-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="ZeRO-3: gather and release each decoder layer and vision block as one unit (DeepSpeed leaf "
                   "modules) instead of every submodule: the same numbers, a fraction of the per-module hook cost "
                   "(default: on; off under --preset video-ora-zero3, the original run's behaviour)")
    g.add_argument("--offload-optimizer", action="store_true",
                   help="keep optimizer state on CPU (ZeRO >= 1; with --deepspeed the file must say so too)")
    g.add_argument("--offload-params", action="store_true",
                   help="keep parameters on CPU (ZeRO-3; with --deepspeed the file must say so too)")
    g = ap.add_argument_group("speed and memory levers")
    g.add_argument("--gradient-checkpointing", nargs="?", const="all", default=d.gradient_checkpointing,
                   metavar="auto|all|none|every-K|all-but-N",
                   help="recompute decoder layers in backward: all, none, every-K (layers 0, K, 2K, ...), all-but-N "
                   "(all except the last N), or auto (the planner picks the least that fits; all where there is no "
                   "GPU memory figure)")
    g.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_const", const="none",
                   help="same as --gradient-checkpointing none")
    g.add_argument("--offload-activations", action="store_true",
                   help="keep the checkpointed layers' saved inputs in pinned host memory (slower, frees "
                   "layers x tokens x hidden bytes of device memory)")
    g.add_argument("--recompute-attention", action=argparse.BooleanOptionalAction, default=d.recompute_attention,
                   help="--no-recompute-attention: checkpointed layers keep their attention output (~1.6x a layer "
                   "input per layer) and recompute only the rest; pays at long sequences, where causal attention "
                   "is most of a layer's forward. Unset: on CUDA the planner keeps them when that fits and "
                   "recomputes fewer FLOPs than checkpointing fewer layers would; elsewhere recomputed")
    g.add_argument("--attention", choices=("sdpa", "eager", "flash_attention_2"), default=d.attention,
                   help="attention implementation (flash_attention_2 needs flash-attn and CUDA)")
    g.add_argument("--vision-no-grad", action=argparse.BooleanOptionalAction, default=None,
                   help="run the vision tower without autograd (default: on when the whole tower is frozen)")
    g.add_argument("--vision-chunk-frames", type=int, default=d.vision_chunk_frames,
                   help="frames per vision-tower pass (exact: its attention stays within a temporal group); "
                   "0 = all at once")
    g.add_argument("--vision-cache-gib", type=float, default=d.vision_cache_gib, metavar="GIB",
                   help="keep the frozen vision blocks' outputs per sample (up to GIB of them, on the training "
                   "device) so a repeated sample runs only the merger(s) and the language model; needs the "
                   "blocks frozen (the mergers may train); exact (train/vision.py); 0 = off")
    g.add_argument("--loss-impl", choices=("auto", "torch", "chunked", "liger"), default=d.loss_impl,
                   help="cross-entropy at supervised positions: torch (logits there, fp32), chunked (lm_head + loss "
                   "per chunk of positions, recomputed in backward), liger (fused kernel; CUDA, where it imports), "
                   "auto (chunked; torch for a trainable lm_head under ZeRO-3)")
    g.add_argument("--pack", action="store_true",
                   help="pack each micro-batch's samples into one row (no padding, no attention across samples, "
                   "per-sample positions) up to --max-tokens-per-batch tokens; Qwen3-VL only")
    g.add_argument("--segment-attention", action=argparse.BooleanOptionalAction, default=d.segment_attention,
                   help="with --pack and --attention sdpa: attention runs once per packed sample, causal with no mask "
                   "(sdpa's flash / cuDNN kernels, as an unpacked row gets); --no-segment-attention: transformers' "
                   "block-diagonal [L, L] mask over the whole row (train/packing.py)")
    g.add_argument("--sequence-parallel", type=int, default=d.sequence_parallel, metavar="N",
                   help="split each sample's tokens over N ranks (Ulysses attention, vision tower sharded by "
                   "temporal group; Qwen3-VL, LoRA, one sample per micro-batch); the world size must be a "
                   "multiple of N and the plan deals samples over world/N groups")
    g.add_argument("--quantize-base", choices=QUANTIZE, default=None,
                   help="hold the frozen base in bitsandbytes nf4/int8 (QLoRA; CUDA, LoRA, ZeRO <= 2)")
    g.add_argument("--linear-attention", choices=("auto", "fla", "torch"), default=d.linear_attention,
                   help="Qwen3.5's gated-delta-rule layers: fla (flash-linear-attention, checked against torch on "
                   "the device first), torch (plain fallback), auto (fla when importable and correct)")
    g.add_argument("--liger-kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="liger-kernel's fused RMSNorm, rotary embedding and SwiGLU in the language model (CUDA). "
                   "Default: on for Qwen3-VL, and for Qwen3.5 where liger has its entry point (>= 0.8.0), on CUDA where "
                   "liger-kernel imports (and not with --compile), else off")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each language-model decoder layer (fuses the elementwise work between the "
                   "matmuls; the first step compiles; ZeRO <= 2)")
    g.add_argument("--batched-vision-attention", action=argparse.BooleanOptionalAction,
                   default=d.batched_vision_attention,
                   help="the vision tower's sdpa attention as one call per block over its equal-length temporal "
                   "groups (default) instead of transformers' one call per group and a host sync per block")
    g.add_argument("--recompute-lora-dropout", action=argparse.BooleanOptionalAction, default=d.recompute_lora_dropout,
                   help="below ZeRO-3, each LoRA branch keeps its input (shared by q/k/v and by gate/up) and draws its "
                   "dropout mask again in backward (default) instead of keeping PEFT's dropout output and mask per "
                   "projection: the same masks and loss, about a third less activation memory per kept layer "
                   "(not with --compile)")
    g.add_argument("--sibling-lora", action=argparse.BooleanOptionalAction, default=d.sibling_lora,
                   help="where LoRA dropout is drawn again in backward: q/k/v and gate/up, which read one input, run "
                   "as one autograd node each (PEFT's masks; the input's gradients summed inside the GEMMs, not by "
                   "separate adds; train/lora_dropout.py)")
    g.add_argument("--fused-grad-checks", action=argparse.BooleanOptionalAction, default=d.fused_grad_checks,
                   help="the gradient norm (ZeRO-1/2/3) and the inf/NaN check (ZeRO-1/2) as a few multi-tensor kernels "
                   "(default) instead of DeepSpeed's several kernels per gradient tensor; same norm, same skipped steps")
    g.add_argument("--plain-adamw", action=argparse.BooleanOptionalAction, default=d.plain_adamw,
                   help="at ZeRO stage 0 (what auto picks on one GPU), DeepSpeed steps the trainer's AdamW, which keeps "
                   "the fp32 master weights itself and clips and steps every tensor in a few multi-tensor calls "
                   "(default), instead of DeepSpeed's bf16 wrapper with its Python per tensor; same update, same "
                   "skipped steps. Not with a --deepspeed file")
    g.add_argument("--mem-cap-gib", type=float, default=None,
                   help="CUDA: cap this process's memory at this many GiB (torch memory fraction), e.g. to act "
                   "as a 12 GiB card; the planner plans for it")
    g = ap.add_argument_group("run")
    g.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N optimizer steps (0: never)")
    g.add_argument("--resume", type=Path, default=None,
                   help="resume from the latest checkpoint of this run directory (model, optimizer, scheduler, RNG, plan position)")
    g.add_argument("--profile-steps", type=int, default=d.profile_steps, metavar="N",
                   help="profile N steps after the first with torch.profiler: RUN/profile/rank{r}.trace.json.gz "
                   "(open in https://ui.perfetto.dev or chrome://tracing) and kernels_rank{r}.txt (top ops by "
                   "device time)")
    g.add_argument("--log-every", type=int, default=d.log_every, help="rank 0 prints every Nth step line")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (it is drawn on stderr only when that is a terminal)")
    # Launchers pass these; the environment (LOCAL_RANK) is what the trainer reads.
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    ns = vars(build_parser().parse_args(argv))
    ns.pop("local_rank", None)
    cfg = TrainConfig(**ns)
    cfg.validate()
    return cfg


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed config


def default_deepspeed_config(cfg: TrainConfig) -> dict:
    """The original Video-ORA config (ZeRO-3, 5e6 buckets, no offload), with stage, buckets and offload
    taken from the flags. "auto" values are filled by `resolve_deepspeed_config`."""
    zero: dict = {"stage": cfg.zero("zero_stage"), "overlap_comm": False, "contiguous_gradients": True,
                  "reduce_bucket_size": cfg.zero("reduce_bucket_size")}
    if cfg.zero("zero_stage") == 3:
        zero.update({"stage3_prefetch_bucket_size": cfg.zero("prefetch_bucket_size"),
                     "stage3_param_persistence_threshold": cfg.zero("param_persistence_threshold"),
                     "stage3_max_live_parameters": 1e8, "stage3_max_reuse_distance": 1e8,
                     "stage3_gather_16bit_weights_on_model_save": True})
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    optimizer_params: dict = {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.999], "eps": 1e-8}
    if not cfg.offload_optimizer:
        optimizer_params["torch_adam"] = True  # plain torch AdamW: no op to compile (CPU offload uses DeepSpeedCPUAdam)
    return {
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": optimizer_params},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def own_zero3_settings(cfg: dict) -> bool:
    """Whether a config (vars(TrainConfig), or run.json's, where the threshold is the resolved one) leaves ZeRO-3's
    persistence to train.main: no --preset, no --deepspeed file, no --param-persistence-threshold of its own."""
    return (cfg.get("preset") is None and cfg.get("deepspeed") is None
            and cfg.get("param_persistence_threshold") in (None, ONE_RANK_PERSISTENCE))


def keeps_parameters_whole(*, world_size: int, offload_params: bool, own_zero3: bool) -> bool:
    """ZeRO-3 keeps every parameter whole, DeepSpeed's memory-efficient linear is off and the step leaves the frozen
    base resident (train.zero.keep_frozen_resident): one rank, no parameter offload, train.main's own settings.
    The rule resolve_deepspeed_config and train.main apply and train.memplan plans.

    Why: one rank's partition is the whole parameter, so partitioning saves nothing and every gather is a copy plus
    a wait on the compute stream; every parameter persistent keeps the frozen base resident (the same bytes) and
    skips them. Nothing is ever released then, so the memory-efficient linear (a Python autograd Function around
    every linear, there so a saved weight view cannot outlive a release) guards nothing; torch's own linear saves
    a projection's input only when its weight trains, and launches from C++."""
    return world_size == 1 and not offload_params and own_zero3


def resolve_deepspeed_config(cfg: TrainConfig, world_size: int, total_steps: int) -> dict:
    """The DeepSpeed config as used: the file (or the default) with every "auto" filled from cfg.

    A value the file sets explicitly that contradicts the plan (micro-batch, accumulation, batch size) is
    an error, because the plan is built from the flags. Any "auto" left over is an error naming its key.
    """
    base = json.loads(cfg.deepspeed.read_text()) if cfg.deepspeed else default_deepspeed_config(cfg)
    ds = json.loads(json.dumps(base))  # deep copy
    warmup = warmup_steps(cfg, total_steps)
    fills = {
        ("train_micro_batch_size_per_gpu",): cfg.micro_batch_size,
        ("gradient_accumulation_steps",): cfg.grad_accum,
        ("train_batch_size",): cfg.micro_batch_size * cfg.grad_accum * world_size,
        ("gradient_clipping",): cfg.max_grad_norm,
        ("bf16", "enabled"): cfg.dtype == "bf16",
        ("fp16", "enabled"): False,
        ("optimizer", "params", "lr"): cfg.lr,
        ("optimizer", "params", "weight_decay"): cfg.weight_decay,
        ("optimizer", "params", "betas"): [0.9, 0.999],
        ("optimizer", "params", "eps"): 1e-8,
        ("zero_optimization", "stage"): cfg.zero("zero_stage"),
        ("zero_optimization", "reduce_bucket_size"): cfg.zero("reduce_bucket_size"),
        ("zero_optimization", "stage3_prefetch_bucket_size"): cfg.zero("prefetch_bucket_size"),
        ("zero_optimization", "stage3_param_persistence_threshold"): cfg.zero("param_persistence_threshold"),
        ("scheduler", "params", "warmup_num_steps"): warmup,
        ("scheduler", "params", "total_num_steps"): total_steps,
        ("scheduler", "params", "warmup_max_lr"): cfg.lr,
        ("scheduler", "params", "warmup_min_lr"): 0.0,
    }
    if cfg.zero("zero_stage") == 3 and keeps_parameters_whole(world_size=world_size, offload_params=cfg.offload_params,
                                                             own_zero3=own_zero3_settings(vars(cfg))):
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = ONE_RANK_PERSISTENCE
        ds["zero_optimization"]["memory_efficient_linear"] = False
    from train.adamw import applies as plain_adamw_applies, switched_on as plain_adamw_switched_on  # torch: lazily

    plain = plain_adamw_applies(zero_stage=cfg.zero("zero_stage"), deepspeed_file=cfg.deepspeed is not None,
                                enabled=plain_adamw_switched_on(vars(cfg)))
    if plain:  # the trainer's optimizer keeps the masters and clips: DeepSpeed must not wrap it (train/adamw.py)
        ds["bf16"]["enabled"], ds["gradient_clipping"] = False, 0.0
        del ds["optimizer"]
    for keys, value in fills.items():
        node = ds
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, dict) and node.get(keys[-1]) == "auto":
            node[keys[-1]] = value
    problems = [f"{'.'.join(path)} is still \"auto\" (no flag fills it; set a value)" for path in _autos(ds)]
    for key, want in (("train_micro_batch_size_per_gpu", cfg.micro_batch_size),
                      ("gradient_accumulation_steps", cfg.grad_accum),
                      ("train_batch_size", cfg.micro_batch_size * cfg.grad_accum * world_size)):
        if key in ds and ds[key] != "auto" and ds[key] != want:
            problems.append(f"{key}={ds[key]} in {cfg.deepspeed} but the flags give {want} "
                            "(set it to \"auto\" or change --micro-batch-size/--grad-accum)")
    if (ds.get("fp16") or {}).get("enabled"):
        problems.append("fp16 is not supported (use bf16 or fp32)")
    if not plain and (ds.get("bf16") or {}).get("enabled", False) != (cfg.dtype == "bf16"):
        problems.append(f"bf16.enabled={ds.get('bf16', {}).get('enabled')} contradicts --dtype {cfg.dtype}")
    if problems:
        raise ConfigError("invalid DeepSpeed config:\n  - " + "\n  - ".join(problems))
    return ds


def _autos(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _autos(v, path + (k,))
    elif node == "auto":
        yield path


def zero_stage(ds: dict) -> int:
    return int((ds.get("zero_optimization") or {}).get("stage", 0))


def _offloaded(section) -> bool:
    return isinstance(section, dict) and section.get("device", "none") not in ("none", None)


def deepspeed_conflicts(cfg: TrainConfig, ds: dict) -> list[str]:
    """Flags given together with --deepspeed FILE that the file overrides, each naming both settings."""
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    where = f"--deepspeed {cfg.deepspeed}"
    problems = []
    for name, key in ZERO_KEYS.items():
        flag = f"--{name.replace('_', '-')}"
        given = getattr(cfg, name)
        if name.startswith("offload"):
            if given and not _offloaded(zero.get(key)):
                problems.append(f"{flag} is set but {where} has zero_optimization.{key} = {zero.get(key)!r}: the file "
                                f"decides, so the flag would be ignored. Put the offload in the file or drop {flag}")
            continue
        if given is None or zero.get(key) == "auto" or zero.get(key) == given:
            continue
        has = f"zero_optimization.{key} = {zero[key]!r}" if key in zero else \
            f"no zero_optimization.{key} (DeepSpeed's default would apply)"
        problems.append(f"{flag} {given:g} but {where} has {has}: the file decides, so the flag would be ignored. "
                        f"Drop {flag}, or write \"auto\" there to take it from the flag")
    return problems


def resolved(cfg: TrainConfig, ds: dict) -> TrainConfig:
    """cfg with the ZeRO settings the DeepSpeed config actually has: the one stage the engine, the saver
    and run.json all use."""
    zero = ds.get("zero_optimization") or {}
    values = {name: zero.get(key) for name, key in ZERO_KEYS.items() if not name.startswith("offload")}
    values["zero_stage"] = zero_stage(ds)
    return dataclasses.replace(cfg, **values, offload_optimizer=_offloaded(zero.get("offload_optimizer")),
                               offload_params=_offloaded(zero.get("offload_param")))


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    if cfg.warmup_steps is not None:
        return min(cfg.warmup_steps, total_steps)
    return int(cfg.warmup_ratio * total_steps)


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float, decay_ratio: float = 1.0) -> float:
    """Multiplier of the peak lr for the optimizer step `step` (0-based): linear warmup that starts above
    zero (step 0 already trains), the peak rate until the last decay_ratio of the steps, then cosine down
    to min_ratio at the last step. decay_ratio 1 is the plain warmup + cosine; a short run that must
    first discover the signal needs the peak rate held, and the final decay is what settles it."""
    import math

    if step < warmup:
        return (step + 1) / (warmup + 1)
    decay_start = max(warmup, total - round(decay_ratio * total))
    if step < decay_start:
        return 1.0
    progress = (step - decay_start) / max(1, total - decay_start)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
