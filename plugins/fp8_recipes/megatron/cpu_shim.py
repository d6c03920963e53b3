"""Let Megatron-Core's local (non-Transformer-Engine) GPT path run on a machine without CUDA.

Megatron-Core 0.19 assumes CUDA in three places that the CPU training path reaches (docs/facts.md,
"Megatron-Core on the CPU", names the first two; the third is hit as soon as no attention mask is passed);
everything else works with ``use_cpu_initialization=True`` and gloo:

1. **The model-parallel RNG tracker.** Dropout inside tensor-parallel regions runs under
   ``tensor_parallel.get_cuda_rng_tracker().fork()``, whose states are created by
   ``model_parallel_cuda_manual_seed`` through ``torch.cuda.get_rng_state`` / ``torch.cuda.manual_seed``
   and swapped in and out by ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``.
   Without CUDA, the first call fails ("Found no NVIDIA driver"). The shim keeps the tracker and its
   named states (data-parallel, model-parallel, expert-parallel seeds, with Megatron's seed offsets) but
   stores **CPU generator** states, so forked regions still draw from their own reproducible stream.
2. **``torch.cuda.current_device()``**, used as a ``device=`` argument when RoPE moves ``inv_freq`` at
   the first forward (``rotary_pos_embedding.py``) and when the global memory buffer allocates
   (``utils.GlobalMemoryBuffer.get_tensor``, reached by sequence-parallel all-gathers). The shim makes it
   return ``"cpu"``; without CUDA the original can only raise, so nothing that worked before changes.
3. **The default causal mask.** With ``attention_mask=None`` the local ``DotProductAttention`` softmax
   (``fusions/fused_softmax.py``) builds its mask with ``transformer.utils.get_default_causal_mask``, which
   hard-codes ``device="cuda"``. The shim substitutes a cached CPU mask (same values: True above the
   diagonal = masked), so training batches need no ``[b, 1, s, s]`` mask tensor.

Megatron-Core's engine (DistributedDataParallel, its optimizers, the pipeline schedules) assumes CUDA in more
places, each only as a device or a type name: ``torch.tensor(..., device="cuda")`` for flags, norms and token counts
(optimizer.py ``_scale_one``, clip_grads.py, schedules.py ``total_num_tokens``), ``param.type() in
["torch.cuda.BFloat16Tensor", ...]`` to sort params into main-param groups (optimizer.py,
distrib_optimizer.py), ``torch.cuda.current_stream()`` (param_and_grad_buffer.py, for CUDA-graph events) and
``torch.cuda.synchronize()`` (p2p_communication.py, after batched sends). So:

4. ``torch.cuda.synchronize`` becomes a no-op and ``torch.cuda.current_stream`` a stream that waits for
   nothing (CPU work is synchronous).
5. :func:`cuda_as_cpu` is a context in which a factory call with ``device="cuda"`` (or a CUDA index) makes a
   CPU tensor, ``tensor.cuda()`` keeps a tensor where it is and ``tensor.type()`` names a CPU tensor as its CUDA
   twin (a ``TorchFunctionMode``: a few microseconds per torch call inside it, nothing outside). training/engine.py
   runs the engine's calls inside it on the CPU, and megatron/model.py the model's build (a tied LM head on the last
   of several stages: ``weight.data.cuda()`` before its all-reduce).
6. Not a CUDA assumption but the CPU's: on a CPU without BF16 matrix instructions (no ``avx512_bf16`` /
   ``amx_bf16``), a BF16 matmul (``torch.matmul``/``mm``/``bmm``/``baddbmm``, their tensor methods,
   ``F.linear``) runs as an fp32 matmul of the same (exactly widened) operands, rounded once to BF16: what a BF16
   GEMM computes (fp32 accumulation, one rounding), up to summation order. Measured on an AVX2-only EPYC with
   torch 2.14.1: a 2048x128 @ 128x4096 BF16 matmul takes 3.9 s natively and 0.06 s this way (the tiny model's
   step: 6.5 s -> well under a second).

``install_cpu_shim()`` is idempotent and does nothing when CUDA is available. Importing this module
patches nothing.
"""

from __future__ import annotations

import functools
import logging

import torch

__all__ = ["install_cpu_shim", "is_cpu_shim_installed", "cpu_model_parallel_manual_seed", "cuda_as_cpu"]

logger = logging.getLogger(__name__)

_installed = False


def is_cpu_shim_installed() -> bool:
    """Whether :func:`install_cpu_shim` has patched Megatron-Core in this process."""
    return _installed


def _cpu_get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Stand-in for ``random._get_cuda_rng_state``: the CPU default generator's state (always a copy)."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    """Stand-in for ``random._set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


def _cpu_state_for_seed(seed: int) -> torch.Tensor:
    """The CPU generator state after ``manual_seed(seed)``, leaving the current state untouched."""
    return torch.Generator().manual_seed(seed).get_state()


