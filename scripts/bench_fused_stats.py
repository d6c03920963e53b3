"""Host and GPU cost of one fused statistics measurement (observe/stats_kernels.py), per scaling mode.

    python scripts/bench_fused_stats.py                  # 8192 x 768 BF16 (gpt_125m's activations)
    python scripts/bench_fused_stats.py --shape 8192 3072

Prints per mode: the host time per operand (measure_fused: output buffer, kernel launch(es)) with the compiled
kernel launched directly (stats_kernels.Launcher) and through Triton's own launch, timed in short bursts between
syncs (so a full launch queue never blocks the host); the GPU time per operand (the launches queued behind a
sleeping kernel, timed with CUDA events: the GPU's work alone); the output buffer alone; and rows() of 240 such
operands (what a recorded step of gpt_125m under hybrid turns into rows). Needs a CUDA GPU and Triton.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # a checkout without `pip install -e`


def host_us(fn, bursts: int = 30, calls: int = 10) -> float:
    """Host time per call, in bursts of `calls` between syncs."""
    import torch

    total = 0.0
    for _ in range(bursts):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        total += time.perf_counter() - t
    torch.cuda.synchronize()
    return total * 1e6 / (bursts * calls)


def gpu_us(fn, calls: int = 100) -> float:
    """GPU time per call: the calls are queued behind a ~0.2 s sleeping kernel, then timed with CUDA events."""
    import torch

    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # cycles
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    import torch

    from fp8_recipes.observe import stats, stats_kernels
    from fp8_recipes.recipe.schema import Scaling, TensorPolicy

    from fp8_recipes.checks import OneLineArgumentParser  # (one error line for a usage error)

    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=[8192, 768])
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_fused_stats: needs a CUDA GPU")
    x = torch.randn(*args.shape, device="cuda").bfloat16()
    launchers = (stats_kernels.stats, stats_kernels.amax)
    print(f"{tuple(args.shape)} BF16, us per operand | host, direct launch | host, Triton's launch | GPU | "
          "output buffer | rows() of 240 (ms)")
    for name, policy, columnwise in [
            ("tensorwise", TensorPolicy(scaling=Scaling.TENSORWISE), False),
            ("blockwise 1x128", TensorPolicy(scaling=Scaling.BLOCKWISE, block=(1, 128), pow2_scales=True), False),
            ("blockwise 128x1", TensorPolicy(scaling=Scaling.BLOCKWISE, block=(1, 128), pow2_scales=True), True),
            ("blockwise 128x128", TensorPolicy(scaling=Scaling.BLOCKWISE, block=(128, 128), pow2_scales=True), False),
            ("mxfp8 1x32", TensorPolicy(scaling=Scaling.MXFP8), False)]:
        def measure():
            return stats.measure_fused(x, policy, columnwise=columnwise)

        for _ in range(20):  # compile, warm caches (rows() included: its first call loads kernels)
            warm = measure()
        stats.rows([warm] * 4)
        direct = host_us(measure)
        for launcher in launchers:
            launcher.direct = False
        through_triton = host_us(measure)
        for launcher in launchers:
            launcher.direct = True
        gpu = gpu_us(measure)
        measured = [measure() for _ in range(240)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        stats.rows(measured)
        rows_ms = (time.perf_counter() - t) * 1e3
        buffer = host_us(lambda: stats._output(x.device))
        print(f"{name} | {direct:.0f} | {through_triton:.0f} | {gpu:.0f} | {buffer:.0f} | {rows_ms:.1f}", flush=True)
    print(f"direct launches: {sum(launcher.direct_launches for launcher in launchers)}")


if __name__ == "__main__":
    main()
