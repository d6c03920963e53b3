"""fp8_recipes: FP8 training recipes for Megatron-Core and Transformer Engine.

YAML recipe -> typed :class:`~fp8_recipes.recipe.schema.Recipe` -> :class:`~fp8_recipes.plan.precision.PrecisionPlan`
-> backend (Transformer Engine or emulated) -> training loop -> observers.

Importing this package needs neither a GPU nor Transformer Engine. Its one side effect: on a machine without CUDA,
Megatron-Core's torch.compile decorations, when it is imported, compile at the first call instead of importing
TorchDynamo and Inductor at once (~4 s of every process's start; megatron/cpu_start.py).
"""

from fp8_recipes.megatron import cpu_start as _cpu_start

_cpu_start.install()

__version__ = "0.1.0"
__all__ = ["__version__"]
