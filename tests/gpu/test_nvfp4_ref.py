"""fp8_recipes.numerics.nvfp4 against Transformer Engine 2.20.2's NVFP4 oracle, bit for bit, on the GPU.

TE's ``NVFP4QuantizerRef`` (pure PyTorch, so it runs on the H200, where TE's NVFP4 kernels do not) quantizes
random and edge-case inputs, float32 and bf16, 1x16 and 16x16 blocks, with and without the RHT; ours quantizes the
same tensor on the GPU and on the CPU. Compared: the packed E2M1 codes, the E4M3 block scales (TE's reference
pads the 16x16 scale rows to a multiple of 16; we compare the rows of the tensor), the global amax and the global
encode scale, for the rowwise and the columnwise (transposed, RHT'd) copies.

With the RHT, TE's reference multiplies by the Hadamard matrix with a torch matmul, so its bits depend on cuBLAS's
summation: float32 is summed in order (as ours) for 6144 to 524288 blocks of 16 on the H200, which the shapes below
stay within; bf16 agrees where the float32 sums are exact, not for bf16 values spread over 60 binades (skipped).
Checked on the H200 with torch alone (that matmul, without TE): our RHT equals it on every other case here, and our
quantizer gives the same bits on the GPU and the CPU. NVFP4_REF_SEED=<int> draws other inputs. On the GPU machine:
    PYTHONPATH=plugins python3 -m pytest tests/gpu/test_nvfp4_ref.py -q -p no:cacheprovider -o addopts="" -rfEs
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from fp8_recipes.backends.te import te_available
from fp8_recipes.numerics import apply_rht, dequantize_nvfp4, quantize_nvfp4, rht_matrix

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_nvfp4 import KINDS, edge_tensor  # noqa: E402  (the CPU tests' inputs: random and every edge case)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                                                  reason="needs a CUDA GPU with Transformer Engine")]

SEED = int(os.environ.get("NVFP4_REF_SEED", "2025"))
DTYPES = [torch.float32, torch.bfloat16]
BLOCKS = [(1, 16), (16, 16)]
SHAPES = [(256, 384), (4, 128, 384), (512, 1024)]  # columnwise RHT: 6144, 12288 and 32768 blocks of 16
F32_MAX = torch.finfo(torch.float32).max


@pytest.fixture(autouse=True)
def _exact_fp32_matmul():
    """The reference's float32 RHT is a matmul: TF32 would round its inputs."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def te_reference(block, rht: bool):
    from transformer_engine.pytorch.custom_recipes import reference_utils
    from transformer_engine.pytorch.custom_recipes.reference_nvfp4 import NVFP4QuantizerRef

    return NVFP4QuantizerRef(dtype=reference_utils.Fp4Formats.E2M1, rowwise=True, columnwise=True,
                             quant_tile_shape=block, with_rht=rht)