def cpu_model_parallel_manual_seed(seed: int, *args, tp_rank: int | None = None,
                                   ep_rank: int | None = None, etp_rank: int | None = None,
                                   **kwargs) -> None:
    """CPU version of ``tensor_parallel.model_parallel_cuda_manual_seed`` (same signature, same seeds).

    Seeds the CPU default generator with ``seed`` (Megatron's "default"/data-parallel stream) and fills
    the RNG tracker with the data-, tensor- and expert-parallel states that Megatron derives from it
    (``seed``, ``seed + 2718 + tp_rank``, ``seed + 1024 + 100 * ep_rank + etp_rank``). TE's tracker,
    CUDA-graph-safe states and GTP weight rematerialisation have no meaning on the CPU and are ignored.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if ep_rank is None:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
    if etp_rank is None:
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    # Always the plain tracker: the TE tracker needs CUDA, the cudagraph one needs CUDA graphs.
    mp_random.initialize_rng_tracker(use_te_rng_tracker=False, force_reset=True)
    tracker = mp_random.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.set_states({
        mp_random._DATA_PARALLEL_RNG_TRACKER_NAME: _cpu_state_for_seed(seed),
        mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME: _cpu_state_for_seed(seed + 2718 + tp_rank),
        mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME: _cpu_state_for_seed(seed + 1024 + 100 * ep_rank + etp_rank),
    })


def _cpu_current_device() -> str:
    """Stand-in for ``torch.cuda.current_device`` when there is no CUDA: Megatron uses it as ``device=``."""
    return "cpu"


@functools.lru_cache(maxsize=32)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """Stand-in for ``transformer.utils.get_default_causal_mask`` (which allocates on "cuda")."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


class _NullStream:
    """What Megatron-Core uses of a CUDA stream, for a CPU whose work is synchronous: waits for nothing."""

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def record_event(self, *args, **kwargs) -> None:
        pass


def _no_sync(*args, **kwargs) -> None:
    """Stand-in for ``torch.cuda.synchronize`` on the CPU."""


_CUDA_TYPE_NAMES = {torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.float32: "torch.cuda.FloatTensor"}


def _is_cuda_device(device) -> bool:
    return (device == "cuda" or (isinstance(device, str) and device.startswith("cuda:"))
            or (isinstance(device, torch.device) and device.type == "cuda")
            or (isinstance(device, int) and not isinstance(device, bool)))


@functools.lru_cache(maxsize=1)
def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU has BF16 matrix instructions (Linux: /proc/cpuinfo flags; elsewhere assumed yes)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return True
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def _widened(func):
    """``func`` with BF16 CPU operands computed in fp32 and the result rounded to BF16 (item 6 above)."""

    @functools.wraps(func)
    def run(*args, **kwargs):
        if any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 and a.device.type == "cpu" for a in args):
            args = [a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in args]
            return func(*args, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)

    run.__fp8_recipes_widened__ = True
    return run


def _widen_bf16_matmuls() -> None:
    import torch.nn.functional as F

    for owner, name in ((torch, "matmul"), (torch, "mm"), (torch, "bmm"), (torch, "baddbmm"), (F, "linear"),
                        (torch.Tensor, "matmul"), (torch.Tensor, "mm"), (torch.Tensor, "bmm"),
                        (torch.Tensor, "__matmul__")):
        func = getattr(owner, name)
        if not getattr(func, "__fp8_recipes_widened__", False):
            setattr(owner, name, _widened(func))


class _CudaAsCpu(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # the optimizers' param sorting
            return _CUDA_TYPE_NAMES.get(args[0].dtype) or func(*args)
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def cuda_as_cpu():
    """A context for Megatron-Core's engine calls on the CPU (see the module docstring, 5.); a no-op context when
    CUDA is available."""
    import contextlib

    return _CudaAsCpu() if not torch.cuda.is_available() else contextlib.nullcontext()


def _keep_freed_memory() -> bool:
    """Ask glibc to keep freed large blocks instead of returning them to the OS.

    Not a CUDA assumption but the CPU's biggest hidden cost: every step allocates and frees the same multi-MB
    activations (and the emulated backend its quantized copies); glibc serves such blocks with mmap and unmaps
    them on free, so the next step page-faults every page back in (millions of minor faults per run). Measured:
    fake-quantizing a 2048x512 tensor 3.2 ms -> 1.9 ms. A no-op where the C library is not glibc.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def install_cpu_shim() -> bool:
    """Patch Megatron-Core's CUDA assumptions so the local GPT spec trains on the CPU.

    Returns True when the shim is (now or already) installed, False when CUDA is available and nothing
    was patched. Call it before building the model and before seeding.
    """
    global _installed
    if _installed:
        return True
    if torch.cuda.is_available():
        return False

    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mp_random

    # 1. RNG tracker: module globals, looked up at call time by fork(), get/set_all_rng_states and
    #    activation checkpointing. The seed function is re-exported by `tensor_parallel`, so patch both names.
    mp_random._get_cuda_rng_state = _cpu_get_rng_state
    mp_random._set_cuda_rng_state = _cpu_set_rng_state
    mp_random.model_parallel_cuda_manual_seed = cpu_model_parallel_manual_seed
    tensor_parallel.model_parallel_cuda_manual_seed = cpu_model_parallel_manual_seed

    # 2. torch.cuda.current_device: used only as a device= argument by RoPE and GlobalMemoryBuffer.
    torch.cuda.current_device = _cpu_current_device

    # 3. The causal mask: fused_softmax imported the function by name, so patch it there as well.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    transformer_utils.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask

    # 4. Streams and synchronization: CPU work is synchronous.
    torch.cuda.synchronize = _no_sync
    torch.cuda.current_stream = lambda *args, **kwargs: _NullStream()

    # Memory: see _keep_freed_memory.
    _keep_freed_memory()

    # 6. BF16 matmuls on a CPU without BF16 matrix instructions.
    if not cpu_has_bf16_matmul():
        _widen_bf16_matmuls()

    _installed = True
    logger.debug("cpu_shim: Megatron-Core RNG tracker -> CPU generator; torch.cuda.current_device() -> 'cpu'; "
                 "default causal mask -> CPU")
    return True
