"""megatron/cpu_start.py: without CUDA, Megatron-Core's torch.compile decorations compile at the first call, so
importing it does not import TorchDynamo and Inductor; what a decorated function computes is unchanged."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from fp8_recipes.megatron.cpu_start import lazy_compile


def test_lazy_compile_compiles_once_at_the_first_call():
    calls = []

    def fake_compile(fn, **options):
        calls.append((fn.__class__.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    deferred = lazy_compile(fake_compile)

    @deferred
    def double(x):
        return 2 * x

    @deferred(mode="max-autotune")  # the decorator form with options
    def triple(x):
        return 3 * x

    assert calls == [] and double.__name__ == "double"
    assert double(2) == ("compiled", 4) and double(3) == ("compiled", 6)
    assert triple(1) == ("compiled", 3)
    assert deferred(model=lambda x: x)(5) == ("compiled", 5)  # model by keyword, as torch.compile takes it
    assert calls == [("function", {}), ("function", {"mode": "max-autotune"}), ("function", {})]  # once each
    deferred(torch.nn.Linear(2, 2))
    assert calls[3:] == [("Linear", {})]  # a module is compiled at once, as torch.compile does


def test_lazy_compile_runs_what_torch_compile_returns():
    def gelu(x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))

    x = torch.randn(64)
    deferred = lazy_compile(torch.compile)(gelu, backend="eager")
    assert torch.equal(deferred(x), gelu(x)) and torch.equal(deferred(x), torch.compile(gelu, backend="eager")(x))


_PROBE = """
import copy, importlib.machinery, json, pickle, sys, torch
real = torch.compile
import fp8_recipes, megatron.core
loader = megatron.core.__spec__.loader  # Megatron-Core's own kind of loader: copied and pickled as ever
assert isinstance(loader, importlib.machinery.SourceFileLoader) and megatron.core.__loader__ is loader
assert pickle.loads(pickle.dumps(loader)).path == copy.deepcopy(loader).path == loader.path
from megatron.core import jit
from megatron.core.transformer.moe import router
from megatron.core.transformer.utils import gelu_impl
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules,
                  "restored": torch.compile is real, "fuser_deferred": jit.jit_fuser is not real,
                  "wrapped": gelu_impl.__wrapped__.__name__}))
"""


def test_importing_megatron_core_on_the_cpu_imports_no_compiler():
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"dynamo": False, "inductor": False, "restored": True, "fuser_deferred": True,
                    "wrapped": "gelu_impl"}, seen
