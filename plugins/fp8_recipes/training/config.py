"""The run's config groups (`trainer`, `model`, `data`, `run_dir`), checked up front, without torch.

    check_run_config(cfg)   # in run_training, before any process group, dataset or model exists

Every problem is a ValueError of one line that names the dotted key, the bad value and the fix, as the recipe
schema's are (recipe/schema.py). This module imports neither torch nor megatron, so a typo costs a second, not the
start-up of a training job.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Mapping

from fp8_recipes.checks import ConfigError, check_keys, choice_error, did_you_mean, is_int, is_number
from fp8_recipes.launcher import launch_world_size
from fp8_recipes.megatron.model_config import check_model_cfg
from fp8_recipes.plan.precision import TRAINER_WORDS, ParallelLayout, expert_ffn_size
from fp8_recipes.rundir import overwrite_problem

__all__ = ["LRScaling", "TrainerConfig", "NONFINITE_ACTIONS", "check_model_cfg", "check_data_cfg",
           "check_compile_caches", "check_writable_dir", "check_writable_file", "check_run_config"]

NONFINITE_ACTIONS = ("skip_then_bf16", "stop")


def _check_type(key: str, value: Any, kind: str) -> None:
    """kind: the dataclass annotation as written ('int', 'float', 'bool', 'str', 'int | None')."""
    if value is None and "None" in kind:
        return
    base = kind.split("|")[0].strip()
    ok = {"int": is_int, "float": is_number, "bool": lambda v: isinstance(v, bool),
          "str": lambda v: isinstance(v, str)}[base](value)
    if not ok:
        want = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string"}[base]
        raise ConfigError(f"{key}: {value!r} is not {want}; set {key}=<{base}>")


# Samples a run may ask for: Megatron-Core's GPTDataset builds its shuffle and sample indices (about 16 bytes per
# sample, int64 past 2^32) in memory before the first step, so 2^31 samples already take ~32 GiB of host memory.
MAX_SAMPLES = 2**31 - 1


# ----------------------------------------------------------------------------------------------------------
# trainer


@dataclasses.dataclass
class LRScaling:
    enabled: bool = False
    """Scale lr and min_lr linearly with the global batch size (off by default: explicit is better)."""
    base_global_batch_size: int | None = None
    """The global batch size the configured lr was tuned for."""


@dataclasses.dataclass
class TrainerConfig:
    max_steps: int = 200
    """Iterations to run (skipped steps included, as Megatron counts them)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward on one data-parallel rank."""
    global_batch_size: int = 16
    """Sequences per optimizer step over all ranks; accumulation = global / (micro × data parallel)."""
    lr: float = 1e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 1e-4
    """Learning rate at the last step (cosine decay from lr)."""
    warmup_steps: int = 20
    """Linear warmup from lr/warmup_steps to lr. A run shorter than this warms up over a tenth of its steps instead
    (lr_warmup_steps; said in one line), so any max_steps runs."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not to norms and biases)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping; the norm is logged either way)."""
    eval_interval: int = 50
    """Validate every this many steps and at the end (0 = never)."""
    eval_iters: int = 10
    """Validation micro-batches per evaluation (the same batches every time)."""
    save_interval: int = 0
    """Checkpoint every this many steps (0 = only at the end)."""
    save_checkpoints: bool = True
    """False: write no checkpoints at all (benchmarks; an 8B-shaped checkpoint is tens of GB)."""
    resume: str | None = None
    """Continue from a checkpoint: auto = run_dir's latest one if it has one (else start fresh) | a run dir, its
    checkpoints dir or a step_N dir | null = start fresh. Exact with the same data and batch sizes."""
    reset_scaling_state: bool = False
    """With trainer.resume: restore weights, optimizer, LR schedule and step but start the scaling state (delayed
    amax histories and scales) fresh, to continue under a changed recipe (another amax_history_len, formats)."""
    log_interval: int = 1
    """Write a metrics row every this many steps."""
    seed: int = 1234
    """Seed for weights, dropout and data order (used by init_distributed in scripts/train.py)."""
    device: str = "auto"
    """auto = a CUDA GPU when there is one, else the CPU | gpu = a CUDA GPU or a one-line refusal (trainer=gpu sets
    it: a GPU run never trains on the CPU unnoticed; Slurm jobs request a GPU per task)."""
    params_dtype: str = "bf16"
    """Model parameter dtype, bf16 | fp32 (aliases bfloat16 | float32); read by training/run.py for build_gpt_model."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size (data parallel = world / (tensor x pipeline x context parallel))."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages: the layers split evenly over them, run by Megatron-Core's 1F1B schedule."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage (interleaved 1F1B); null = one. Needs pipeline_model_parallel_size >= 2."""
    context_parallel_size: int = 1
    """Context parallel: each rank holds 1/CP of every sequence (Transformer Engine's attention; GPUs only)."""
    expert_model_parallel_size: int = 1
    """Expert parallel (MoE models): each EP rank holds 1/EP of every MoE layer's experts; carved out of the data-
    parallel ranks, as in Megatron-LM (the experts' data parallel = world / (expert TP x EP x PP))."""
    expert_tensor_parallel_size: int | None = None
    """Tensor parallelism inside each expert (Megatron-Core's expert_tensor_parallel_size); null = the TP size."""
    sequence_parallel: bool = False
    """With TP > 1: norms, dropout and residuals on 1/TP of the sequence (Megatron's --sequence-parallel)."""
    use_distributed_optimizer: bool = False
    """Shard fp32 main params and Adam moments over the data-parallel ranks (Megatron's distributed optimizer)."""
    overlap_grad_reduce: bool = False
    """Reduce gradient buckets during the backward pass (Megatron-Core's DistributedDataParallel)."""
    overlap_param_gather: bool = False
    """All-gather updated params during the next forward (needs use_distributed_optimizer, overlap_grad_reduce)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients in fp32 buffers (Megatron-LM's --accumulate-allreduce-grads-in-fp32)."""
    gradient_accumulation_fusion: bool | None = None
    """TE backend: the weight-gradient GEMMs accumulate straight into DDP's gradient buffer (Megatron-Core's
    gradient_accumulation_fusion, Megatron-LM's default): no per-micro-batch gradient add. null = on wherever the TE
    backend runs; false = off; true on the emulated backend (nothing to fuse) is said in one line."""
    use_precision_aware_optimizer: bool = False
    """Keep optimizer state in the dtypes below (Transformer Engine's FusedAdam; needs the distributed optimizer)."""
    exp_avg_dtype: str = "fp32"
    """Adam's first moment with the precision-aware optimizer: fp32 | bf16 | fp16."""
    exp_avg_sq_dtype: str = "fp32"
    """Adam's second moment with the precision-aware optimizer: fp32 | bf16 | fp16."""
    main_params_dtype: str = "fp32"
    """Main (master) params with the precision-aware optimizer: fp32 | fp16."""
    main_grads_dtype: str = "fp32"
    """Main grads with the precision-aware optimizer: fp32 | bf16."""
    recompute_granularity: str | None = None
    """Activation recompute: null = off | selective (attention core) | full (whole layers; set recompute_method)."""
    recompute_method: str | None = None
    """With full recompute: uniform (every recompute_num_layers layers) | block (the first N layers per stage)."""
    recompute_num_layers: int | None = None
    """With full recompute: layers per recompute unit (uniform) or recomputed layers per stage (block)."""
    on_nonfinite: str = "skip_then_bf16"
    """A step with a non-finite loss or gradient is always skipped; after max_consecutive_skips in a row:
    skip_then_bf16 = run fallback_bf16_steps steps in BF16, then the plan again | stop = end the run (exit 3)."""
    max_consecutive_skips: int = 5
    """Skipped steps in a row that trigger on_nonfinite's action."""
    fallback_bf16_steps: int = 50
    """With skip_then_bf16: steps run with every GEMM in high precision before the plan resumes."""
    lr_scaling: LRScaling = dataclasses.field(default_factory=LRScaling)

    @classmethod
    def from_cfg(cls, cfg: Any) -> "TrainerConfig":
        """From a dict, DictConfig or TrainerConfig; unknown keys and bad values raise ConfigError(trainer.<key>)."""
        if isinstance(cfg, cls):
            return cfg
        if not isinstance(cfg, dict):  # a DictConfig (a Mapping too): resolved into plain data
            from omegaconf import OmegaConf
            cfg = OmegaConf.to_container(cfg, resolve=True)
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        check_keys("trainer", cfg, fields)
        values = dict(cfg)
        scaling = values.pop("lr_scaling", None) or {}
        if not isinstance(scaling, Mapping):
            raise ConfigError(f"trainer.lr_scaling: {scaling!r} is not a mapping (keys enabled, base_global_batch_size)")
        scaling_fields = {f.name: f.type for f in dataclasses.fields(LRScaling)}
        check_keys("trainer.lr_scaling", scaling, scaling_fields)
        for key, value in values.items():
            _check_type(f"trainer.{key}", value, fields[key])
        for key, value in scaling.items():
            _check_type(f"trainer.lr_scaling.{key}", value, scaling_fields[key])
        out = cls(**values, lr_scaling=LRScaling(**scaling))
        out.validate()
        return out

    def validate(self) -> None:
        for key in ("max_steps", "micro_batch_size", "global_batch_size", "log_interval", "tensor_model_parallel_size",
                    "pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
                    "max_consecutive_skips", "fallback_bf16_steps"):
            if not is_int(getattr(self, key)) or getattr(self, key) < 1:
                raise ConfigError(f"trainer.{key}={getattr(self, key)!r}: must be an integer >= 1")
        samples = self.max_steps * self.global_batch_size
        if samples > MAX_SAMPLES:
            raise ConfigError(f"trainer.max_steps={self.max_steps} x trainer.global_batch_size={self.global_batch_size}"
                             f" = {samples:,} samples: Megatron-Core's dataset index for them would not fit in memory "
                             f"(at most {MAX_SAMPLES:,}); lower trainer.max_steps")
        for key in ("warmup_steps", "eval_interval", "eval_iters", "save_interval", "seed"):
            if not is_int(getattr(self, key)) or getattr(self, key) < 0:
                raise ConfigError(f"trainer.{key}={getattr(self, key)!r}: must be an integer >= 0")
        if self.seed >= 2**32:  # NumPy's generators (Megatron-Core's dataset shuffling) take 32-bit seeds
            raise ConfigError(f"trainer.seed={self.seed}: must be below 2**32 = {2**32:,}; pick a smaller seed")
        if not (is_number(self.lr) and self.lr > 0):
            raise ConfigError(f"trainer.lr={self.lr!r}: must be a number > 0 (e.g. 2.0e-3)")
        if not (is_number(self.min_lr) and 0 <= self.min_lr <= self.lr):
            raise ConfigError(f"trainer.min_lr={self.min_lr}: must lie in [0, trainer.lr={self.lr}]")
        for key in ("adam_beta1", "adam_beta2"):
            if not (is_number(getattr(self, key)) and 0 <= getattr(self, key) < 1):
                raise ConfigError(f"trainer.{key}={getattr(self, key)!r}: must lie in [0, 1) (e.g. 0.9)")
        if not (is_number(self.adam_eps) and self.adam_eps > 0):
            raise ConfigError(f"trainer.adam_eps={self.adam_eps!r}: must be a number > 0 (e.g. 1.0e-8)")
        for key in ("weight_decay", "clip_grad"):
            if not (is_number(getattr(self, key)) and getattr(self, key) >= 0):
                raise ConfigError(f"trainer.{key}={getattr(self, key)!r}: must be a number >= 0 (0 = off)")
        if self.params_dtype not in ("bf16", "fp32", "bfloat16", "float32"):
            raise choice_error("trainer.params_dtype", self.params_dtype, ("bf16", "fp32"))
        if self.device not in ("auto", "gpu"):
            raise choice_error("trainer.device", self.device, ("auto", "gpu"))
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise choice_error("trainer.on_nonfinite", self.on_nonfinite, NONFINITE_ACTIONS)
        if self.resume is not None and self.resume != "auto" and not Path(self.resume).is_dir():
            raise ConfigError(f"trainer.resume={self.resume!r}: no such directory; give auto, a run dir, its "
                             f"checkpoints dir or a step_N dir (null = start fresh)")
        self._validate_engine()
        if self.lr_scaling.enabled and not (self.lr_scaling.base_global_batch_size or 0) >= 1:
            raise ConfigError("trainer.lr_scaling.base_global_batch_size must be set (>= 1) when lr_scaling.enabled")

    def _validate_engine(self) -> None:
        """The parallel layout and Megatron-Core engine keys: the combinations Megatron-Core asserts on."""
        etp = self.expert_tensor_parallel_size
        if etp is not None and etp < 1:
            raise ConfigError(f"trainer.expert_tensor_parallel_size={etp}: must be an integer >= 1 (null = the "
                             f"tensor-parallel size)")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and (vpp < 2 or self.pipeline_model_parallel_size < 2):
            raise ConfigError(f"trainer.virtual_pipeline_model_parallel_size={vpp}: needs an integer >= 2 and "
                             f"trainer.pipeline_model_parallel_size >= 2 (null = no interleaving)")
        if self.sequence_parallel and self.tensor_model_parallel_size < 2:
            raise ConfigError("trainer.sequence_parallel=true needs trainer.tensor_model_parallel_size >= 2 (it splits "
                             "the sequence over the tensor-parallel ranks); set it to false")
        if self.overlap_param_gather and not (self.use_distributed_optimizer and self.overlap_grad_reduce):
            raise ConfigError("trainer.overlap_param_gather=true needs trainer.use_distributed_optimizer=true and "
                             "trainer.overlap_grad_reduce=true")
        dtypes = {"exp_avg_dtype": ("fp32", "bf16", "fp16"), "exp_avg_sq_dtype": ("fp32", "bf16", "fp16"),
                  "main_params_dtype": ("fp32", "fp16"), "main_grads_dtype": ("fp32", "bf16")}
        for key, allowed in dtypes.items():
            value = getattr(self, key)
            if value not in allowed:
                raise choice_error(f"trainer.{key}", value, allowed)
            if value != "fp32" and not self.use_precision_aware_optimizer:
                raise ConfigError(f"trainer.{key}={value}: needs trainer.use_precision_aware_optimizer=true")
        if self.context_parallel_size > 1 and self.params_dtype not in ("bf16", "bfloat16"):
            # TE's attention with CP runs FlashAttention or cuDNN's fused attention, both BF16/FP16 only; its unfused
            # fallback (the one FP32 attention) has no CP: "No dot product attention backend" at the first forward
            raise ConfigError(f"trainer.context_parallel_size={self.context_parallel_size} needs "
                             f"trainer.params_dtype=bf16: Transformer Engine's context-parallel attention takes BF16 "
                             f"inputs only (not {self.params_dtype}); set trainer.params_dtype=bf16")
        if self.use_precision_aware_optimizer and not self.use_distributed_optimizer:
            raise ConfigError("trainer.use_precision_aware_optimizer=true needs trainer.use_distributed_optimizer=true "
                             "(Megatron-Core keeps the low-precision state in the distributed optimizer's shards)")
        choices = (None, "selective", "full")
        if self.recompute_granularity not in choices:
            raise choice_error("trainer.recompute_granularity", self.recompute_granularity, choices)
        if self.recompute_granularity == "full":
            if self.recompute_method not in ("uniform", "block"):
                raise ConfigError(f"trainer.recompute_method={self.recompute_method!r}: full recompute needs uniform "
                                 f"| block")
            if not (is_int(self.recompute_num_layers) and self.recompute_num_layers >= 1):
                raise ConfigError(f"trainer.recompute_num_layers={self.recompute_num_layers!r}: full recompute needs "
                                 f"an integer >= 1")
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            raise ConfigError("trainer.recompute_method / recompute_num_layers apply to "
                             "trainer.recompute_granularity=full only; set them to null")

    @property
    def lr_warmup_steps(self) -> int:
        """The LR warmup the schedule runs: warmup_steps, or a tenth of max_steps when the run is shorter than it
        (the default 20 of 200); training/notices.py says so."""
        return self.warmup_steps if self.warmup_steps <= self.max_steps else self.max_steps // 10

    @property
    def model_parallel_size(self) -> int:
        """Ranks per model replica: tensor x pipeline x context parallel."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def expert_tensor_parallel(self) -> int:
        """The experts' tensor-parallel size: expert_tensor_parallel_size, or the TP size when null (Megatron-Core's
        default)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def check_experts(self, model: Mapping[str, Any], world_size: int) -> None:
        """Refuse in one line an expert-parallel layout Megatron-Core cannot build: expert parallelism of a dense model,
        experts that do not split evenly over the EP ranks or over expert TP, ranks that do not split into expert TP x
        EP x PP (the rules' one home: ParallelLayout.check_experts), and tensor parallelism of an MoE model without
        sequence parallelism (Megatron-Core's MoELayer refuses to train so, at the first forward pass). After
        check_layout (the ranks split into TP x PP x CP)."""
        experts = model.get("num_moe_experts")
        if experts is not None and self.tensor_model_parallel_size > 1 and not self.sequence_parallel:
            raise ConfigError(f"trainer.tensor_model_parallel_size={self.tensor_model_parallel_size} with an MoE model "
                              f"needs trainer.sequence_parallel=true (Megatron-Core's MoE layer trains tensor "
                              f"parallelism only with it; the te backend); or split the experts with "
                              f"trainer.expert_tensor_parallel_size or expert_model_parallel_size at "
                              f"tensor_model_parallel_size=1")
        ffn = None if experts is None else expert_ffn_size(model)
        layout = ParallelLayout(tp=self.tensor_model_parallel_size, pp=self.pipeline_model_parallel_size,
                                cp=self.context_parallel_size, dp=world_size // self.model_parallel_size,
                                ep=self.expert_model_parallel_size, etp=self.expert_tensor_parallel_size)
        layout.check_experts(experts, ffn, TRAINER_WORDS)

    def check_layout(self, world_size: int, num_layers: int) -> int:
        """The data-parallel size at ``world_size`` ranks, after refusing in one line a layout Megatron-Core cannot
        build or schedule: ranks, layers per (virtual) stage, micro-batches per interleaved step."""
        mp = self.model_parallel_size
        if world_size % mp:
            raise ConfigError(f"trainer.tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size "
                             f"= {self.tensor_model_parallel_size} x {self.pipeline_model_parallel_size} x "
                             f"{self.context_parallel_size} = {mp} does not divide the {world_size} launched "
                             f"processes; launch a multiple of {mp} or lower them")
        chunks = self.pipeline_model_parallel_size * (self.virtual_pipeline_model_parallel_size or 1)
        if num_layers % chunks:
            raise ConfigError(f"model.num_layers={num_layers} is not divisible by pipeline x virtual pipeline = "
                             f"{chunks}; pick trainer.pipeline_model_parallel_size / "
                             f"virtual_pipeline_model_parallel_size that divide it")
        dp = world_size // mp
        accumulation = self.gradient_accumulation_steps(dp)
        pp = self.pipeline_model_parallel_size
        if self.virtual_pipeline_model_parallel_size:
            for key, n in (("global_batch_size", accumulation), ("eval_iters", self.eval_iters)):
                if key == "eval_iters" and (n == 0 or self.eval_interval == 0):
                    continue
                if n < pp or n % pp:
                    what = (f"{accumulation} micro-batches per step (global / (micro x data parallel))"
                            if key == "global_batch_size" else f"trainer.eval_iters={n}")
                    raise ConfigError(f"trainer.{key}: the interleaved schedule needs a multiple of "
                                     f"pipeline_model_parallel_size={pp} micro-batches; {what} is not")
        return dp

    def check_sequence(self, seq_length: int) -> None:
        """Refuse in one line a ``model.seq_length`` the sequence splits cannot cut: context parallelism gives each CP
        rank two of 2 x CP equal chunks of every sequence (load-balanced causal attention: Megatron-Core's
        get_batch_on_this_cp_rank and Transformer Engine's attention need it; Megatron-LM asserts it), and sequence
        parallelism splits each CP rank's share over the TP ranks (Megatron-Core's scatter asserts it). Otherwise the
        first micro-batch fails inside Megatron-Core, after the data and the model were built."""
        cp, tp = self.context_parallel_size, self.tensor_model_parallel_size
        need, why = 1, []
        if cp > 1:
            need, why = 2 * cp, [f"2 x trainer.context_parallel_size = {2 * cp} equal chunks"]
        if self.sequence_parallel:
            need = math.lcm(need, cp * tp)
            per_rank = f"each context-parallel rank's 1/{cp} into " if cp > 1 else ""
            why.append(f"{per_rank}trainer.tensor_model_parallel_size={tp} sequence-parallel parts")
        if seq_length % need:
            raise ConfigError(f"model.seq_length={seq_length} does not split into {' and '.join(why)}; set "
                             f"model.seq_length to a multiple of {need}")

    def gradient_accumulation_steps(self, data_parallel_size: int) -> int:
        per_step = self.micro_batch_size * data_parallel_size
        if self.global_batch_size % per_step:
            fix = f"set trainer.global_batch_size={per_step} (or a multiple)"
            mbs = math.gcd(self.micro_batch_size, self.global_batch_size // data_parallel_size)
            if self.global_batch_size % data_parallel_size == 0:
                fix += f" or trainer.micro_batch_size={mbs}"
            raise ConfigError(f"trainer.global_batch_size={self.global_batch_size} is not a multiple of "
                             f"micro_batch_size x data parallel = {self.micro_batch_size} x {data_parallel_size} = "
                             f"{per_step}; {fix}")
        return self.global_batch_size // per_step


# ----------------------------------------------------------------------------------------------------------
# data

DATA_KEYS = ("path", "inputs", "tokenizer", "vocab_size", "json_key", "split")


def check_writable_dir(key: str, path: Any, fix: str | None = None) -> None:
    """``path`` is (or can be created as) a directory this process can write into; ``fix``: what to do instead of
    pointing ``key`` at another directory (a file's key: check_writable_file)."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{key}: {path!r} is not a directory path; {fix or f'set {key}=<directory>'}")
    p = Path(path).absolute()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{key}: {path!r} is a file, not a directory; {fix or f'point {key} at a directory'}")
    ancestor = p
    while not ancestor.exists():
        ancestor = ancestor.parent
    fix = fix or f"point {key} at a writable directory"
    if not ancestor.is_dir():
        raise ConfigError(f"{key}: {path!r} cannot be created ({str(ancestor)!r} is a file); {fix}")
    if not os.access(ancestor, os.W_OK | os.X_OK) or str(ancestor).startswith(("/proc", "/sys")):
        raise ConfigError(f"{key}: {path!r} is not writable ({str(ancestor)!r}); {fix}")


COMPILE_CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
"""Environment variables naming where torch.compile (Inductor) and Triton keep the kernels they compile."""


def check_compile_caches(gpu: bool, environ: Mapping[str, str] = os.environ) -> None:
    """The compilers' cache directories a user set (COMPILE_CACHES), where the run uses them: one line naming the
    variable instead of a traceback. On a GPU both are written: every run compiles Megatron-Core's fused kernels
    (bias-activation, bias-dropout-add, cross entropy: torch.compile, Inductor's Triton kernels), NVFP4's passes and
    the statistics kernels (Triton) at their first call, hours in for a statistics step. On the CPU nothing compiles
    (no fusion, NVFP4 and statistics eager), so TRITON_CACHE_DIR is never read; but torch creates
    TORCHINDUCTOR_CACHE_DIR as soon as anything is decorated with torch.compile (Transformer Engine's import, the
    optimizer's constructor), so there it must be a directory or creatable."""
    for var in COMPILE_CACHES:
        value = environ.get(var)
        if value is not None and (gpu or (var == "TORCHINDUCTOR_CACHE_DIR" and not (value and Path(value).is_dir()))):
            check_writable_dir(var, value)


def check_writable_file(key: str, path: str | os.PathLike, example: str) -> None:
    """``path`` can be written as a file: not a directory, in a directory this process can write or create."""
    if Path(path).is_dir():
        raise ConfigError(f"{key}: '{path}' is a directory; give a file path, e.g. {example}")
    problem = overwrite_problem(path)
    if problem:
        raise ConfigError(f"{key}: '{path}' {problem}; give another file path, e.g. {example}")
    check_writable_dir(key, str(Path(path).absolute().parent),
                       f"give a file path in a writable directory, e.g. {example}")  # (not: point it at a directory)


def check_data_cfg(cfg: Mapping[str, Any]) -> None:
    """The `data` group: keys, tokenizer settings, split weights, inputs that exist, a usable dataset path."""
    check_keys("data", cfg, DATA_KEYS)
    tok = cfg.get("tokenizer", "bpe")
    if tok not in ("bpe", "bytes"):
        raise choice_error("data.tokenizer", tok, ("bpe", "bytes"))
    vocab = cfg.get("vocab_size", 4096)
    if tok == "bpe" and not (is_int(vocab) and 258 <= vocab <= 65500):  # 256 bytes + EOD + >=1 merge; uint16 ids
        raise ConfigError(f"data.vocab_size={vocab!r}: must be an integer in 258..65500 (e.g. 4096)")
    if not isinstance(cfg.get("json_key", "text"), str):
        raise ConfigError(f"data.json_key={cfg.get('json_key')!r}: must be a string (the .jsonl text field)")
    split = cfg.get("split", "98,1,1")
    parts = str(split).split(",") if isinstance(split, str) else []
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        weights = []
    if len(weights) != 3 or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"data.split={split!r}: must be three non-negative comma-separated weights, e.g. '98,1,1' "
                         f"(quote it on the command line: data.split='98,1,1')")
    inputs = cfg.get("inputs")
    if inputs is not None:
        items = [inputs] if isinstance(inputs, str) else inputs
        if not isinstance(items, (list, tuple)) or not items:
            raise ConfigError(f"data.inputs={inputs!r}: give a file, a directory or a list of them (null = stdlib)")
        for item in items:
            if not isinstance(item, str) or not Path(item).exists():
                raise ConfigError(f"data.inputs: {item!r} does not exist; point data.inputs at .jsonl/.txt/.py files "
                                 f"or a directory (null = the Python standard library)")
    check_writable_dir("data.path", cfg.get("path"))


# ----------------------------------------------------------------------------------------------------------
# the whole run

RUN_KEYS = {"model", "data", "trainer", "run_dir", "recipe", "debug", "autopilot"}
"""Top-level keys of conf/train.yaml; a module adding a group extends this set."""


def _resolved(cfg: Any) -> dict:
    """The config as plain data; an interpolation that cannot be resolved is named by its own dotted key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as e:
        raw = OmegaConf.to_container(cfg, resolve=False)

        def leaves(node, prefix=""):
            for k, v in node.items() if isinstance(node, dict) else enumerate(node):
                key = f"{prefix}{k}" if isinstance(node, dict) else f"{prefix[:-1]}[{k}]."
                if isinstance(v, (dict, list)):
                    yield from leaves(v, key + "." if isinstance(node, dict) else key)
                else:
                    yield key.rstrip("."), v

        bad = next((k for k, v in leaves(raw) if isinstance(v, str) and "${" in v and _fails(cfg, k)), "(config)")
        raise ConfigError(f"{bad}: {str(e).splitlines()[0]}; fix the ${{...}} reference") from None


def _fails(cfg: Any, key: str) -> bool:
    from omegaconf import OmegaConf

    try:
        OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
        return False
    except Exception:  # noqa: BLE001 - any resolution failure names this key
        return True


def check_run_config(cfg: Any, world_size: int | None = None) -> TrainerConfig:
    """Check every group of a composed train config before anything is built; return the trainer config.
    ``world_size``: the processes the run will have (default: what the launcher started here; a Slurm job's
    nodes x tasks per node when checked on the submitting host)."""
    container = dict(cfg) if isinstance(cfg, dict) else _resolved(cfg)
    unknown = sorted(set(container) - RUN_KEYS)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown top-level key{did_you_mean(unknown[0], RUN_KEYS)}; known: "
                         f"{', '.join(sorted(RUN_KEYS))}")
    for group in ("trainer", "model", "data"):
        if not isinstance(container.get(group), Mapping):
            raise ConfigError(f"{group}: {container.get(group)!r} is not a config group; pick one with {group}=NAME")
    trainer = TrainerConfig.from_cfg(container["trainer"])
    model, data = container["model"], container["data"]
    # trainer.device=gpu runs on CUDA or not at all (a Slurm job checked on its submitting host: the GPU's advice);
    # auto is known once torch loads, and run.py's check_model_device checks the keys that depend on it then
    check_model_cfg(model, vocab_may_be_unset=True, tensor_parallel=trainer.tensor_model_parallel_size,
                    device="cuda" if trainer.device == "gpu" else None)
    trainer.check_layout(world_size or launch_world_size(), int(model["num_layers"]))
    trainer.check_experts(model, world_size or launch_world_size())
    trainer.check_sequence(int(model["seq_length"]))
    check_data_cfg(data)
    train_share, valid_share, _ = (float(w) for w in str(data.get("split", "98,1,1")).split(","))
    if train_share == 0:
        raise ConfigError(f"data.split={data.get('split')!r} gives the train split no share; give it one "
                         f"(e.g. '98,1,1')")
    if valid_share == 0 and trainer.eval_iters > 0:
        raise ConfigError(f"data.split={data.get('split')!r} gives the valid split no share, but trainer.eval_iters="
                         f"{trainer.eval_iters} reads validation batches; give it one (e.g. '98,1,1') or set "
                         f"trainer.eval_iters=0 trainer.eval_interval=0 (no validation)")
    tokenizer_vocab = 257 if data.get("tokenizer") == "bytes" else data.get("vocab_size")
    if model.get("vocab_size") is not None and model["vocab_size"] < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size: {model['vocab_size']} is smaller than the tokenizer's {tokenizer_vocab}; "
                         f"set model.vocab_size=${{data.vocab_size}} (or null) or larger")
    check_writable_dir("run_dir", container.get("run_dir"))
    return trainer
