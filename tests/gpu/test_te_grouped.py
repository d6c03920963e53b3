"""Megatron-Core's TE experts quantize like the emulated experts (issue 28, item 4): Transformer Engine 2.20.2's
GroupedLinear keeps one quantizer per expert GEMM, and each expert's operands are its own split of the tokens.

Checked against fp8_recipes.numerics, bit for bit, on every step of SPLITS (uneven splits, experts without tokens):
- delayed scaling: after each step, every expert GEMM's amax history and scale (input, weight, grad_output) equal
  a DelayedScaler fed that expert's own split; for an expert without tokens TE neither records an amax nor rolls
  the input's and grad_output's histories (their scales stay), while the weight's rolls;
- current (tensorwise; E4M3 forward, E5M2 gradients) and block scaling (1x128 activations and gradients, 128x128
  weights, power-of-two scales, E4M3), each operand as TE quantized it inside GroupedLinear (captured when it is
  made, before any GEMM or usage change) against quantize() on that operand alone:
  - the forward input's splits and the backward grad_output's splits (TE's split quantization), and each expert's
    weight (TE's quantize_weight, once per expert and step, an expert without tokens included);
  - the rowwise FP8 codes and scale_inv (per tensor: the split's one scale_inv; blocks: TE's padded scale tensor,
    1x128's transposed, cut to the blocks that exist) and the columnwise copy the second GEMM reads (wgrad for the
    input and grad_output, dgrad for the weight): the operand transposed, quantized with quantize(columnwise=True)
    (128x1 blocks for 1x128, the same 128x128 blocks, the same per-tensor scale), and its block scale_inv;
  - that this copy exists (block tensors carry one; per-tensor ones a transpose on GPUs with only TN FP8 GEMMs,
    Hopper), that TE's FP8 format is the policy's, and that an empty split gets no FP8 data.
Not compared (nothing meaningful there): the padding of block scale tensors (allocated, never written), the
scale_inv of an empty per-tensor split (allocated, never written), a per-tensor transpose's scale_inv (the
rowwise one, the same tensor) and current scaling's amax (a scratch buffer TE does not keep).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp8_recipes.backends.te import te_available, te_recipe
from fp8_recipes.numerics import DelayedScaler, nan_ignoring_amax, quantize
from fp8_recipes.plan.precision import TERecipe
from fp8_recipes.recipe.schema import Format, Scaling, TensorPolicy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                                                  reason="needs a CUDA GPU with Transformer Engine")]

EXPERTS, K, N = 4, 256, 384
SPLITS = [[48, 0, 80, 128], [16, 112, 0, 128], [0, 0, 256, 0], [64, 64, 64, 64], [96, 32, 0, 128]]
"""Tokens per expert per step (multiples of 16, TE's FP8 GEMM rule; an expert without tokens in most steps)."""
KINDS = ["Float8CurrentScaling", "block1d"]


def grouped(dtype=torch.bfloat16):
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    return te.GroupedLinear(EXPERTS, K, N, bias=False, params_dtype=dtype, device="cuda")


def step_inputs(step: int, splits: list[int]):
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    scale = [1.0, 10.0, 0.1, 100.0, 3.0][step % 5]
    x = (torch.randn(sum(splits), K, device="cuda", generator=g) * scale).bfloat16().requires_grad_()
    dy = (torch.randn(sum(splits), N, device="cuda", generator=g) * scale * 1e-3).bfloat16()
    return x, dy


def run_step(module, recipe, splits, x, dy):
    import transformer_engine.pytorch as te

    with te.autocast(enabled=True, recipe=recipe):
        y = module(x, splits)
    y.backward(dy)


def test_delayed_histories_and_scales_are_per_expert():
    fwd = TensorPolicy(scaling=Scaling.DELAYED, amax_history_len=4)
    bwd = dataclasses.replace(fwd, format=Format.E5M2)
    recipe = te_recipe(TERecipe("DelayedScaling", fwd, fwd, bwd), reduce_amax=False)
    module = grouped()
    ours = [{"input": DelayedScaler(fwd, "cuda"), "weight": DelayedScaler(fwd, "cuda"),
             "grad_output": DelayedScaler(bwd, "cuda")} for _ in range(EXPERTS)]
    for step, splits in enumerate(SPLITS):
        x, dy = step_inputs(step, splits)
        run_step(module, recipe, splits, x, dy)
        for e, (xs, dys) in enumerate(zip(torch.split(x, splits), torch.split(dy, splits))):
            w = getattr(module, f"weight{e}")
            for name, t in (("input", xs), ("weight", w), ("grad_output", dys)):
                if t.numel() == 0:  # an empty split neither records nor rolls (what TE does: measured here)
                    continue
                ours[e][name].observe(nan_ignoring_amax(t))
                ours[e][name].update()
        fwd_meta, bwd_meta = module.fp8_meta["scaling_fwd"], module.fp8_meta["scaling_bwd"]
        for e in range(EXPERTS):
            for name, meta, i in (("input", fwd_meta, 3 * e), ("weight", fwd_meta, 3 * e + 1),
                                  ("grad_output", bwd_meta, 2 * e)):
                what = f"step {step} expert {e} ({splits[e]} tokens) {name}"
                assert torch.equal(meta.amax_history[:, i].view(torch.int32),
                                   ours[e][name].history.view(torch.int32)), (
                    what, meta.amax_history[:, i].tolist(), ours[e][name].history.tolist())
                assert torch.equal(meta.scale[i].view(torch.int32), ours[e][name].scale.view(torch.int32)), (
                    what, float(meta.scale[i]), float(ours[e][name].scale))


# ---------------------------------------------------------------------------------------------------------------
# What TE quantized inside GroupedLinear, copied when it was made


@dataclasses.dataclass
class TEQuantized:
    """A copy of one operand as TE's quantizer wrote it (copied at once: the forward drops the input's rowwise
    data, the backward frees what was saved)."""

    layout: str
    """tensor | block1d | block2d."""
    fp8_dtype: str
    """TE's DType name, e.g. kFloat8E4M3."""
    codes: torch.Tensor | None
    """Rowwise FP8 codes (uint8), the operand's shape."""
    scale_inv: torch.Tensor | None
    """As TE laid it out: (1,) per tensor; a padded block scale tensor (see _te_scale_inv_as_ours)."""
    t_codes: torch.Tensor | None
    """The columnwise copy: the operand transposed (k, m), quantized for the GEMM that reads it so."""
    t_scale_inv: torch.Tensor | None
    """Blocks only: the columnwise copy's scale tensor (a per-tensor transpose shares scale_inv)."""


def _record(q) -> TEQuantized:
    from transformer_engine.pytorch.tensor.storage import Float8BlockwiseQTensorStorage, Float8TensorStorage

    def copy(t):
        return None if t is None else t.detach().clone()

    dtype = getattr(q, "_fp8_dtype", None)
    dtype = getattr(dtype, "name", str(dtype))
    if isinstance(q, Float8BlockwiseQTensorStorage):
        return TEQuantized("block2d" if q._is_2D_scaled else "block1d", dtype, copy(q._rowwise_data),
                           copy(q._rowwise_scale_inv), copy(q._columnwise_data), copy(q._columnwise_scale_inv))
    if isinstance(q, Float8TensorStorage):
        transpose = None if q._transpose_invalid else q._transpose
        return TEQuantized("tensor", dtype, copy(q._data), copy(q._scale_inv), copy(transpose), None)
    pytest.fail(f"TE quantized to a {type(q).__name__}, not a Float8 or Float8Blockwise storage")


@dataclasses.dataclass
class Captured:
    splits: list = dataclasses.field(default_factory=list)
    """Per split quantization (forward input, backward grad_output): (the 2-D operand, splits, TEQuantized each)."""
    weights: list = dataclasses.field(default_factory=list)
    """Per weight quantization, in expert order: (the weight, TEQuantized)."""


def _capture(monkeypatch) -> Captured:
    """Spy on GroupedLinear's two quantization calls: the split quantization of its inputs and grad_outputs, and
    quantize_weight (one call per expert; GroupedLinear imports it, so its module's name is patched)."""
    import transformer_engine.pytorch.module.grouped_linear as gl

    cap = Captured()
    real_split, real_weight = gl._split_quantization._split_quantize, gl.quantize_weight

    def spy_split(tensor, splits, quantizers, *args, **kwargs):
        out = real_split(tensor, splits, quantizers, *args, **kwargs)
        parts = out[0] if isinstance(out, tuple) else out  # (TE 2.20.2 returns (quantized splits, dbiases))
        cap.splits.append((tensor.detach().clone(), list(splits), [_record(q) for q in parts]))
        return out

    def spy_weight(*args, **kwargs):
        out = real_weight(*args, **kwargs)  # (weightmat, new workspace)
        cap.weights.append((kwargs["tensor"].detach().clone(), _record(out[0])))
        return out

    monkeypatch.setattr(gl._split_quantization, "_split_quantize", spy_split)
    monkeypatch.setattr(gl, "quantize_weight", spy_weight)
    return cap


def _choice(kind: str) -> TERecipe:
    if kind == "Float8CurrentScaling":
        act = TensorPolicy(scaling=Scaling.TENSORWISE)
        return TERecipe("Float8CurrentScaling", act, act, dataclasses.replace(act, format=Format.E5M2))
    act = TensorPolicy(scaling=Scaling.BLOCKWISE, pow2_scales=True, block=(1, 128))  # (TE: no 2D x 2D GEMM)
    return TERecipe("Float8BlockScaling", dataclasses.replace(act, block=(128, 128)), act, act)


@dataclasses.dataclass
class Step:
    """One forward and backward of the module, with what TE quantized in it."""

    step: int
    splits: list[int]
    x: torch.Tensor
    dy: torch.Tensor
    module: torch.nn.Module
    cap: Captured

    def what(self, kind: str, e: int, operand: str) -> str:
        return f"{kind} step {self.step} expert {e} ({self.splits[e]} tokens) {operand}"

    def split_call(self, width: int) -> tuple:
        """The one split quantization of a `width`-wide operand (K: the input, N: the grad_output)."""
        calls = [c for c in self.cap.splits if c[0].shape[-1] == width]
        assert len(calls) == 1, (f"step {self.step}: {len(calls)} split quantizations of a {width}-wide operand, "
                                 "expected 1 (none: GroupedLinear took the native grouped-tensor path?)")
        tensor, splits, recs = calls[0]
        assert splits == self.splits and len(recs) == EXPERTS, (splits, len(recs))
        return tensor, recs


def _steps(monkeypatch, choice: TERecipe):
    """Each step of SPLITS, forward and backward, on one GroupedLinear under `choice`, with what TE quantized."""
    recipe = te_recipe(choice, reduce_amax=False)
    module = grouped()
    cap = _capture(monkeypatch)
    for step, splits in enumerate(SPLITS):
        cap.splits.clear()
        cap.weights.clear()
        x, dy = step_inputs(step, splits)
        run_step(module, recipe, splits, x, dy)
        yield Step(step, splits, x.detach(), dy, module, cap)


# ---------------------------------------------------------------------------------------------------------------
# One operand: TE's copy against quantize()


def _assert_same_bits(te_t: torch.Tensor, ours: torch.Tensor, what: str) -> None:
    """Equal bit patterns (codes as uint8, scales as int32)."""
    view = torch.uint8 if te_t.element_size() == 1 else torch.int32
    a, b = te_t.contiguous().view(view), ours.contiguous().view(view).to(te_t.device)
    assert a.shape == b.shape, f"{what}: TE shape {tuple(a.shape)}, ours {tuple(b.shape)}"
    bad = (a != b).nonzero()
    if len(bad):
        first = [(tuple(i.tolist()), int(a[tuple(i.tolist())]), int(b[tuple(i.tolist())])) for i in bad[:5]]
        pytest.fail(f"{what}: {len(bad)} of {a.numel()} differ; first (index, TE, ours): {first}")


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def _te_scale_inv_as_ours(rec: TEQuantized, m: int, k: int, columnwise: bool, what: str) -> torch.Tensor:
    """TE's scale_inv of an m x k operand cut to the blocks that exist, laid out as quantize()'s: (row blocks,
    column blocks) of the m x k operand, for the columnwise copy too (128x1 blocks there for 1x128).

    TE 2.20.2's layouts (Float8BlockQuantizer.get_scale_shape, the same in its Python and C++; split_quantize
    bulk-allocates with it; the padding is never written):
    - 1x128 rowwise: (ceil(k/128), roundup(m, 4)), transposed (GEMM-ready)   -> [:, :m].T
    - 1x128 columnwise (1x128 blocks of x^T): (ceil(m/128), roundup(k, 4))   -> [:, :k]
    - 128x128 rowwise: (ceil(m/128), roundup(ceil(k/128), 4))                -> [:, :ceil(k/128)]
    - 128x128 columnwise (blocks of x^T): (ceil(k/128), roundup(ceil(m/128), 4)) -> [:, :ceil(m/128)].T
    - per tensor: one float32, shape (1,).
    """
    s = rec.t_scale_inv if columnwise else rec.scale_inv
    assert s is not None, f"{what}: no {'columnwise ' if columnwise else ''}scale_inv"
    mt, kt = -(-m // 128), -(-k // 128)
    shape, region = {
        ("tensor", False): ((1,), lambda t: t.reshape(1, 1)),
        ("block1d", False): ((kt, _pad4(m)), lambda t: t[:, :m].t()),
        ("block1d", True): ((mt, _pad4(k)), lambda t: t[:, :k]),
        ("block2d", False): ((mt, _pad4(kt)), lambda t: t[:, :kt]),
        ("block2d", True): ((kt, _pad4(mt)), lambda t: t[:, :mt].t()),
    }[(rec.layout, columnwise)]
    assert tuple(s.shape) == shape, (f"{what}: TE's {rec.layout} {'columnwise' if columnwise else 'rowwise'} "
                                     f"scale_inv has shape {tuple(s.shape)}, read in its source as {shape}")
    return region(s)


def _needs_columnwise(rec: TEQuantized) -> bool:
    """Every operand here feeds a second GEMM that reads it transposed (input: wgrad, weight: dgrad, grad_output:
    wgrad): block tensors carry a columnwise copy, per-tensor ones a transpose where FP8 GEMMs are TN only."""
    from transformer_engine.pytorch.utils import is_non_tn_fp8_gemm_supported

    return rec.layout != "tensor" or not is_non_tn_fp8_gemm_supported()


def _check_operand(rec: TEQuantized, hp: torch.Tensor, policy: TensorPolicy, what: str) -> None:
    """TE's codes and scale_inv of one operand, and of its columnwise copy, against quantize() of it alone."""
    m, k = hp.shape
    if m == 0:  # TE quantizes nothing for an expert without tokens (a per-tensor scale_inv stays unwritten)
        for t in (rec.codes, rec.t_codes):
            assert t is None or t.numel() == 0, f"{what}: FP8 data for an empty split"
        return
    assert policy.format.name in rec.fp8_dtype, f"{what}: TE quantized to {rec.fp8_dtype}, ours to {policy.format}"
    assert rec.codes is not None, f"{what}: no rowwise codes"
    row = quantize(hp, policy)
    _assert_same_bits(rec.codes, row.codes, f"{what} codes")
    _assert_same_bits(_te_scale_inv_as_ours(rec, m, k, False, what), row.scale_inv, f"{what} scale_inv")
    if rec.t_codes is None:
        assert not _needs_columnwise(rec), f"{what}: no columnwise copy, which its second GEMM reads"
        return
    col = quantize(hp, policy, columnwise=True)
    _assert_same_bits(rec.t_codes, col.codes.t(), f"{what} columnwise codes (the operand transposed)")
    if rec.layout != "tensor":  # a per-tensor transpose shares the rowwise scale_inv (checked above)
        _assert_same_bits(_te_scale_inv_as_ours(rec, m, k, True, what), col.scale_inv,
                          f"{what} columnwise scale_inv")


# ---------------------------------------------------------------------------------------------------------------
# The three operands of every expert GEMM


SPLIT_OPERANDS = {"input": (K, "x", "activations"), "grad_output": (N, "dy", "gradients")}
"""The split-quantized operands: the forward's input (K wide) and the backward's grad_output (N wide)."""


@pytest.mark.parametrize("operand", sorted(SPLIT_OPERANDS))
@pytest.mark.parametrize("kind", KINDS)
def test_each_split_is_quantized_alone(monkeypatch, kind, operand):
    width, attr, role = SPLIT_OPERANDS[operand]
    choice = _choice(kind)
    for s in _steps(monkeypatch, choice):
        tensor, recs = s.split_call(width)
        assert torch.equal(tensor, getattr(s, attr)), f"step {s.step}: the {width}-wide split quantization: not {attr}"
        for e, (part, rec) in enumerate(zip(torch.split(tensor, s.splits), recs, strict=True)):
            _check_operand(rec, part, choice.policy(role), s.what(kind, e, operand))


@pytest.mark.parametrize("kind", KINDS)
def test_each_expert_weight_is_quantized_alone(monkeypatch, kind):
    """One quantize_weight per expert and step, an expert without tokens included (its GEMM still runs, empty)."""
    choice = _choice(kind)
    for s in _steps(monkeypatch, choice):
        assert len(s.cap.weights) == EXPERTS, f"step {s.step}: {len(s.cap.weights)} weight quantizations"
        for e, (w, rec) in enumerate(s.cap.weights):
            assert torch.equal(w, getattr(s.module, f"weight{e}").detach()), f"step {s.step}: call {e} not weight{e}"
            _check_operand(rec, w, choice.weights, s.what(kind, e, "weight"))
