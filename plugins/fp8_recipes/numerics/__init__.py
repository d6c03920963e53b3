"""FP8 numerics on any device: formats, scales, quantize / dequantize / fake_quant for every scaling policy.

Pure torch: no Transformer Engine, no megatron, no torch.distributed (reductions are passed in as callables).
"""

from fp8_recipes.numerics.formats import FP8_SPECS, FP8Spec, fp8_spec, to_fp8_saturated
from fp8_recipes.numerics.quantize import Quantized, block_for, dequantize, fake_quant, quantize
from fp8_recipes.numerics.scaling import (
    DelayedScaler, amax_to_e8m0, amax_to_scale, e8m0_to_multiplier, e8m0_to_scale_inv, nan_ignoring_amax,
)

__all__ = [
    "DelayedScaler", "FP8Spec", "FP8_SPECS", "Quantized", "amax_to_e8m0", "amax_to_scale", "block_for",
    "dequantize", "e8m0_to_multiplier", "e8m0_to_scale_inv", "fake_quant", "fp8_spec", "nan_ignoring_amax",
    "quantize", "to_fp8_saturated",
]
