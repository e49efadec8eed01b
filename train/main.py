"""Fine-tune a Qwen3-VL / Qwen3.5 video model on a `prep build` output: one recipe, read top to bottom.

    deepspeed [--num_gpus N] --module train.main --shards SHARDS --output-dir RUN [...]
      (DeepSpeed 0.19's launcher spells it --module; multi-node: add --hostfile FILE --num_nodes M)
    torchrun --nproc_per_node N -m train.main --shards SHARDS --output-dir RUN [...]
    python -m train.main --shards SHARDS --output-dir RUN [...]          # one process
    (CPU: DS_ACCELERATOR=cpu; ranks talk over gloo)

`Recipe.setup()` runs in an order that matters: validate -> GPU memory others hold, --mem-cap-gib -> plan
every epoch (so a bad world size or tail fails before any weight loads) -> levers this device or family cannot
run refused, Qwen3.5 kernels routed -> pre-flight the manifest -> "auto" decided by the memory planner
(train/memplan.py) -> load the model (partitioned under ZeRO-3) -> verify the load -> checkpointing,
LoRA/full -> DeepSpeed engine (optimizer, scheduler; ZeRO-3 sharding checked) -> resume state -> data loader.
`train()` is the whole loop: per micro-batch data -> forward (train/loss.py) -> backward -> optimizer step,
each inside `PhaseTracker.phase` (train/memory.py: the phase an error names, the fault hooks, the memory);
per step the ledger line (train/ledger.py) and one log line. `steps_done` counts finished optimizer steps,
the loop's `step` is the one running. Exit codes: 0 done, 2 a config/plan/data/load problem (message says what),
3 out of memory (report in RUN/oom_rank{r}.json).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch

from schemas.build import BuildRecord
from schemas.manifest import SchemaError
from train.checkpoint import (
    ResumeError,
    carry_ledger,
    find_checkpoint,
    load_checkpoint,
    plan_fingerprint,
    save_adapter,
    save_checkpoint,
    save_full,
    set_rng_state,
    trainable_state,
)
from train.config import (
    ConfigError,
    TrainConfig,
    keeps_parameters_whole,
    lr_factor,
    own_zero3_settings,
    parse_config,
    resolve_deepspeed_config,
    resolved,
    warmup_steps,
)
from train.data import (
    PreflightError,
    SampleError,
    SampleStore,
    VisionSpec,
    preflight_records,
    rank_loader,
)
from train.faults import maybe_stall
from train.jsonlog import RunLog
from train.load_check import LoadError, check_load, verify_values
from train.memory import (
    PhaseTracker,
    all_ranks_memory,
    apply_mem_cap,
    device_info,
    gpu_memory_in_use,
    history_breaks_training,
    live_allocations_by_site,
    record_allocations,
    summary_table,
)
from train.models import detect_family, ensure_tiny_model, load_pretrained
from train.ledger import append_ledger, check_ledger
from train.activations import Checkpointing, apply_checkpointing
from train.kernels import (
    KernelError,
    apply_liger_kernels,
    attention_problem,
    batch_vision_attention,
    compile_layers,
    liger_kernels_default,
    liger_kernels_problem,
    route_linear_attention,
)
from train.loss import LossSpec, WorkerInputs, causal_lm_loss, liger_problem, resolve_loss_impl
from train.packing import use_segment_attention
from train.adamw import (MasterWeightAdamW, applies as plain_adamw_applies, clear_gradients_through,
                         switched_on as plain_adamw_switched_on)
from train.lora_dropout import (applies as recompute_applies, keeps_product_inputs, recompute_lora_dropout,
                                switched_on)
from train.sequence_parallel import SequenceParallelError, sequence_parallel_loss, ulysses
from train.sequence_parallel import model_problems as sp_model_problems
from train.sequence_parallel import new_groups as sp_new_groups
from train.sequence_parallel import rank_layout as sp_layout
from train.quantize import from_pretrained_kwargs, quantize_problem
from train.profile import StepProfiler
from train.plan import PlanError, global_steps, plan_run, total_steps
from train.run_record import build_run_record, update_run_record, write_json
from train.zero import (
    STALE_BUILD_LOCK_S,
    fuse_gradient_checks,
    keep_frozen_resident,
    mark_leaf_layers,
    op_build_dir,
    sharding_report,
    skip_one_rank_allreduce,
    stale_build_lock,
)
from train.readback import PendingStep, values_to_host
from train.vision import VisionCache, cache_problems, entry_bytes

EXIT_USAGE = 2
EXIT_OOM = 3
USER_ERRORS = (ConfigError, PlanError, PreflightError, SampleError, SchemaError, LoadError, ResumeError, KernelError)


class TrainingOOM(RuntimeError):
    """Out of memory, with the report already written; main() turns it into exit code 3."""


def init_distributed() -> tuple[int, int, int]:
    """(rank, world_size, local_rank). A plain `python -m train.main` becomes a world of one."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    accel = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accel.device_name() != "cpu":
        accel.set_device(local_rank)
    backend = "gloo" if accel.device_name() == "cpu" else accel.communication_backend_name()
    if accel.device_name() == "cpu":
        import importlib

        # DeepSpeed's torch backend builds its shared-memory all-reduce op with gcc whenever it starts on a CPU
        # accelerator (25-48 s on 2 cores, measured: on first use and again whenever another environment rebuilt
        # the shared cache in between). Only inference_all_reduce (DeepSpeed inference's tensor parallel) uses
        # it, never training, so it is not built; gradients go over gloo as before. (import_module: the package
        # deepspeed.comm has an attribute `torch`, the real torch, that shadows its submodule of that name.)
        ds_comm = importlib.import_module("deepspeed.comm.torch")
        ds_comm.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend=backend)
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank


