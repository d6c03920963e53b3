"""Host cost of one fused statistics measurement on the GPU (observe/stats_kernels.py), per scaling mode.

    python scripts/bench_fused_stats.py                  # 8192 x 768 BF16 (gpt_125m's activations), 500 calls

Prints per mode: the host time per operand (measure_fused: output buffer, kernel launch(es)), the time with the
GPU's work included, the output buffer's copy alone, and rows() of 240 such operands (what a recorded step of
gpt_125m under hybrid turns into rows). Needs a CUDA GPU and Triton.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # a checkout without `pip install -e`


def main() -> None:
    import torch

    from fp8_recipes.observe import stats
    from fp8_recipes.schema import Scaling, TensorPolicy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=[8192, 768])
    p.add_argument("--calls", type=int, default=500)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused_stats: needs a CUDA GPU")
    x = torch.randn(*args.shape, device="cuda").bfloat16()
    for name, policy, columnwise in [
            ("tensorwise", TensorPolicy(scaling=Scaling.TENSORWISE), False),
            ("blockwise 1x128", TensorPolicy(scaling=Scaling.BLOCKWISE, block=(1, 128)), False),
            ("blockwise 128x1", TensorPolicy(scaling=Scaling.BLOCKWISE, block=(1, 128)), True),
            ("blockwise 128x128", TensorPolicy(scaling=Scaling.BLOCKWISE, block=(128, 128)), False)]:
        for _ in range(50):  # compile, warm caches (rows() included: its first call loads kernels)
            warm = stats.measure_fused(x, policy, columnwise=columnwise)
        stats.rows([warm] * 4)
        torch.cuda.synchronize()
        t = time.perf_counter()
        measured = [stats.measure_fused(x, policy, columnwise=columnwise) for _ in range(args.calls)]
        host = (time.perf_counter() - t) / args.calls
        torch.cuda.synchronize()
        total = (time.perf_counter() - t) / args.calls
        t = time.perf_counter()
        stats.rows(measured[:240])
        rows_s = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.calls):
            stats._output(x.device)
        buffer = (time.perf_counter() - t) / args.calls
        print(f"{name}: host {host * 1e6:.0f} us/operand, with the GPU {total * 1e6:.0f} us, output buffer "
              f"{buffer * 1e6:.0f} us, rows() of 240 {rows_s * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
