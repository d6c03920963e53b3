"""The host's bookkeeping per recorded step of numerics statistics, with the GPU kernels stubbed out (CPU only).

    python scripts/bench_recorder_host.py                      # hybrid, 12 layers (48 linears), gpt_125m's shapes
    python scripts/bench_recorder_host.py --recipe tensorwise --profile

On the TE backend a recorded step hands the recorder every operand of every FP8 linear; the recorder runs one
fused kernel per distinct copy and turns them into rows, numerics.jsonl and TensorBoard. This times everything
but the kernels themselves (their launchers are replaced by a stub that only fills the block-scale counts), on
CPU tensors of gpt_125m's shapes (8192 x 768 activations and gradients, 768 x 768 weights): the part of the
statistics' cost that a faster GPU does not shrink. The fused kernels' launch cost on the GPU:
scripts/bench_fused_stats.py; the whole cost in training: scripts/bench_stats.py.
"""

import cProfile
import pstats
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # a checkout without `pip install -e`


def _stub_launch(grid, args, constexprs, num_warps) -> None:
    """A stats_kernels.Launcher that launches nothing: only the block-scale counts (argument 7, when the HIST
    constexpr, the 4th, is set), so rows() has something."""
    if len(constexprs) > 3 and constexprs[3]:
        args[7][127] = 1


def main() -> None:
    import torch

    from fp8_recipes.observe import recorder as rec_mod, stats, stats_kernels
    from fp8_recipes.observe.config import DebugConfig
    from fp8_recipes.plan.precision import Gemm, Hardware, ModelLayout, PrecisionPlan
    from fp8_recipes.recipe.pack import load_recipe
    from fp8_recipes.recipe.schema import Role

    from fp8_recipes.checks import OneLineArgumentParser, at_least  # (one error line for a usage error)
    from fp8_recipes.training.errors import script_user_errors

    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="hybrid")
    p.add_argument("--layers", type=at_least(1), default=12)
    p.add_argument("--steps", type=at_least(1), default=10)
    p.add_argument("--profile", action="store_true", help="also print the top functions by own time")
    args = p.parse_args()

    stats_kernels.stats = stats_kernels.amax = _stub_launch
    stats.FUSED = True
    with script_user_errors():  # (a recipe that is none: one line)
        recipe = load_recipe(args.recipe)
    step_plan = PrecisionPlan(recipe, ModelLayout.gpt(args.layers), Hardware()).at(10**9)
    states = {name: types.SimpleNamespace(name=name, plan=mp, scalers={}, amax_reducers={}, record_amax=True,
                                          observer=None)
              for name, mp in step_plan.modules.items()  # the FP8 linears (the LM head stays BF16)
              if mp.gemms.get(Gemm.FPROP) is not None and mp.gemms[Gemm.FPROP].policy(Role.ACTIVATIONS) is not None}
    recorder = rec_mod.NumericsRecorder(DebugConfig.from_dict({"interval": 1}), tempfile.mkdtemp())
    recorder.attach(states)
    act, weight, grad = (torch.randn(*shape).bfloat16() for shape in ((8192, 768), (768, 768), (8192, 768)))
    operands = [(Gemm.FPROP, Role.ACTIVATIONS, act), (Gemm.FPROP, Role.WEIGHTS, weight),
                (Gemm.DGRAD, Role.WEIGHTS, weight), (Gemm.WGRAD, Role.ACTIVATIONS, act),
                (Gemm.DGRAD, Role.GRADIENTS, grad), (Gemm.WGRAD, Role.GRADIENTS, grad)]

    def step(i: int) -> None:  # what the TE hooks do in one recorded step (backends/te_observe.py)
        recorder.begin_step(i)
        for state in states.values():
            for gemm, role, tensor in operands:
                if state.observer is not None and state.plan.gemms[gemm].policy(role) is not None:
                    state.observer(state, gemm, role, tensor, None)

    for i in range(3):
        step(i)
    t0 = time.perf_counter()
    for i in range(3, 3 + args.steps):
        step(i)
    recorder.flush()
    per_step = (time.perf_counter() - t0) / args.steps
    print(f"{args.recipe}, {len(states)} linears: {per_step * 1e3:.1f} ms of host time per recorded step "
          f"(kernels stubbed)")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for i in range(100, 105):
            step(i)
        recorder.flush()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    recorder.close()


if __name__ == "__main__":
    main()