class Recipe:
    """LoRA or full fine-tuning with DeepSpeed; one instance per rank."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.run_dir = cfg.output_dir
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.steps_done = 0  # optimizer steps completed: also the index of the step that runs next
        self._recording_allocations = False  # CUDA allocation history (train/memory.py), load to step 0's end
        self.start_step = 0  # the first step this process runs (> 0 when resumed)
        self.current_meta = None  # BatchMeta of the micro-batch in flight (OOM report)
        self._hf_ds_config = None  # must outlive from_pretrained: transformers holds it by weak reference
        self._resume_rng = None
        self._last_losses: list[float] = []
        self.vision_cache: VisionCache | None = None  # --vision-cache-gib (set in setup)

    @property
    def phase(self) -> str:
        """The phase this rank is in (or last finished): what an error report names."""
        tracker = getattr(self, "tracker", None)
        return tracker.current if tracker is not None else "setup"

    # ------------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        self.rank, self.world_size, self.local_rank = init_distributed()
        from deepspeed.accelerator import get_accelerator

        self.device = torch.device(get_accelerator().current_device_name())
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = RunLog(self.run_dir, self.rank)
        self.tracker = PhaseTracker(self.run_dir, self.rank)  # phase, fault hook and memory of this rank
        self.log.event("start", argv=sys.argv, world_size=self.world_size, device=str(self.device))
        # Sequence parallel: consecutive groups of N ranks share one sample, so the plan deals samples over
        # world / N data-parallel slots and the ledger has one writer per slot (train/sequence_parallel.py).
        self.sp = cfg.sequence_parallel
        try:
            self.dp_rank, self.sp_rank, self.dp_world = sp_layout(self.rank, self.world_size, self.sp)
        except SequenceParallelError as e:
            raise ConfigError(str(e)) from None
        self.sp_group = sp_new_groups(self.rank, self.world_size, self.sp) if self.sp > 1 else None
        if self.sp > 1:
            self.log.event("sequence_parallel", size=self.sp, dp_rank=self.dp_rank, sp_rank=self.sp_rank,
                           dp_world=self.dp_world)
        self._report_gpu_memory()

        # 1. Plan every epoch from the manifest, before anything heavy: a world size that leaves a rank
        #    without a batch, or a tail that does not fit, stops here with the numbers.
        self.store = SampleStore(cfg.shards)
        self.store.check_layout(cfg.prompt_layout)
        self.plan_config = cfg.plan_config(self.dp_world)
        self.plans = plan_run(list(self.store.records.values()), self.plan_config, epochs=cfg.epochs,
                              max_steps=cfg.max_steps)
        self.total_steps = total_steps(self.plans)
        self.plan_sha256 = plan_fingerprint(self.plans)
        planned = sorted({sid for p in self.plans for sid in p.sample_ids(repeats=True)})
        self.log.event("plan", total_steps=self.total_steps, samples=len(planned), plan_sha256=self.plan_sha256,
                       epochs=[{"epoch": p.epoch, "steps": p.num_steps, "dropped": p.dropped, "repeated": p.repeated}
                               for p in self.plans])
        for p in self.plans:
            self.log.say(p.describe())
        if self.rank == 0:
            write_json(self.run_dir / "plan.json", {"plans": [p.to_json() for p in self.plans]})
        # The checkpoint to resume from is chosen now, so "nothing to resume" fails before the load: the newest
        # complete one (checkpoint.json present, every file it lists at its size), whatever `latest` says.
        self.resume_from = find_checkpoint(cfg.resume) if cfg.resume is not None else None
        for skip in self.resume_from.skipped if self.resume_from else []:
            self.log.event("checkpoint_skipped", **skip)
            self.log.say(f"resume: skipped checkpoint {skip['tag']}: {skip['reason']}")

        # 2. Model directory and family (config.json only, no weights yet).
        self.model_dir = self._model_dir().resolve()  # absolute: run.json and the adapter name it for any cwd
        self.family = detect_family(self.model_dir)
        if cfg.model_family is not None and cfg.model is not None and cfg.model_family != self.family:
            raise ConfigError(f"--model-family {cfg.model_family} but {self.model_dir}/config.json is {self.family}")
        from transformers import AutoConfig

        from schemas.prompt import load_tokenizer

        self.model_config = AutoConfig.from_pretrained(self.model_dir)
        self.vision = VisionSpec.from_model_config(self.model_config)
        self.tokenizer = load_tokenizer(str(self.model_dir))
        if self.sp > 1 and (problems := sp_model_problems(self.family, self.model_config.text_config, self.sp)):
            raise ConfigError("; ".join(problems))

        # 2b. The levers that depend on the device and the family, checked before anything heavy.
        self._check_levers()
        cfg = self.cfg
        if cfg.liger_kernels is None:  # decided here so the planner and run.json see it
            self.cfg = cfg = dataclasses.replace(cfg, liger_kernels=liger_kernels_default(
                self.family, compile=cfg.compile, device_type=self.device.type))

        # 3. Pre-flight every planned sample from the manifest (the loader checks each one again as it reads).
        preflight_records([self.store.record(s) for s in planned], spec=self.vision)

        # 4. "auto" settings decided (ZeRO stage, checkpointing), the DeepSpeed config as used, and the run
        #    record (before the load, so a crash still leaves it).
        self.cfg = cfg = self._resolve_auto(cfg)
        self.ds_config = resolve_deepspeed_config(cfg, self.world_size, self.total_steps)
        # From here on cfg holds the ZeRO settings the DeepSpeed config really has (a --deepspeed file decides
        # them): one stage for the load, the engine, the saver and run.json.
        self.cfg = cfg = resolved(cfg, self.ds_config)
        self.zero_stage = cfg.zero_stage
        if cfg.offload_optimizer and (lock := stale_build_lock()) is not None:
            raise ConfigError(f"optimizer offload needs DeepSpeed's CPU Adam op, and its build directory holds a lock "
                              f"older than {STALE_BUILD_LOCK_S // 60} minutes ({lock}): a build was killed mid-way and "
                              "torch would wait on it forever; delete that file and run again")
        if cfg.offload_optimizer and (ops := op_build_dir()) is not None and not (ops / "cpu_adam.so").is_file():
            self.log.say(f"optimizer offload: DeepSpeed's CPU Adam op is not built in {ops} yet; unless DeepSpeed "
                         "was installed with it prebuilt, it compiles at engine init (about a minute, once)")
        if cfg.compile and self.zero_stage == 3:
            raise ConfigError("--compile with ZeRO-3: DeepSpeed's parameter hooks run inside each layer's call and "
                              "would be traced; use --zero-stage 2 (or 0/1)")
        self.loss_spec = self._loss_spec()
        self.log.event("levers", attention=cfg.attention, gradient_checkpointing=cfg.gradient_checkpointing,
                       liger_kernels=cfg.liger_kernels, compile=cfg.compile,
                       offload_activations=cfg.offload_activations, **dataclasses.asdict(self.loss_spec),
                       pack=cfg.pack, quantize_base=cfg.quantize_base)
        if self.rank == 0:
            record = build_run_record(
                config=cfg.to_json(), ds_config=self.ds_config, shards=cfg.shards, world_size=self.world_size,
                devices=device_info(), model_dir=str(self.model_dir), family=self.family,
                plan_summary="\n".join(p.describe() for p in self.plans))
            write_json(self.run_dir / "run.json", record)

        # 5. Load (partitioned at load under ZeRO-3) and verify against the checkpoint files. What the loader's
        # workers prepare per batch (train.loss.WorkerInputs) is built first: ZeRO-3's load setup would partition it.
        self.worker_inputs = WorkerInputs(self.model_config) if self.sp == 1 else None  # sequence parallel: its own
        self.model = self._load_model()

        if cfg.liger_kernels:  # before LoRA wraps the projections the swapped MLP forward calls
            self.log.event("liger_kernels", swapped=apply_liger_kernels(self.model, self.family))
        if cfg.batched_vision_attention:
            self.log.event("batched_vision_attention", modules=batch_vision_attention(self.model))
        if cfg.pack and cfg.segment_attention and cfg.attention == "sdpa":
            self.log.event("segment_attention", **use_segment_attention(self.model))

        # 6. What trains: LoRA adapters (default) or every language-model weight; vision frozen unless asked.
        self.model = self._setup_trainable(self.model)
        # 6b. The vision cache, once what trains is known: it holds the frozen blocks' outputs only.
        self.vision_cache = self._vision_cache()

        if cfg.compile:  # after LoRA and checkpointing, so both are inside the compiled layers
            self.log.event("compile", layers=compile_layers(self.model))

        # 7. Engine: DeepSpeed builds the optimizer from its config; the scheduler is ours unless the config has one.
        self.engine = self._setup_engine()

        # 8. Resume: module, optimizer and scheduler from DeepSpeed's checkpoint; plan position and RNG ours.
        if cfg.resume is not None:
            choice = self.resume_from
            state = load_checkpoint(self.engine, choice, rank=self.rank, world_size=self.world_size,
                                    plan_sha256=self.plan_sha256)
            self.start_step = self.steps_done = state.global_step
            self._resume_rng = state.rng
            kept = carry_ledger(cfg.resume, self.run_dir, self.dp_rank, self.start_step) if self.sp_rank == 0 else 0
            self.log.event("resume", from_dir=str(cfg.resume), checkpoint=choice.tag, skipped=choice.skipped,
                           latest=choice.latest, global_step=self.start_step, ledger_lines_kept=kept)
            self.log.say(f"resumed from {choice.path} at global step {self.start_step} of {self.total_steps}")

        # 9. Data: this rank's micro-batches from the resume point on, read and collated ahead by workers.
        self.steps = list(global_steps(self.plans, self.dp_rank, start=self.start_step))
        micro_batches = [mb for _, _, _, accum in self.steps for mb in accum]
        cached = None
        if self.vision_cache is not None:  # the hits it will have, so their frames are never read
            records = {sid: self.store.record(sid) for mb in micro_batches for sid in mb.sample_ids}
            sizes = {sid: entry_bytes(self.model, (r.grid_t, r.grid_h, r.grid_w)) for sid, r in records.items()}
            cached = self.vision_cache.plan([mb.sample_ids for mb in micro_batches], sizes)
            self.log.event("vision_cache_plan", samples=len(sizes), stored=self.vision_cache.planned_entries,
                           loaded_without_frames=sum(map(sum, cached)), loads=sum(map(len, cached)))
        self.loader = rank_loader(
            self.store, micro_batches, self.vision, video_token_id=self.model_config.video_token_id,
            pad_token_id=self._pad_id(), tokenizer=self.tokenizer, num_workers=cfg.num_workers,
            pixel_dtype=self.dtype, pack=cfg.pack, cached=cached, inputs=self.worker_inputs)

    def _report_gpu_memory(self) -> None:
        """Before anything loads: what other processes already hold on the GPUs (a shared card is the usual
        cause of an OOM nobody can reproduce), and the --mem-cap-gib cap. Nothing to report on CPU."""
        if self.device.type != "cuda":
            return
        devices = gpu_memory_in_use(self.local_rank)
        self.log.event("gpu_memory_before_load", devices=devices)
        for d in devices:
            self.log.say(f"[rank {self.rank}] GPU {d['index']} ({d['name']}): {d['used_gib']:.2f} of "
                         f"{d['total_gib']:.2f} GiB already in use before loading ({d['source']})")
        if self.cfg.mem_cap_gib is not None:
            fraction = apply_mem_cap(self.cfg.mem_cap_gib, self.device.index or 0)
            self.log.event("mem_cap", gib=self.cfg.mem_cap_gib, fraction=round(fraction, 4))
            self.log.say(f"[rank {self.rank}] memory capped at {self.cfg.mem_cap_gib} GiB ({fraction:.1%} of the device)")

    def _resolve_auto(self, cfg: TrainConfig) -> TrainConfig:
        """--zero-stage auto / --gradient-checkpointing auto. On CUDA the memory planner (train/memplan.py)
        picks the fastest exact configuration whose predicted peak fits the smallest card of the job (its free
        memory, or --mem-cap-gib); elsewhere, or with a --deepspeed file, today's behaviour: ZeRO-3 (the file's
        stage) and every layer checkpointed."""
        from train.memplan import memory_choice, needs_auto, without_gpu_figure

        if not needs_auto(cfg):
            return without_gpu_figure(cfg)
        if self.device.type != "cuda" or cfg.deepspeed is not None:
            resolved_cfg = without_gpu_figure(cfg)
            self.log.event("auto", zero_stage=resolved_cfg.zero_stage,
                           gradient_checkpointing=resolved_cfg.gradient_checkpointing,
                           reason="a --deepspeed file decides" if cfg.deepspeed is not None else
                           f"no GPU memory figure on {self.device.type}: ZeRO-3, every layer checkpointed")
            return resolved_cfg
        free, _ = torch.cuda.mem_get_info(self.device)
        mem = torch.tensor([cfg.mem_cap_gib if cfg.mem_cap_gib else free / 2**30], device=self.device)
        torch.distributed.all_reduce(mem, op=torch.distributed.ReduceOp.MIN)  # every rank must pick the same
        resolved_cfg, choice = memory_choice(cfg, self.model_config, list(self.store.records.values()), self.plans,
                                             world=self.world_size, gpu_mem_gib=float(mem.item()))
        self.log.event("memory_plan", **choice.to_json())
        self.log.say(choice.message())
        if not choice.fits:
            self.log.say("warning: no configuration is predicted to fit; training with the smallest predicted peak "
                         "(the prediction is within ~15%; --quantize-base nf4 shrinks the frozen weights 4x)")
        if self.rank == 0:
            write_json(self.run_dir / "memory_plan.json", choice.to_json())
        return resolved_cfg

    def _check_levers(self) -> None:
        """Refuse, with the reason, a lever this device or family cannot run; route Qwen3.5's kernels."""
        cfg, device = self.cfg, self.device.type
        problems = []
        if (why := attention_problem(cfg.attention, device)) is not None:
            problems.append(why)
        if cfg.loss_impl == "liger" and (why := liger_problem()) is not None:
            problems.append(why)
        if cfg.pack and self.family == "qwen3_5":
            problems.append("--pack with Qwen3.5: its linear-attention layers (gated delta rule, causal conv1d) carry "
                            "state along the row, and their torch fallback in transformers ignores sample boundaries, "
                            "so packed samples would see each other; train Qwen3.5 unpacked")
        if cfg.liger_kernels and (why := liger_kernels_problem(device)) is not None:
            problems.append(why)
        if cfg.mem_cap_gib is not None and device != "cuda":
            problems.append(f"--mem-cap-gib needs a CUDA device (this run is on {device})")
        if cfg.quantize_base and (why := quantize_problem(device)) is not None:
            problems.append(why)
        if problems:
            raise ConfigError("levers not available here:\n  - " + "\n  - ".join(problems))
        if self.family == "qwen3_5":
            choice = route_linear_attention(cfg.linear_attention, self.device)
            self.log.event("linear_attention", implementation=choice.implementation, reason=choice.reason)
            self.log.say(f"Qwen3.5 linear attention: {choice.implementation} ({choice.reason})")
            # decided: the planner counts what this kernel saves, and run.json records it
            self.cfg = dataclasses.replace(self.cfg, linear_attention=choice.implementation)

    def _model_dir(self) -> Path:
        if self.cfg.model is not None:
            return self.cfg.model
        family = self.cfg.model_family or self._build_family() or "qwen3_vl"
        cache = self.cfg.cache_dir or Path(os.environ.get("VIDEO_ORA_CACHE", Path.home() / ".cache" / "video-ora"))
        # Rank 0 creates the tiny model once; the others wait instead of racing on the same directory.
        if self.rank == 0:
            path = ensure_tiny_model(family, cache)
        torch.distributed.barrier()
        if self.rank != 0:
            path = ensure_tiny_model(family, cache)
        return path

    def _build_family(self) -> str:
        return BuildRecord.read(self.cfg.shards).model_family

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cfg.dtype == "bf16" else torch.float32

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.model_config.text_config.pad_token_id or 0

    def _load_model(self):
        from transformers.integrations import HfDeepSpeedConfig

        self.log.event("load_start", model_dir=str(self.model_dir), family=self.family, zero_stage=self.zero_stage)
        t0 = time.time()
        if self.zero_stage == 3:
            # Kept alive on self: with it, from_pretrained builds the model inside deepspeed.zero.Init and
            # each rank only ever holds its partition.
            self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)
        record = self.device.type == "cuda"
        if record and history_breaks_training(self.zero_stage, self.cfg.gradient_checkpointing):
            self.log.event("allocation_history_off", reason="ZeRO-3 with checkpointed layers (pytorch#179536)")
            record = False
        self._recording_allocations = record_allocations(record)  # until step 0 ends
        with self.tracker.phase("load", 0):
            model, info = load_pretrained(
                self.model_dir, dtype=self.dtype, output_loading_info=True, attn_implementation=self.cfg.attention,
                **from_pretrained_kwargs(self.cfg.quantize_base, self.local_rank))
            model.config.use_cache = False
            # transformers' ZeRO-3 loader keeps every key conversion, used or not, and save_pretrained reverses
            # them all: for Qwen3.5 that writes `model.language_model.model.language_model.*`. Keep only the
            # conversions that matched a checkpoint key, as the ordinary loader does.
            conversions = getattr(model, "_weight_conversions", None)
            if conversions:
                model._weight_conversions = [c for c in conversions if c.was_used()]
            report, entries = check_load(model, self.model_dir, info)
            self.log.say(report.message())
            verified = None
            if self.cfg.verify_load:
                verified = verify_values(model, self.model_dir, report, entries, rank=self.rank,
                                         world_size=self.world_size)
                total = len(report.mapping) + len(report.tied)
                self.log.say(f"{verified}/{total} checkpoint entries verified")
        mem = self.tracker.latest
        self.log.event("load_done", seconds=round(time.time() - t0, 2), checkpoint_entries=report.entries,
                       prefix_changes=report.prefix_changes, tied=report.tied, partitioned=report.partitioned,
                       verified=verified, peak_alloc_gib=mem.alloc_gib, peak_reserved_gib=mem.reserved_gib,
                       memory_kind=mem.kind)
        return model

    def _setup_trainable(self, model):
        cfg = self.cfg
        for p in model.parameters():
            p.requires_grad_(False)
        checkpointed = apply_checkpointing(model, Checkpointing.parse(cfg.gradient_checkpointing),
                                           offload=cfg.offload_activations, keep_attention=not cfg.recompute_attention)
        self.log.event("checkpointing", spec=cfg.gradient_checkpointing, layers=checkpointed,
                       offload=cfg.offload_activations, recompute_attention=cfg.recompute_attention)
        torch.manual_seed(cfg.seed)  # LoRA init: the same on every rank
        if cfg.lora:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                              target_modules=cfg.lora_targets, bias="none")
            # adapters in the base's dtype: PEFT's default upcasts them to fp32, which DeepSpeed's engine casts back
            # for ZeRO-0/1/2 but not for a ZeRO-3 model (already partitioned at load), so ZeRO-3 ran every LoRA
            # branch in fp32 (one H200, 64 frames: fp32 GEMMs, dropout and casts, 0.98 s against 0.60 s ZeRO-2)
            model = get_peft_model(model, lora, autocast_adapter_dtype=False)
            if recompute_applies(lora=True, lora_dropout=cfg.lora_dropout, zero_stage=self.zero_stage,
                                 quantized=cfg.quantize_base is not None, enabled=switched_on(vars(cfg))):
                self.log.event("lora_dropout_recomputed", **recompute_lora_dropout(
                    model, product_inputs=keeps_product_inputs(cfg.gradient_checkpointing), siblings=cfg.sibling_lora))
        else:
            for name, p in model.named_parameters():
                if not _is_vision(name):
                    p.requires_grad_(True)
        for name, p in model.named_parameters():
            if (cfg.unfreeze_merger and _is_merger(name)) or (cfg.unfreeze_vision and _is_vision(name) and not _is_merger(name)):
                p.requires_grad_(True)
        torch.manual_seed(cfg.seed + 1000 + self.rank)  # dropout: per rank
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        n_train = sum(getattr(p, "ds_numel", p.numel()) for _, p in trainable)
        n_all = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        self.log.event("trainable", tensors=len(trainable), parameters=n_train, total_parameters=n_all,
                       finetune=cfg.finetune)
        self.log.say(f"trainable: {len(trainable)} tensors, {n_train:,} of {n_all:,} parameters ({cfg.finetune})")
        if not trainable:
            raise ConfigError(f"nothing to train: --lora-targets {cfg.lora_targets!r} matched no module")
        return model

    def _setup_engine(self):
        import deepspeed

        cfg = self.cfg
        params = [p for p in self.model.parameters() if p.requires_grad]
        scheduler = None
        if "scheduler" not in self.ds_config:
            warmup = warmup_steps(cfg, self.total_steps)
            total = self.total_steps

            def scheduler(optimizer):
                return torch.optim.lr_scheduler.LambdaLR(
                    optimizer, lambda s: lr_factor(s, warmup=warmup, total=total, min_ratio=cfg.min_lr_ratio,
                                                 decay_ratio=cfg.decay_ratio))

        optimizer = None
        if plain_adamw_applies(zero_stage=self.zero_stage, deepspeed_file=cfg.deepspeed is not None,
                               enabled=plain_adamw_switched_on(vars(cfg))):
            # DeepSpeed casts the parameters to bf16 only when its bf16 mode is on (off here: train/adamw.py), and
            # moves the model to the device only in initialize: the masters must be made where they will step
            for p in self.model.parameters():
                if p.is_floating_point() and p.dtype != self.dtype:
                    p.data = p.data.to(self.dtype)
            if any(p.device != self.device for p in self.model.parameters()):  # (a quantized base loads there)
                self.model.to(self.device)
            optimizer = MasterWeightAdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                          max_grad_norm=cfg.max_grad_norm)
            self.log.event("plain_adamw", tensors=len(params), fused=bool(optimizer.defaults.get("fused")))
        elif "optimizer" not in self.ds_config:
            optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        if self.zero_stage == 3 and cfg.zero3_leaf:
            leaves = mark_leaf_layers(self.model)
            self.log.event("zero3_leaf_layers", classes=leaves)
            if cfg.gradient_checkpointing == "none":
                # DeepSpeed gathers a leaf layer again for its backward from a hook on its inputs' gradients;
                # with nothing checkpointed the first layer's inputs need none, its LoRA weights stay released
                # and backward fails on an empty tensor ("size of tensor a (0)"; checkpointing sets this itself)
                self.model.enable_input_require_grads()
        engine, _, _, _ = deepspeed.initialize(model=self.model, model_parameters=params, optimizer=optimizer,
                                               lr_scheduler=scheduler, config=self.ds_config)
        self.log.event("trainable_dtypes", dtypes=sorted({str(p.dtype).removeprefix("torch.")
                                                           for p in engine.module.parameters() if p.requires_grad}))
        if cfg.fused_grad_checks:
            self.log.event("fused_grad_checks", replaced=fuse_gradient_checks(engine.optimizer))
        if self.zero_stage == 3 and keeps_parameters_whole(world_size=self.world_size, offload_params=cfg.offload_params,
                                                           own_zero3=own_zero3_settings(vars(cfg))):
            self.log.event("frozen_kept_resident", replaced=keep_frozen_resident(engine.optimizer))
        self.log.event("one_rank_allreduce_skipped", skipped=skip_one_rank_allreduce(engine, self.world_size))
        if isinstance(optimizer, MasterWeightAdamW):
            clear_gradients_through(engine, optimizer)
        if engine.zero_optimization_stage() != self.zero_stage:
            raise RuntimeError(f"DeepSpeed runs ZeRO stage {engine.zero_optimization_stage()}, the resolved config "
                               f"says {self.zero_stage}")
        if self.zero_stage == 3:  # partitioned at load for real: each rank about 1/world of the parameters
            report = sharding_report(engine.module, rank=self.rank, world=self.world_size)
            self.log.event("zero3_sharding", ok=report.ok, **dataclasses.asdict(report))
            self.log.say(report.message())
            if not report.ok:
                raise LoadError(report.message())
        return engine

    # ------------------------------------------------------------------------------------------ train
    def train(self) -> None:
        cfg, engine = self.cfg, self.engine
        batches = iter(self.loader)  # created before the RNG restore: it draws its worker seed from torch's RNG
        if self._resume_rng is not None:
            set_rng_state(self._resume_rng)
        lora_before = self._lora_snapshot() if (cfg.lora and self.start_step == 0 and self.steps) else None
        epoch_last = {p.epoch: p.first_global_step + p.num_steps - 1 for p in self.plans}
        from tqdm import tqdm

        # The bar is for a terminal; in a log file the per-step JSON lines are the progress.
        bar = tqdm(total=self.total_steps, initial=self.start_step,
                   disable=self.rank != 0 or not cfg.progress or not sys.stderr.isatty(),
                   desc="train", unit="step", dynamic_ncols=True)
        self.log.bar = bar if self.rank == 0 else None
        engine.train()
        pending: PendingStep | None = None  # the last step's record, written while the next one runs
        try:
            with StepProfiler(cfg.profile_steps, self.run_dir / "profile", self.rank) as profiler:
                for step, epoch, _, accum in self.steps:  # `step` is running; self.steps_done counts finished ones
                    t0 = time.time()
                    losses, metas = [], []
                    lr = engine.optimizer.param_groups[0]["lr"]
                    self.tracker.begin_step(step)
                    for planned in accum:
                        with self.tracker.phase("data", step):
                            tensors, meta = next(batches)
                        if meta.sample_ids != planned.sample_ids:  # the loader must follow the plan, or the ledger lies
                            raise RuntimeError(f"loader yielded {meta.sample_ids}, plan says {planned.sample_ids}")
                        self.current_meta = meta
                        metas.append(meta)
                        tensors = {k: v.to(self.device, non_blocking=True) for k, v in tensors.items()}
                        with self._sp_scope():  # backward too: checkpointing recomputes the attention there
                            first = step == self.start_step and not losses
                            with self.tracker.phase("first_forward" if first else "forward", step):
                                loss = self.forward_loss(tensors, meta.sample_ids)
                            with self.tracker.phase("backward", step):
                                engine.backward(loss)
                        if pending is not None:  # its values reached the host long ago: logging it overlaps this step
                            pending = self._log_step(pending, bar)
                        with self.tracker.phase("optimizer_step", step):
                            engine.step()  # DeepSpeed steps the optimizer (and clips) only at the accumulation boundary
                        losses.append(self._sample_loss(loss))
                    step_mem = self.tracker.end_step()  # per-phase peaks of this step; the memory file written once
                    self.steps_done = step + 1
                    if self._recording_allocations:
                        self._recording_allocations = record_allocations(False)
                    self.current_meta = None
                    if self.sp_rank == 0:  # one ledger writer per data-parallel slot
                        append_ledger(self.run_dir, step, self.dp_rank, accum)
                    seconds = time.time() - t0
                    tokens = sum(sum(m.input_tokens) for m in metas)
                    pending = PendingStep(values=values_to_host([*losses, engine.get_global_grad_norm()]), fields=dict(
                        step=step, epoch=epoch, sample_ids=[s for m in metas for s in m.sample_ids],
                        repeat=[r for m in metas for r in m.repeat], input_tokens=tokens,
                        visual_tokens=sum(sum(m.visual_tokens) for m in metas),
                        supervised_tokens=sum(sum(m.supervised_tokens) for m in metas), lr=lr,
                        tokens_per_s=round(tokens / seconds, 1), seconds=round(seconds, 4),
                        peak_alloc_gib=max(v["alloc_gib"] for v in step_mem.values()),
                        peak_reserved_gib=max(v["reserved_gib"] for v in step_mem.values()),
                        memory_kind=next(iter(step_mem.values()))["kind"], phase_memory=step_mem,
                        phase_seconds=self.tracker.last_step_seconds,
                        data_wait_share=round(self.tracker.last_step_seconds.get("data", 0.0) / seconds, 4),
                        vision_cache=self.vision_cache.counts() if self.vision_cache is not None else None,
                        phase="train"))
                    if lora_before is not None:
                        pending = self._log_step(pending, bar)
                        self._lora_sanity(lora_before)
                        lora_before = None
                    if cfg.save_every and self.steps_done % cfg.save_every == 0 and self.steps_done < self.total_steps:
                        pending = self._log_step(pending, bar)
                        self.save_checkpoint()
                    if step == epoch_last[epoch]:
                        pending = self._log_step(pending, bar)
                        self._check_epoch(epoch)
                    profiler.step()
        finally:  # also when a step fails: the step before it keeps its record
            self._log_step(pending, bar)
        bar.close()
        self.log.bar = None
        if self.vision_cache is not None:
            self.log.event("vision_cache", **self.vision_cache.summary())
            self.log.say(self.vision_cache.line())

    def forward_loss(self, batch: dict[str, torch.Tensor], sample_ids: list[str]) -> torch.Tensor:
        if self.sp > 1:
            # DeepSpeed averages gradients over every rank; the group's partial losses sum to the sample's
            # loss, so each is scaled by N to keep the per-sample weighting of a plain data-parallel run.
            partial, _ = sequence_parallel_loss(self.engine, batch, self.sp_group,
                                                chunk_positions=self.loss_spec.chunk_positions)
            return partial * self.sp
        return causal_lm_loss(self.engine, batch, self.loss_spec, vision_cache=self.vision_cache, sample_ids=sample_ids)

    def _vision_cache(self) -> VisionCache | None:
        """--vision-cache-gib: refused unless the tower's blocks give the same outputs every pass."""
        gib = self.cfg.vision_cache_gib
        if not gib:
            return None
        if problems := cache_problems(self.model):
            raise ConfigError("; ".join(problems))
        cache = VisionCache(int(gib * 2**30))
        self.log.event("vision_cache_on", max_bytes=cache.max_bytes)
        return cache

    def _sp_scope(self):
        import contextlib

        return ulysses(self.engine, self.sp_group) if self.sp > 1 else contextlib.nullcontext()

    def _sample_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch's loss as logged (on its device): under sequence parallel the group's partials summed."""
        value = loss.detach().float()
        if self.sp > 1:
            value = value / self.sp
            torch.distributed.all_reduce(value, group=self.sp_group)
        return value

    def _log_step(self, pending: PendingStep | None, bar) -> None:
        """Write a finished step's record (its losses and gradient norm read from the host copy). Returns None,
        what the loop's `pending` becomes."""
        if pending is None:
            return None
        *losses, grad_norm = pending.values.read()
        rec = self.log.step(**pending.fields, loss=sum(losses) / len(losses),
                            grad_norm=None if math.isnan(grad_norm) else grad_norm)
        self._last_losses.append(rec["loss"])
        bar.update(1)
        if self.rank == 0 and (rec["step"] % self.cfg.log_every == 0 or rec["step"] + 1 == self.total_steps):
            self.log.say(json.dumps({k: rec[k] for k in rec if k not in ("event", "time", "phase_memory",
                                                                        "phase_seconds")}))
        return None

    def _loss_spec(self) -> LossSpec:
        """How forward and loss run (train/loss.py), with --loss-impl auto decided for this run's ZeRO stage."""
        cfg = self.cfg
        impl = resolve_loss_impl(cfg.loss_impl, lm_head_trainable=not cfg.lora, zero_stage=self.zero_stage)
        if impl == "chunked" and not cfg.lora and self.zero_stage == 3:
            raise ConfigError("--loss-impl chunked with --finetune full under ZeRO-3: the trainable lm_head is "
                              "partitioned; use --loss-impl torch (or auto)")
        return LossSpec(impl=impl, full_logits=cfg.full_logits, vision_no_grad=cfg.vision_without_grad,
                        vision_chunk_frames=cfg.vision_chunk_frames)

    def _lora_snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in trainable_state(self.engine.module).items() if "lora_" in k}

    def _lora_sanity(self, before: dict[str, torch.Tensor]) -> None:
        """After step 1 every lora_B must have moved. lora_A gets zero gradient at step 1 (B starts at zero),
        so an unchanged lora_A is expected and reported as such."""
        after = {k: v for k, v in trainable_state(self.engine.module).items() if "lora_" in k}
        b_keys = [k for k in before if "lora_B" in k]
        a_keys = [k for k in before if "lora_A" in k]
        b_same = [k for k in b_keys if torch.equal(before[k], after[k])]
        a_same = [k for k in a_keys if torch.equal(before[k], after[k])]
        self.log.event("lora_sanity", lora_B=len(b_keys), lora_B_unchanged=b_same, lora_A=len(a_keys),
                       lora_A_unchanged=len(a_same))
        self.log.say(f"LoRA sanity after step 1: {len(b_keys) - len(b_same)}/{len(b_keys)} lora_B changed; "
                     f"{len(a_same)}/{len(a_keys)} lora_A unchanged (expected: lora_A has zero gradient at step 1)")
        if b_same:
            raise RuntimeError(f"LoRA sanity: {len(b_same)} lora_B tensors did not change after step 1 "
                               f"(no gradient reaches them): {', '.join(b_same[:10])}")

    def _check_epoch(self, epoch: int) -> None:
        torch.distributed.barrier()  # every rank's ledger line for the last step is written
        if self.rank == 0:
            plan = next(p for p in self.plans if p.epoch == epoch)
            report = check_ledger(self.run_dir, [plan])
            self.log.event("ledger", epoch=epoch, ok=report.ok, message=report.message())
            self.log.say(f"coverage ledger: {report.message()}")
            report.raise_if_failed()

    # ------------------------------------------------------------------------------------------ save
    def save_checkpoint(self) -> None:
        with self.tracker.phase("save", self.steps_done):
            path = save_checkpoint(self.engine, self.run_dir, global_step=self.steps_done, plan_sha256=self.plan_sha256,
                                   rank=self.rank, world_size=self.world_size)
        mem = self.tracker.latest
        self.log.event("checkpoint", global_step=self.steps_done, path=str(path), peak_alloc_gib=mem.alloc_gib,
                       peak_reserved_gib=mem.reserved_gib)
        self.log.say(f"checkpoint saved: {path}")

    def save_final(self) -> Path:
        with self.tracker.phase("save", self.steps_done):
            if self.cfg.lora:
                out = save_adapter(self.engine.module, self.run_dir, rank=self.rank, tokenizer=self.tokenizer,
                                   base_dir=self.model_dir)
            else:
                out = save_full(self.engine, self.engine.module, self.run_dir, rank=self.rank, tokenizer=self.tokenizer,
                                base_dir=self.model_dir, zero_stage=self.zero_stage, dtype=self.dtype)
            torch.distributed.barrier()
        mem = self.tracker.latest
        self.log.event("saved", path=str(out), finetune=self.cfg.finetune, peak_alloc_gib=mem.alloc_gib,
                       peak_reserved_gib=mem.reserved_gib)
        self.log.say(f"saved {self.cfg.finetune} weights: {out}")
        return out

    def summarize(self, saved: Path) -> None:
        rows: list = [None] * self.world_size
        torch.distributed.all_gather_object(rows, self.tracker.table_rows())
        if self.rank == 0:
            table = summary_table(rows)
            self.log.say(table)
            update_run_record(self.run_dir / "run.json", status="completed", steps_completed=self.steps_done,
                              final_losses_rank0=self._last_losses[-5:], saved=str(saved),
                              memory={f"rank{r}": v for r, v in enumerate(rows)})
        self.log.event("done", global_step=self.steps_done)

    def report_oom(self, err: BaseException) -> None:
        """Phase, the micro-batch (ids, grids, tokens) and every rank's last memory numbers."""
        meta = self.current_meta
        samples = []
        if meta is not None:
            for i, sid in enumerate(meta.sample_ids):
                samples.append({"sample_id": sid, "grid_thw": list(meta.grid_thw[i]),
                                "input_tokens": meta.input_tokens[i], "visual_tokens": meta.visual_tokens[i],
                                "supervised_tokens": meta.supervised_tokens[i]})
        self.tracker.snapshot(self.steps_done)
        # steps_done is the index of the step that was running when memory ran out
        report = {"error": "out_of_memory", "message": str(err), "rank": self.rank, "phase": self.phase,
                  "global_step": self.steps_done, "samples": samples, "ranks_memory": all_ranks_memory(self.run_dir)}
        if self.device.type == "cuda":  # what holds the memory, by allocation site (recorded up to step 0's end)
            report["live_allocations"] = live_allocations_by_site(torch.cuda.memory._snapshot())
        write_json(self.run_dir / f"oom_rank{self.rank}.json", report)
        self.log.event("oom", **{k: v for k, v in report.items() if k != "rank"})
        lines = [f"[rank {self.rank}] OUT OF MEMORY in phase {self.phase} at global step {self.steps_done}: {err}"]
        lines += [f"  sample {s['sample_id']}: grid {s['grid_thw']}, {s['input_tokens']} input tokens "
                  f"({s['visual_tokens']} visual, {s['supervised_tokens']} supervised)" for s in samples]
        for m in report["ranks_memory"]:
            if "rank" in m:
                lines.append(f"  rank {m['rank']}: last phase {m['phase']} (step {m['step']}): "
                             f"{m['alloc_gib']:.2f} / {m['reserved_gib']:.2f} GiB ({m['kind']})")
        lines.append(f"  report: {self.run_dir / f'oom_rank{self.rank}.json'}")
        print("\n".join(lines), file=sys.stderr, flush=True)

    def cleanup(self, *, ok: bool) -> None:
        if getattr(self, "log", None) is not None:
            self.log.close()
        # After a failure other ranks may sit in a collective; tearing the group down could wait on them.
        # The launcher ends them once this process exits non-zero.
        if ok and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _is_vision(name: str) -> bool:
    return ".visual." in f".{name}"


