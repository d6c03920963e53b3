"""Rebuilds nvidia_resiliency_ext_stub-0.0.1-py3-none-any.whl (tests/gpu/offline/bridge_wheels.txt says why a stub)."""
import base64, hashlib, sys, zipfile
name, ver = "nvidia_resiliency_ext_stub", "0.0.1"
files = {
 "nvidia_resiliency_ext/__init__.py": '"""Stub: NOT nvidia-resiliency-ext. Only what megatron-bridge 0.6.2 imports unconditionally\n(megatron/bridge/training/pretrain.py: `from nvidia_resiliency_ext.inprocess import CallWrapper`, a type hint).\nNo checkpointing/fault_tolerance/straggler submodules, so Megatron-Core (NVRX_MIN_VERSION 0.6.0) and Bridge\ntreat NVRx as absent. In-process restart / NVRx async or local checkpointing / fault tolerance are unavailable."""\n',
 "nvidia_resiliency_ext/inprocess/__init__.py": '"""Stub (see the package docstring)."""\n\n\nclass CallWrapper:  # type-hint only in megatron.bridge.training.pretrain\n    iteration = 0\n\n    def __init__(self, *args, **kwargs):\n        raise RuntimeError("nvidia_resiliency_ext stub: in-process restart is not available")\n',
}
di = f"{name}-{ver}.dist-info"
files[f"{di}/METADATA"] = f"Metadata-Version: 2.1\nName: nvidia-resiliency-ext-stub\nVersion: {ver}\nSummary: import stub for megatron-bridge pretrain path (CallWrapper type hint only)\n"
files[f"{di}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: handmade\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
files[f"{di}/top_level.txt"] = "nvidia_resiliency_ext\n"
rec = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(c.encode()).digest()).rstrip(b'=').decode()},{len(c.encode())}"
       for p, c in files.items()] + [f"{di}/RECORD,,"]
files[f"{di}/RECORD"] = "\n".join(rec) + "\n"
out = (sys.argv[1] if len(sys.argv) > 1 else ".") + f"/{name}-{ver}-py3-none-any.whl"
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
    for p, c in files.items():
        z.writestr(p, c)
print(out)
