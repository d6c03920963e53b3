"""Import check for scripts/bridge_pretrain.py's Megatron-Bridge code path.

On the GPU machine (real TE installed; wheels of tests/gpu/offline/bridge_wheels.txt in .bwhl installed with pip --no-index --no-deps --target /tmp/bsite):
    PYTHONPATH=/tmp/bsite:$PWD/plugins:$PYTHONPATH python3 tests/gpu/offline/bridge_check_imports.py
On a CPU machine without TE:  python3 tests/gpu/offline/bridge_check_imports.py --fake-te
(--fake-te serves every transformer_engine* module as a stub, so only *other* missing modules show up.)
Prints one line per module: OK or the error (exception type + message), then a summary; exit 1 if any failed.
"""
import importlib, importlib.abc, importlib.machinery, os, sys, time, traceback, types, warnings

warnings.filterwarnings("ignore")
FAKE_TE = "--fake-te" in sys.argv
VERBOSE = "-v" in sys.argv

if FAKE_TE:
    class _Dummy:
        def __init__(self, *a, **k): pass
        def __call__(self, *a, **k): return _Dummy()
        def __getattr__(self, n): return _Dummy()
        def __mro_entries__(self, bases): return (object,)
        def __bool__(self): return False
        def __iter__(self): return iter(())

    class _FakeMod(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__") and name.endswith("__"):
                raise AttributeError(name)
            if name[:1].isupper():  # classes: a fresh subclassable type (an nn.Module, as most TE classes are)
                try:
                    import torch
                    base = torch.nn.Module
                except ImportError:
                    base = object
                t = type(name, (base,), {"__module__": self.__name__})
            else:
                t = _Dummy()
            setattr(self, name, t)
            return t

    class _TEFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path=None, target=None):
            if fullname == "transformer_engine" or fullname.startswith("transformer_engine."):
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None
        def create_module(self, spec):
            m = _FakeMod(spec.name); m.__path__ = []; m.__version__ = "2.20.2"; return m
        def exec_module(self, module): pass

    sys.meta_path.insert(0, _TEFinder())
    import importlib.metadata as _md
    _orig_version = _md.version
    def _version(name):
        if name.replace("_", "-").lower() in ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu12", "transformer-engine-cu13"):
            return "2.20.2"
        return _orig_version(name)
    _md.version = _version

MODULES = [
    # what scripts/bridge_pretrain.py imports (in its order) and what fp8_recipes.integrations.bridge imports
    "megatron.bridge.models",                 # GPTModelProvider
    "megatron.bridge.recipes.common",         # _pretrain_common
    "megatron.bridge.training.callbacks",
    "megatron.bridge.training.mixed_precision",
    "megatron.bridge.training.gpt_step",      # forward_step
    "megatron.bridge.training.pretrain",      # pretrain
    # imported lazily on the pretrain path (setup / train / logging with mock data + NullTokenizer + tensorboard)
    "megatron.bridge.training.setup",
    "megatron.bridge.training.train",
    "megatron.bridge.training.initialize",
    "megatron.bridge.training.checkpointing",
    "megatron.bridge.training.eval",
    "megatron.bridge.training.tokenizers.tokenizer",
    "megatron.bridge.data.utils",
    "megatron.bridge.training.utils.log_utils",
    "megatron.bridge.training.utils.train_utils",
    "megatron.core.datasets.gpt_dataset",
    "megatron.core.tokenizers",
    "torch.utils.tensorboard",
    "fp8_recipes.integrations.bridge",
]
ATTRS = [("megatron.bridge.models", "GPTModelProvider"), ("megatron.bridge.recipes.common", "_pretrain_common"),
         ("megatron.bridge.training.gpt_step", "forward_step"), ("megatron.bridge.training.pretrain", "pretrain"),
         ("megatron.bridge.training.callbacks", "Callback"),
         ("megatron.bridge.training.mixed_precision", "MixedPrecisionConfig"),
         ("megatron.bridge.training.mixed_precision", "bf16_mixed")]

failed = 0
for name in MODULES:
    t0 = time.time()
    try:
        importlib.import_module(name)
        print(f"OK    {name}  ({time.time() - t0:.1f}s)", flush=True)
    except BaseException as e:  # noqa: BLE001 - report anything, keep going
        failed += 1
        print(f"FAIL  {name}: {type(e).__name__}: {e}", flush=True)
        if VERBOSE: traceback.print_exc()
for mod, attr in ATTRS:
    try:
        getattr(importlib.import_module(mod), attr)
        print(f"OK    {mod}.{attr}")
    except BaseException as e:  # noqa: BLE001
        failed += 1
        print(f"FAIL  {mod}.{attr}: {type(e).__name__}: {e}")

# a light functional check: build the config exactly as scripts/bridge_pretrain.py does (no GPU work)
try:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "scripts"))
    import bridge_pretrain
    cfg = bridge_pretrain.build_config(bridge_pretrain.parse_args(["--steps", "4"]))
    print(f"OK    build_config: model={type(cfg.model).__name__} tokenizer={cfg.tokenizer.tokenizer_type}")
except BaseException as e:  # noqa: BLE001
    failed += 1
    print(f"FAIL  build_config: {type(e).__name__}: {e}")
    if VERBOSE: traceback.print_exc()

for dist in ("transformers", "huggingface-hub", "tokenizers", "megatron-bridge", "megatron-core", "nvidia-modelopt",
             "nvidia-resiliency-ext", "megatron-energon", "transformer-engine", "torch"):
    try:
        import importlib.metadata as md
        print(f"dist  {dist}=={md.version(dist)}")
    except Exception as e:  # noqa: BLE001
        print(f"dist  {dist}: {type(e).__name__}")
print(f"{len(MODULES) + len(ATTRS) + 1 - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