def _is_merger(name: str) -> bool:
    return _is_vision(name) and (".merger." in name or "deepstack_merger_list" in name)


def run(cfg: TrainConfig) -> int:
    recipe = Recipe(cfg)
    ok = False
    try:
        try:
            recipe.setup()
            if recipe.rank == 0:
                recipe.log.say(f"training {recipe.total_steps - recipe.start_step} steps "
                               f"(global steps {recipe.start_step}..{recipe.total_steps - 1}) on {recipe.world_size} rank(s)")
            recipe.train()
            saved = recipe.save_final()
            recipe.summarize(saved)
            ok = True
        except torch.OutOfMemoryError as e:
            recipe.report_oom(e)
            _mark_failed(recipe, "out_of_memory", str(e))
            return EXIT_OOM
        except USER_ERRORS as e:
            if getattr(recipe, "log", None) is not None:
                recipe.log.event("error", kind=type(e).__name__, phase=recipe.phase, message=str(e))
            same_on_every_rank = isinstance(e, (ConfigError, PlanError))
            maybe_stall("error_report", 0, recipe.rank)
            if recipe.rank == 0 or not same_on_every_rank or not _rank0_reported():
                print(f"error ({type(e).__name__}, rank {recipe.rank}, phase {recipe.phase}): {e}", file=sys.stderr,
                      flush=True)
            _mark_failed(recipe, type(e).__name__, str(e))
            if recipe.rank == 0 and same_on_every_rank:
                _announce_rank0_reported()
            return EXIT_USAGE
    finally:
        recipe.cleanup(ok=ok)
    return 0


