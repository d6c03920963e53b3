"""A faster start for Megatron-Core on a machine without CUDA: its torch.compile decorations compile on first call.

Megatron-Core 0.19 decorates its fused kernels (bias-GELU/SwiGLU/GEGLU, bias-dropout-add, fused cross entropy, the
activations in ``activations.py``, an inference router's top-k) with ``torch.compile`` when it is imported:
``megatron.core.jit.jit_fuser`` is ``torch.compile`` on torch >= 2.2. ``torch.compile`` compiles nothing until the
first call, but the decoration itself imports TorchDynamo and Inductor: about 4 s of every process that imports
Megatron-Core on the 2-core CI machine (``python -X importtime -c "import megatron.core"``, torch 2.14.1: ~10 s in
all), paid by every run, export, evaluation and torchrun worker. Without CUDA this project's model runs none of those
kernels: it is built with every fusion off (``megatron/model.py``); one that does run compiles at its first call, as
before.

So on a machine without CUDA, while ``megatron.core`` is imported, ``torch.compile`` is a decorator that calls the
real ``torch.compile`` at the function's first call and runs what it returns from then on, as a decorated function
would (an ``nn.Module`` is compiled at once, as before). TorchDynamo and Inductor are then imported only if a
compiled kernel ever runs. ``torch.compile`` itself is restored as soon as the import ends (what Megatron-Core
bound in that window, ``jit_fuser``, keeps the deferring decorator), and with CUDA nothing changes.
:func:`install` puts the import hook in place; the package does it on import (``fp8_recipes/__init__.py``), so every
entry point, worker and test process gets it, whatever it imports first.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["install", "lazy_compile"]

PACKAGE = "megatron.core"


def lazy_compile(compile_: Callable[..., Any]) -> Callable[..., Any]:
    """``compile_`` (torch.compile) that, given a plain function, defers itself to that function's first call."""

    def deferred(model: Any = None, **options: Any) -> Any:
        if model is None:  # @torch.compile(mode=...): the decorator
            return functools.partial(deferred, **options)
        if not inspect.isfunction(model):  # a module or another callable: as torch.compile does it
            return compile_(model, **options)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    return deferred


class _Loader(importlib.machinery.SourceFileLoader):
    """Megatron-Core's own source loader, with a deferring torch.compile while it runs when CUDA is absent."""

    def exec_module(self, module: ModuleType) -> None:
        import torch  # Megatron-Core's first import

        if torch.cuda.is_available():
            super().exec_module(module)
            return
        real = torch.compile
        torch.compile = lazy_compile(real)
        try:
            super().exec_module(module)
        finally:
            torch.compile = real


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != PACKAGE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:  # (else: as it is)
            spec.loader = _Loader(spec.loader.name, spec.loader.path)
        return spec


def install() -> None:
    """Put the import hook in place (idempotent); nothing to do once Megatron-Core is imported."""
    if PACKAGE not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
