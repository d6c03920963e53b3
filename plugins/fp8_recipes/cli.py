"""`fp8-recipes`: look at, check and explain recipes.

    fp8-recipes list                              every recipe in the pack, with its description
    fp8-recipes show hybrid                       the resolved recipe (defaults list applied, every default filled in)
    fp8-recipes validate recipes/*.yaml my.yaml   exit 0, or 1 with one line per problem
    fp8-recipes explain safe --layers 8           per-role policies, stages and per-layer GEMM precision
    fp8-recipes explain safe --layers 8 --layout tp=2,pp=4,dp=8    ... and which pipeline stage runs which layers
    fp8-recipes explain hybrid --model tiny_moe   ... of a conf/model model (an MoE model: experts and routers)
    fp8-recipes memory llama3-70b --layout tp=4,pp=4,cp=2,dp=4 --fp8   estimated memory per GPU
    fp8-recipes memory mixtral_8x7b_4l --seq 4096 --recipe delayed    ... of an MoE model (experts, dispatch)
    fp8-recipes doctor RUN_DIR --baseline BF16_RUN [--baseline BF16_OTHER_SEED ...] --write fixed.yaml
                                                  diagnose a run: exit 0 healthy, 1 problem found, 2 bad input
    fp8-recipes heatmap RUN_DIR --stat scale_gap    an MoE run's experts x steps (tokens, weight, underflow_pct,
                                                  scale_gap) as experts_<stat>.png in the run directory
    fp8-recipes export RUN_DIR --to hf OUT --dtype fp8 --block 128x128
                                                  a checkpoint as a Hugging Face Llama checkpoint (docs/handoff.md)

User errors end in one line on stderr and a non-zero exit code, never a traceback. What the recipe commands
(list, show, validate, explain) share is imported at the top; memory, doctor, heatmap and export import their own
machinery inside their command, so a recipe command does not pay for it (export's is torch and Megatron-Core).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from fp8_recipes.checks import MAX_ERROR_CHARS, OneLineArgumentParser, clipped, first_problem
from fp8_recipes.megatron.model_config import MODEL_MAX, check_model_cfg, layout_of, read_model_conf
from fp8_recipes.observe.config import DebugConfig
from fp8_recipes.plan.precision import Hardware, ModelLayout, ParallelLayout, PrecisionPlan, expert_ffn_size
from fp8_recipes.plan.format import format_plan
from fp8_recipes.recipe.pack import load_recipe, load_recipe_dict, recipe_names

__all__ = ["main"]


def _cmd_list(args) -> int:
    names = recipe_names()
    width = max(map(len, names), default=0)
    for name in names:
        print(f"{name:<{width}}  {load_recipe(name).description}")
    return 0


def _cmd_show(args) -> int:
    print(yaml.safe_dump(load_recipe(args.recipe).to_dict(), sort_keys=False, default_flow_style=None, width=120).rstrip())
    return 0


def _cmd_validate(args) -> int:
    failed = 0
    for ref in args.recipes:
        try:
            recipe = load_recipe(ref)
            DebugConfig.from_dict(load_recipe_dict(ref).get("debug"))  # the observers' section, if any
        except ValueError as e:
            failed += 1
            for line in str(e).splitlines():
                print(line if line.startswith(str(ref)) else f"{ref}: {line}", file=sys.stderr)
        else:
            print(f"{ref}: ok ({recipe.name})")
    return 1 if failed else 0


def _cmd_explain(args) -> int:
    hardware = Hardware.detect() if args.detect else Hardware()
    cfg = None
    if args.model is not None:  # the model's own layers and MoE layout (--layers, if given too, overrides its layers)
        cfg = read_model_conf(args.model, "explain --model")
        layout = layout_of({**cfg, "num_layers": args.layers or cfg["num_layers"]})
    else:
        layout = ModelLayout.gpt(args.layers or 4)
    parallel = None
    if args.layout is not None:  # (given: its section is printed, at one stage too)
        parallel = ParallelLayout.parse(args.layout)
        parallel.check(layout.num_layers)
        if cfg is not None:  # (heads and FFN over TP, as memory and training check them)
            vocab = cfg.get("vocab_size") if isinstance(cfg.get("vocab_size"), int) else None  # (data's, in training)
            check_model_cfg({**cfg, "num_layers": layout.num_layers, "vocab_size": vocab}, vocab_may_be_unset=True,
                            tensor_parallel=parallel.tp, tp_key="--layout tp")
        elif parallel.tp > MODEL_MAX["num_attention_heads"]:  # (with --model: tp divides its heads)
            raise ValueError(f"--layout: tp={parallel.tp} is more than the attention heads TP splits, in any model "
                             f"this plugin plans (at most {MODEL_MAX['num_attention_heads']:,}); lower tp, or give "
                             f"--model NAME to check it against that model")
        # (ep / etp: how the routed experts split, refused on a dense model; the memory command says what it costs)
        parallel.check_experts(layout.experts or None, expert_ffn_size(cfg) if cfg is not None else None)
    plan = PrecisionPlan(load_recipe(args.recipe), layout, hardware)
    print(format_plan(plan, max_steps=args.steps, parallel=parallel, show_layout=parallel is not None))
    return 0


def _cmd_memory(args) -> int:
    # this command's own (module docstring)
    from fp8_recipes.plan.memory import (LLAMA3, MIXTRAL, OptimizerPrecision, estimate_stages, format_estimate,
                                         fp8_modules_of, operand_storage_of)

    layout = ParallelLayout.parse(args.layout)
    published = {**LLAMA3, **MIXTRAL}
    if args.model in published:
        model = dict(published[args.model])
    else:
        model = read_model_conf(args.model, "memory", also=published)
        if not isinstance(model.get("vocab_size"), int):
            model["vocab_size"] = 4096  # the stdlib tokenizer's, which the small configs take from data
    check_model_cfg({"seq_length": args.seq, **model}, tensor_parallel=layout.tp,
                    tp_key="--layout tp")  # (heads, FFN, MoE keys over TP)
    dtypes = {"exp_avg_dtype": args.exp_avg_dtype, "exp_avg_sq_dtype": args.exp_avg_sq_dtype,
              "main_params_dtype": args.main_params_dtype}
    optimizer = OptimizerPrecision(  # a low-precision dtype implies the precision-aware optimizer, as in Megatron-LM
        use_precision_aware_optimizer=args.precision_aware_optimizer or any(v != "fp32" for v in dtypes.values()),
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16, **dtypes)
    fp8, fp8_param, per_recipe = args.fp8, args.fp8_param, {}
    if args.emulated and args.recipe is None:
        raise ValueError("memory: --emulated estimates a recipe's run on the emulated backend; give --recipe NAME")
    if args.recipe is not None:  # the recipe says FP8 or not, fp8_param, the FP8 linears and their weight copies
        if args.fp8 or args.fp8_param:
            raise ValueError("memory: --recipe says whether it is FP8 and stores FP8 weights; drop --fp8 / --fp8-param")
        recipe = load_recipe(args.recipe)
        fp8, fp8_param = recipe.is_fp8, recipe.fp8_param
        per_recipe = {"fp8_modules": fp8_modules_of(recipe, model),
                      "storage": operand_storage_of(recipe, emulated=args.emulated)} if fp8 else {}
    common = {"micro_batch_size": args.mbs, "seq_length": args.seq, "fp8": fp8, "fp8_param": fp8_param,
              "distributed_optimizer": not args.replicated_optimizer, "optimizer": optimizer}
    stages = estimate_stages(model, layout, num_microbatches=args.microbatches, **common, **per_recipe)
    peak = max(stages, key=lambda s: s.total)
    print(format_estimate(args.model, layout, peak, stages=stages, recipe=args.recipe,
                          storage=per_recipe.get("storage"), **common))
    return 0


def _cmd_doctor(args) -> int:
    """0: healthy, 1: a problem was found (the report says which), 2: a run directory or --write path is unusable."""
    # this command's own (module docstring): the run-directory readers, statistics
    from fp8_recipes.observe.doctor import DoctorInputError, diagnose
    from fp8_recipes.observe.doctor_report import format_report, load_run, patched_recipe, write_recipe
    from fp8_recipes.rundir import overwrite_problem

    try:
        run = load_run(args.run_dir)
        baselines = [load_run(b, "--baseline") for b in args.baseline or []]
        baseline, seeds = (baselines[0], baselines[1:]) if baselines else (None, [])
        for given, b in zip(args.baseline or [], baselines):  # (a silent gap against another FP8 run: said once)
            if b.recipe is not None and b.recipe.is_fp8:
                print(f"warning: --baseline {given} trained recipe {b.recipe.name!r}, not BF16: the gaps below are "
                      f"to that FP8 run; give a +recipe=bf16 run of the same config and seed", file=sys.stderr)
        if args.write is not None and (not args.write or Path(args.write).is_dir()
                                       or not Path(args.write).resolve().parent.is_dir()):
            raise DoctorInputError(f"--write: '{args.write}' is a directory or its directory does not exist (give a "
                                   f"file path in an existing directory, e.g. fixed.yaml)")
        if args.write and (problem := overwrite_problem(args.write)):
            raise DoctorInputError(f"--write: '{args.write}' {problem}; give another file path, e.g. fixed.yaml")
        diagnosis = diagnose(run, baseline, seeds)
        print(format_report(diagnosis))
        patched = patched_recipe(diagnosis) if args.write else None
        if args.write and patched is None:
            print(f"write     nothing written to {args.write}: no recipe change proposed")
        elif args.write:
            write_recipe(Path(args.write), patched)
            print(f"write     {args.write} (check it with: fp8-recipes validate {args.write})")
    except DoctorInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if diagnosis.healthy else 1


def _cmd_heatmap(args) -> int:
    # this command's own (module docstring): matplotlib
    from fp8_recipes.observe.heatmap import expert_heatmap

    if args.role is not None and args.stat in ("tokens", "weight"):  # routing rows are per expert, not per role
        print(f"warning: --role {args.role} does nothing with --stat {args.stat} (routing.jsonl has no roles); "
              f"drop --role, or plot --stat underflow_pct or scale_gap", file=sys.stderr)
    print(expert_heatmap(args.run_dir, stat=args.stat, role=args.role or "activations", out=args.out))
    return 0


def _cmd_export(args) -> int:
    # this command's own (module docstring): torch and Megatron-Core
    from fp8_recipes.training.hf import export_hf, parse_block
    from fp8_recipes.training.run import quiet_third_party_logs

    quiet_third_party_logs()
    block = parse_block(args.block or "128x128")
    if args.block is not None and args.dtype != "fp8":
        print(f"warning: --block {args.block} does nothing with --dtype {args.dtype} (its weights carry no "
              f"scales); add --dtype fp8, or drop --block", file=sys.stderr)
    export_hf(args.source, args.out, dtype=args.dtype, block=block)
    return 0


def _error_line(line: str) -> str:
    return clipped(line if line.startswith("error: ") else f"error: {line}")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="fp8-recipes", description="FP8 training recipes for Megatron-Core and "
                                "Transformer Engine: list, show, validate and explain recipes; diagnose runs.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("list", help="every recipe in the pack with its description").set_defaults(fn=_cmd_list)
    s = sub.add_parser("show", help="the resolved recipe as YAML")
    s.add_argument("recipe", metavar="NAME|FILE")
    s.set_defaults(fn=_cmd_show)
    v = sub.add_parser("validate", help="check recipes; exit 1 with one line per problem")
    v.add_argument("recipes", nargs="+", metavar="NAME|FILE")
    v.set_defaults(fn=_cmd_validate)
    e = sub.add_parser("explain", help="what runs where and when, for an N-layer GPT")
    e.add_argument("recipe", metavar="NAME|FILE")
    e.add_argument("--layers", type=int, default=None, help="transformer layers of the model (default 4, or the "
                   "--model's)")
    e.add_argument("--model", metavar="NAME", default=None, help="a conf/model name: its layers and MoE layout "
                   "(experts, shared experts, routers; e.g. tiny_moe)")
    e.add_argument("--steps", type=int, default=None, help="training steps, to bound the stage table")
    e.add_argument("--detect", action="store_true", help="plan for this machine's GPU/TE instead of a CPU")
    e.add_argument("--layout", metavar="tp=2,pp=4,vpp=2,cp=2,dp=8",
                   help="a parallel layout (ep, etp with an MoE --model): also print which pipeline stage runs which "
                   "layers in which precision, and how the routed experts split")
    e.set_defaults(fn=_cmd_explain)
    m = sub.add_parser("memory", help="estimated memory per GPU of a GPT (dense or MoE) at a parallel layout "
                       "(docs/scale.md)")
    m.add_argument("model", metavar="MODEL", help="llama3-8b | llama3-70b | llama3-405b | mixtral-8x7b | a conf/model "
                   "name (MoE too: mixtral_8x7b_4l)")
    m.add_argument("--layout", default="", metavar="tp=8,pp=4,vpp=2,cp=2,dp=8,ep=8,etp=1",
                   help="parallel sizes (the rest 1); ep / etp: expert parallel / expert tensor parallel (MoE)")
    m.add_argument("--mbs", type=int, default=1, help="micro-batch size (default 1)")
    m.add_argument("--seq", type=int, default=8192, help="sequence length (default 8192)")
    m.add_argument("--fp8", action="store_true", help="an FP8 recipe with per-tensor scaling (FP8 weight copies)")
    m.add_argument("--recipe", metavar="NAME|FILE", default=None, help="a recipe instead of --fp8: FP8 or not, its "
                   "fp8_param, its first/last BF16 layers and its roles' FP8 / NVFP4 storage (TE's)")
    m.add_argument("--emulated", action="store_true", help="with --recipe: what the emulated backend holds "
                   "(dequantized BF16 copies: NVFP4 on Hopper) instead of Transformer Engine's storage")
    m.add_argument("--replicated-optimizer", action="store_true", help="without the distributed optimizer")
    m.add_argument("--fp8-param", action="store_true", help="FP8 layers' weights stored in FP8 (recipe fp8_param)")
    m.add_argument("--precision-aware-optimizer", action="store_true",
                   help="trainer.use_precision_aware_optimizer (implied by a dtype below other than fp32)")
    for key, choices in (("exp-avg-dtype", ("fp32", "bf16", "fp16")), ("exp-avg-sq-dtype", ("fp32", "bf16", "fp16")),
                         ("main-params-dtype", ("fp32", "fp16"))):
        m.add_argument(f"--{key}", choices=choices, default="fp32", help=f"trainer.{key.replace('-', '_')}")
    m.add_argument("--grad-reduce-in-bf16", action="store_true", help="trainer.grad_reduce_in_fp32=false: BF16 "
                   "gradient buffer (the main grads)")
    m.add_argument("--microbatches", type=int, default=None, metavar="N",
                   help="micro-batches per step (caps those in flight; default: enough to fill the pipeline)")
    m.set_defaults(fn=_cmd_memory)
    d = sub.add_parser("doctor", help="diagnose a run and propose a recipe change (exit 0 healthy, 1 problem)")
    d.add_argument("run_dir", metavar="RUN_DIR", help="a scripts/train.py run directory (metrics.jsonl, ...)")
    d.add_argument("--baseline", metavar="DIR", action="append", help="a BF16 run of the same config and seed: "
                   "tells FP8 from the LR and the data; spikes must exceed its own. Repeat it with BF16 runs of other "
                   "seeds (the first is the run's own): their spread is the noise floor a loss gap must exceed")
    d.add_argument("--write", metavar="PATH", help="write the recipe with the proposals applied (validated)")
    d.set_defaults(fn=_cmd_doctor)
    h = sub.add_parser("heatmap", help="an MoE run's experts x steps heat map (PNG; routing.jsonl, numerics.jsonl)")
    h.add_argument("run_dir", metavar="RUN_DIR", help="a scripts/train.py run directory of an MoE model")
    h.add_argument("--stat", default="scale_gap", choices=["tokens", "weight", "underflow_pct",
                                                             "block_underflow_pct", "scale_gap"],
                   help="tokens / mean routing weight per expert (every step), or its linears' worst underflow %% "
                   "or |log2(delayed / current scale)| (statistics steps; default scale_gap)")
    h.add_argument("--role", default=None, choices=["activations", "weights", "gradients"],
                   help="the operand role of --stat underflow_pct / block_underflow_pct / scale_gap (default "
                   "activations; none for tokens and weight)")
    h.add_argument("--out", metavar="PATH", default=None, help="the PNG to write (default RUN_DIR/experts_STAT.png)")
    h.set_defaults(fn=_cmd_heatmap)
    x = sub.add_parser("export", help="write a checkpoint as a Hugging Face Llama checkpoint (BF16 or FP8 with "
                       "scales; docs/handoff.md)")
    x.add_argument("source", metavar="RUN_DIR|STEP_DIR", help="a scripts/train.py run dir (its latest checkpoint) "
                   "or one of its checkpoints/step_N dirs, any parallel layout")
    x.add_argument("--to", required=True, choices=["hf"], help="the format: hf (config.json, tokenizer, safetensors)")
    x.add_argument("out", metavar="OUT", help="the directory to write (replaced atomically if it is an export)")
    x.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"], help="bf16 (default) | fp8: E4M3 "
                   "projections with weight_scale_inv; embeddings, norms and the LM head stay BF16")
    x.add_argument("--block", default=None, metavar="128x128|tensor", help="with --dtype fp8: one scale per "
                   "128x128 block (Float8BlockScaling, the default) or per tensor (Float8CurrentScaling)")
    x.set_defaults(fn=_cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for option in ("layers", "steps", "mbs", "seq", "microbatches"):  # none of these means anything at 0 or less
        value = getattr(args, option, None)
        if value is not None and value < 1:
            print(f"error: {args.command}: --{option} must be >= 1", file=sys.stderr)
            return 2
    if (getattr(args, "layers", None) or 0) > MODEL_MAX["num_layers"]:  # (a plan of a million layers fills memory)
        print(f"error: {args.command}: --layers {args.layers} is more than this plugin plans (at most "
              f"{MODEL_MAX['num_layers']:,})", file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except ValueError as e:  # RecipeError and other user errors: the first problem, as one `error: ...` line
        print(_error_line(first_problem(e)), file=sys.stderr)
        return 1
    except BrokenPipeError:  # `fp8-recipes show x | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