_REPORTED_KEY = "video_ora/rank0_reported"


def _announce_rank0_reported() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.distributed_c10d._get_default_store().set(_REPORTED_KEY, "1")


def _rank0_reported(timeout_s: float = 60.0) -> bool:
    """A configuration or plan error is the same on every rank, so only rank 0 prints it. The others wait
    here until it has: a rank that exited first would have the launcher SIGTERM rank 0 before it printed
    (seen in CI). False (print your own) when rank 0 has not said so within the timeout."""
    import datetime

    if not torch.distributed.is_initialized():
        return False
    try:
        torch.distributed.distributed_c10d._get_default_store().wait(
            [_REPORTED_KEY], datetime.timedelta(seconds=timeout_s))
        return True
    except (RuntimeError, TimeoutError):  # torch raises DistStoreError (a RuntimeError) on timeout
        return False


def _mark_failed(recipe: Recipe, kind: str, message: str) -> None:
    path = recipe.run_dir / "run.json"
    if recipe.rank == 0 and path.exists():
        update_run_record(path, status="failed", error={"kind": kind, "phase": recipe.phase, "message": message})


def die_with_launcher() -> None:
    """torchrun starts every rank in a session of its own, so a kill -9 of torchrun (or of its process group)
    would leave the ranks training on and writing into RUN, beside the run a user resumes there. Under
    torchrun, on Linux, a rank is SIGKILLed when its launcher dies (a plain `python -m train.main` is not
    tied to its shell)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the launcher died before the line above
        os._exit(EXIT_USAGE)


# Fragmentation, not size, is what first fails under a small card's cap (measured on one H200, 12 GiB cap,
# 128 frames: 8.35 GiB allocated + 2.99 GiB reserved-but-unallocated when a 0.74 GiB block was refused).
# Expandable segments let the caching allocator grow blocks in place. Set before CUDA initializes; a value
# the user set is kept (run.json records the variable either way).
ALLOC_CONF = "expandable_segments:True"


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return run(cfg)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: library destructors (gloo, torch) take seconds per rank and every file
    # this process wrote is closed already. An unexpected exception never gets here (normal traceback).
    os._exit(code)
