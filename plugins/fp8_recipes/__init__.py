"""fp8_recipes: FP8 training recipes for Megatron-Core and Transformer Engine.

YAML recipe -> typed :class:`~fp8_recipes.schema.Recipe` -> :class:`~fp8_recipes.plan.PrecisionPlan`
-> backend (Transformer Engine or emulated) -> training loop -> observers.

Importing this package has no side effects and needs neither a GPU nor Transformer Engine.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
