"""FP8 and NVFP4 numerics on any device: formats, scales, quantize / dequantize / fake_quant for every scaling policy.

Pure torch: no Transformer Engine, no megatron, no torch.distributed (reductions are passed in as callables).
"""

from fp8_recipes.numerics.formats import FP8_SPECS, FP8Spec, fp8_spec, to_fp8_saturated
from fp8_recipes.numerics.nvfp4 import (
    NVFP4Quantized, apply_rht, dequantize_nvfp4, fake_quant_nvfp4, quantize_nvfp4, rht_matrix,
)
from fp8_recipes.numerics.quantize import Quantized, block_for, dequantize, fake_quant, quantize
from fp8_recipes.numerics.scaling import (
    DelayedScaler, amax_to_e8m0, amax_to_scale, e8m0_to_multiplier, e8m0_to_scale_inv, nan_ignoring_amax,
)

__all__ = [
    "DelayedScaler", "FP8Spec", "FP8_SPECS", "NVFP4Quantized", "Quantized", "amax_to_e8m0", "amax_to_scale",
    "apply_rht", "block_for", "dequantize", "dequantize_nvfp4", "e8m0_to_multiplier", "e8m0_to_scale_inv",
    "fake_quant", "fake_quant_nvfp4", "fp8_spec", "nan_ignoring_amax", "quantize", "quantize_nvfp4", "rht_matrix",
    "to_fp8_saturated",
]
