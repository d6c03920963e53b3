"""Which FP8 dot-product attention TE 2.20 runs on this GPU, per recipe, how fast, and how far from BF16.

    python3 tests/gpu/probe_fp8_attention.py            # every mode, each in a subprocess (TE reads NVTE_* at import)

Llama-3-8B attention shape: 32 query heads, 8 KV groups, head dim 128, seq 4096, batch 2, causal, sbhd, BF16.
Per mode: the backend TE chose (or its error), forward+backward ms (CUDA events, 10 iterations after 5), and the
relative L2 error of the output and dQ/dK/dV against BF16 attention. The `*-unfused` modes force TE's
UnfusedDotProductAttention, which emulates FP8 attention (FP8EmulationFunc: QKV, S, O quantized forward; dO, dP,
dQKV backward): their distance to the fused FP8 kernel says how well that emulation describes it.
"""

import json
import os
import subprocess
import sys

UNFUSED = {"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN": "0", "NVTE_UnfusedDPA_Emulate_FP8": "1"}  # TE 2.20 gate
MODES = {
    "bf16": ({}, None),
    "delayed": ({}, "DelayedScaling"),
    "tensorwise": ({}, "Float8CurrentScaling"),
    "tensorwise+dpa-delayed": ({"NVTE_DPA_FP8_RECIPE": "DelayedScaling"}, "Float8CurrentScaling"),
    "blockwise": ({}, "Float8BlockScaling"),
    "delayed-unfused": (UNFUSED, "DelayedScaling"),
    "tensorwise-unfused": (UNFUSED, "Float8CurrentScaling"),
}


def child(recipe_name: str | None) -> dict:
    import torch
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as R

    torch.manual_seed(0)
    s, b, h, g, d = 4096, 2, 32, 8, 128
    dpa = te.DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type="causal", qkv_format="sbhd")
    q = torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(s, b, g, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(s, b, g, d, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(s, b, h * d, device="cuda", dtype=torch.bfloat16)

    def step(recipe):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            out = dpa(qq, kk, vv)
        out.backward(dout)
        return out.detach(), qq.grad, kk.grad, vv.grad

    ref = step(None)
    recipe = None
    if recipe_name:
        kw = {"fp8_dpa": True}
        if recipe_name == "DelayedScaling":
            kw.update(amax_history_len=16, amax_compute_algo="max")
        recipe = getattr(R, recipe_name)(**kw)
    try:
        for _ in range(5):
            got = step(recipe)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        step(recipe)
    end.record()
    end.synchronize()
    rel = {n: float((a.float() - r.float()).norm() / r.float().norm()) for n, a, r in zip(("out", "dq", "dk", "dv"), got, ref)}
    torch.save(got, f"/tmp/probe_{os.environ.get('PROBE_MODE')}.pt")
    return {"ms": start.elapsed_time(end) / 10, "rel_err_vs_bf16": rel}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(sys.argv[2] if sys.argv[2] != "-" else None)))
        return
    results = {}
    for mode, (env, recipe_name) in MODES.items():
        p = subprocess.run([sys.executable, __file__, "--child", recipe_name or "-"], capture_output=True, text=True,
                           env={**os.environ, **env, "PROBE_MODE": mode, "NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "2"},
                           timeout=300)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        r = json.loads(line[7:]) if line else {"error": (p.stderr.strip().splitlines() or ["no output"])[-1][:200]}
        chosen = [ln for ln in (p.stdout + p.stderr).splitlines() if "Selected backend" in ln or "Running with" in ln]
        r["backend_log"] = chosen[-1][-160:] if chosen else None
        results[mode] = r
        print(mode, json.dumps(r), flush=True)
    import torch
    for fused, unfused in (("delayed", "delayed-unfused"), ("tensorwise+dpa-delayed", "tensorwise-unfused")):
        try:
            a, u = torch.load(f"/tmp/probe_{fused}.pt"), torch.load(f"/tmp/probe_{unfused}.pt")
            results[f"{fused} fused vs unfused"] = {n: float((x.float() - y.float()).norm() / y.float().norm())
                                                    for n, x, y in zip(("out", "dq", "dk", "dv"), a, u)}
            print(f"{fused} fused vs TE's unfused emulation:", results[f"{fused} fused vs unfused"])
        except Exception as e:  # noqa: BLE001
            print(f"{fused} fused vs unfused: {e}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "probe_fp8_attention.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