def assert_same(te_t: torch.Tensor, ours: torch.Tensor, what: str) -> None:
    """Equal bit patterns; a NaN equals any NaN (its sign bit is the device's)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[te_t.element_size()]
    a, b = te_t.contiguous(), ours.contiguous().to(te_t.device)
    assert a.shape == b.shape, f"{what}: TE shape {tuple(a.shape)}, ours {tuple(b.shape)}"
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    bad = ((a.view(view) != b.view(view)) & ~(nan_a & nan_b)).nonzero()
    if len(bad):
        idx = [tuple(i.tolist()) for i in bad[:5]]
        detail = [(i, int(a.view(view)[i]), int(b.view(view)[i])) for i in idx]
        pytest.fail(f"{what}: {len(bad)} of {a.numel()} differ; (index, TE, ours): {detail}")


def te_global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """The reference's own S_enc (not returned by it): min(448 * 6 / amax, float32 max), 1 where that is 0."""
    scale = torch.min(torch.div(torch.tensor(448.0 * 6.0, device=amax.device), amax),
                      torch.tensor(F32_MAX, device=amax.device))
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def compare_copy(quantizer, ref, x: torch.Tensor, block, columnwise: bool, rht: bool, device: str) -> None:
    """One copy of TE's quantized `ref` of `x` (made by `quantizer`) against ours on `device`."""
    where = f"{'columnwise' if columnwise else 'rowwise'} on {device}"
    ours = quantize_nvfp4(x.to(device), block=block, columnwise=columnwise, rht=rht)
    data, scale, amax = ((ref.data_t, ref.scale_t, ref.global_amax_col) if columnwise
                         else (ref.data, ref.scale, ref.global_amax_row))
    rows = ours.block_scales.shape[0]
    assert scale.shape[0] == -(-rows // block[0]) * block[0], f"{where}: TE scale rows {scale.shape[0]}"
    if columnwise and rht:  # name the usual suspect first: cuBLAS's order of the float32 sums
        x2d = x.reshape(-1, x.shape[-1]).t().contiguous()
        assert_same(quantizer._apply_rht(x2d) + 0.0, apply_rht(x2d.to(device)) + 0.0,  # + 0.0: -0.0 and 0.0 both code 0
                    f"{where}: RHT'd values (cuBLAS's sum order)")
    assert_same(data, ours.codes, f"{where}: codes")
    assert_same(scale[:rows], ours.block_scales, f"{where}: block scales")
    assert_same(amax.reshape(()), ours.global_amax, f"{where}: global amax")
    if float(amax) == 0:  # TE's kernels (and we) return 1; the reference float32 max: no code or scale differs
        assert float(ours.global_scale) == 1.0
    else:
        assert_same(te_global_encode_scale(amax.reshape(())), ours.global_scale, f"{where}: global scale")


CASES = [("normal", shape) for shape in SHAPES] + [(kind, SHAPES[0]) for kind in KINDS[1:]]


@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,shape", CASES)
def test_matches_te_reference(kind, shape, dtype, block, rht):
    if kind == "spread" and rht and dtype is torch.bfloat16:
        pytest.skip("bf16 sums over 60 binades: cuBLAS's tensor cores do not accumulate them as a float32 sequence "
                    "(on the H200 about 1 in 10^4 RHT'd values rounds differently)")
    x = edge_tensor(kind, dtype, shape, SEED).cuda()
    quantizer = te_reference(block, rht)
    ref = quantizer.quantize(x)
    for columnwise in (False, True):
        for device in ("cuda", "cpu"):
            compare_copy(quantizer, ref, x, block, columnwise, rht, device)


@pytest.mark.parametrize("block", BLOCKS)
def test_partial_blocks_match_te_reference(block):
    """Shapes that are not whole blocks (no RHT: it needs rows in 16s): TE's reference zero-pads, as we do."""
    x = edge_tensor("normal", torch.bfloat16, (272, 200), SEED).cuda()
    quantizer = te_reference(block, rht=False)
    ref = quantizer.quantize(x)
    for columnwise in (False, True):
        compare_copy(quantizer, ref, x, block, columnwise, False, "cuda")


def test_rht_matrix_is_tes():
    from transformer_engine.pytorch.tensor.nvfp4_tensor import get_rht_matrix

    te_h = get_rht_matrix(True, torch.cuda.current_device())  # TE's kernels' matrix (bf16: entries +-1/4 exact)
    assert torch.equal(te_h.float(), rht_matrix("cuda"))
    ref_h = te_reference((1, 16), True)._build_hadamard_matrix(16, torch.device("cuda"), torch.float32) * 0.25
    assert torch.equal(ref_h, rht_matrix("cuda"))


def test_stochastic_rounding_on_cuda_is_seeded_and_unbiased():
    """The reference has no stochastic rounding; ours on the GPU: the same seed the same codes, means unbiased."""
    x = torch.zeros(65536, 16, device="cuda")
    vs = torch.tensor([0.1, 0.3, 0.45, 0.8, 1.3, 1.9, 2.2, 2.9, -0.7, -1.7, 0.55, 1.1, 1.6, 0.2], device="cuda")
    x[:, 0], x[:, 1:15] = 3.0, vs
    x[0, 15] = 5.25  # S_enc 512 and scale 256 for the other blocks: values are doubled, codes decode to halves
    a = quantize_nvfp4(x, stochastic_rounding=True, seed=5)
    assert torch.equal(a.codes, quantize_nvfp4(x, stochastic_rounding=True, seed=5).codes)
    assert not torch.equal(a.codes, quantize_nvfp4(x, stochastic_rounding=True, seed=6).codes)
    mean = dequantize_nvfp4(a).double()[1:, 1:15].mean(dim=0)
    assert torch.all((mean - vs.double()).abs() < 5 * 0.5 / math.sqrt(65535))
    # fake_quant_nvfp4's Triton kernel draws its uniforms in registers: the ones the quantizer's codes read
    from fp8_recipes.numerics import fake_quant_nvfp4, nvfp4, nvfp4_kernels

    calls, values_sr = [], nvfp4_kernels.values_sr
    nvfp4_kernels.values_sr = lambda *args, **kw: calls.append(1) or values_sr(*args, **kw)
    try:
        assert torch.equal(fake_quant_nvfp4(x, stochastic_rounding=True, seed=5), dequantize_nvfp4(a)) and calls
    finally:
        nvfp4_kernels.values_sr = values_sr
    assert not nvfp4._TRITON


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_fake_quant_is_the_eager_quantizer_bit_for_bit(kind, dtype):
    """fake_quant_nvfp4 on CUDA runs its RHT and values passes torch.compile'd: the same bits as the eager
    quantizer's codes decoded (which the tests above hold to TE's reference), every copy, shapes of a training
    step (several, so the compiled graphs recompile and go dynamic), stochastic rounding with one seed."""
    from fp8_recipes.numerics import fake_quant_nvfp4, nvfp4

    for shape in ((256, 384), (8192, 768), (2, 1024, 2304), (768, 3072), (16, 768), (1, 768), (17, 768)):
        rows = math.prod(shape[:-1])  # (1, 16 and 17 tokens: an expert's share; the edge kinds need 64 rows)
        x = (edge_tensor(kind, dtype, shape, SEED) if rows >= 64 else 3 * torch.randn(shape).to(dtype)).cuda()
        for block in BLOCKS:
            for columnwise, rht, sr in ((False, False, False), (True, True, False), (True, False, False),
                                        (False, False, True), (True, True, True)):
                if rht and rows % 16:
                    continue  # (the quantizer refuses it: the emulated backend pads such tokens first)
                kw = dict(block=block, columnwise=columnwise, rht=rht, stochastic_rounding=sr, seed=3 if sr else None)
                assert_same(dequantize_nvfp4(quantize_nvfp4(x, **kw)), fake_quant_nvfp4(x, **kw), f"{shape} {kw}")
    assert not nvfp4._TRITON  # (a bf16 copy's RHT and SR ran the Triton kernels, not a fallback)
    eager = {"rht"} if dtype == torch.float32 else set()  # (a float32 RHT runs eagerly: subnormal products)
    eager.add("column_values_sr")  # (a base layout's SR values: always the Triton kernel that draws its uniforms)
    assert all(nvfp4._COMPILED.get(name) not in (None, False) for name in set(nvfp4._EAGER) - eager), nvfp4._COMPILED
    # no form fell back to eager at the recompile limit: a form per dtype and memory layout, not per shape (this
    # test runs both dtypes in one process: about 4; the sizes of one token, of 16, equal sizes add none)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    forms = {name: len(_debug_get_cache_entry_list(f.__code__)) for name, f in nvfp4._EAGER.items()}
    assert max(forms.values()) < nvfp4.COMPILE_LIMIT, forms


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_triton_rht_is_the_eager_one_bit_for_bit(kind, dtype):
    """numerics/nvfp4_kernels.py on the GPU against apply_rht's in-order float32 sums on the GPU, each edge kind,
    shapes of a training step's columnwise copies (NaN where NaN: their bits are the kernel's own)."""
    from fp8_recipes.numerics import nvfp4, nvfp4_kernels

    for shape in ((256, 384), (8192, 768), (768, 3072), (16, 768)):
        x = (edge_tensor(kind, dtype, shape, SEED) if shape[0] >= 64 else 3 * torch.randn(shape).to(dtype)).cuda()
        got, want = nvfp4_kernels.rht_base_layout(x.t(), nvfp4.rht_matrix(x.device)), nvfp4.apply_rht(x.t())
        nan = torch.isnan(want.float())
        assert torch.equal(nan, torch.isnan(got.float())) and got.stride() == want.stride(), (kind, shape)
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), (kind, shape)



def test_the_fused_block_scales_are_the_eager_ones_bit_for_bit():
    """numerics/nvfp4_kernels.block_factors on the GPU against the eager functions on the GPU: S_enc, the E4M3
    block scales, the encode multipliers and decode factors over float32's range (zeros, subnormals, each E4M3
    scale's rounding boundaries, inf, NaN), rowwise and transposed; and taken by the quantizer there."""
    from test_nvfp4 import check_block_factors

    from fp8_recipes.numerics import nvfp4, nvfp4_kernels

    assert check_block_factors("cuda") == 18
    calls = []
    fused = nvfp4_kernels.block_factors
    nvfp4_kernels.block_factors = lambda *a: calls.append(1) or fused(*a)
    try:
        quantize_nvfp4(torch.randn(64, 64, device="cuda"))
    finally:
        nvfp4_kernels.block_factors = fused
    assert calls == [1] and not nvfp4._TRITON
