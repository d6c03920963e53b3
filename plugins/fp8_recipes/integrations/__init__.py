"""Adapters to other training stacks: the same recipe YAML in Megatron-Bridge and in NeMo 2 (docs/nemo.md).

``common`` maps a recipe to Megatron-Core's precision fields and drives plugin-owned precision; ``bridge`` and
``nemo`` wrap them for each framework and import it only when used (``pip install fp8-recipes[bridge]`` /
``[nemo]``). Importing this package imports neither.
"""
