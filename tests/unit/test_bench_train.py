"""scripts/bench_train.py's config labels (NAME, NAME:raw, NAME+LEVER) and its table, without a GPU."""

from __future__ import annotations

import re

import pytest

from fp8_recipes.bench.train import MODEL_LEVERS, check_configs, raw_megatron_fp8, summarize, with_levers
from fp8_recipes.integrations.common import megatron_fp8_fields
from fp8_recipes.plan.precision import Hardware, ModelLayout, PrecisionPlan
from fp8_recipes.recipe.pack import load_recipe

H200 = Hardware("cuda", (9, 0), "2.20.2", "NVIDIA H200")


def test_levers_turn_on_what_they_name():
    plain = load_recipe("delayed")
    assert not plain.layers.fp8_output_layer and with_levers(plain, ["head"]).layers.fp8_output_layer
    assert with_levers(plain, []) == plain


@pytest.mark.parametrize("label, says", [("delayed+hed", "unknown lever 'hed'"), ("bf16+hed", "unknown lever 'hed'"),
                                         ("bf16+head", "head is a lever of a recipe, not of bf16; put it on a "
                                                       "recipe, e.g. delayed+head; bf16 takes the model levers"),
                                         ("bf16+nofuse+fp8param", "fp8param is a lever of a recipe, not of bf16"),
                                         ("delayd", "no recipe 'delayd'"), ("delayed:rwa", "unknown mode 'rwa'")])
def test_bad_labels_are_one_line(label, says):
    with pytest.raises(ValueError) as e:
        check_configs(["delayed", label])
    assert str(e.value).startswith(f"--configs {label}: {says}") and "\n" not in str(e.value)


def test_lever_rows_compare_with_the_recipes_raw_megatron():
    def row(config, tps):
        return {"model": "m", "config": config, "te_recipe": "x", "tokens_per_s": tps, "peak_mem_gib": 1.0}

    result = {"rows": [row("bf16", 100.0), row("delayed", 135.0), row("delayed:raw", 134.0),
                       row("delayed+head", 148.0),
                       {"model": "m", "config": "delayed+head:raw", "skipped": "no flag"}]}
    table, _, series = summarize(result)
    line = next(r for r in table.splitlines() if "| delayed+head |" in r)
    assert line == "| m | delayed+head | x | 148 | 1.48 | - | 1.10 | 1.00 |"  # x BF16, no BF16 twin, ours / delayed:raw
    assert series["delayed+head"] == [pytest.approx(1.48)]


def test_lever_rows_compare_with_bf16_at_the_same_levers():
    """A config's levers that BF16 runs too (model, engine step; with --engine moments16) name its BF16 twin, the
    ratio issue 28's targets are read from; Megatron-Core's twin drops the head it has no FP8 version of."""
    def row(config, tps):
        return {"model": "m", "config": config, "te_recipe": "x", "tokens_per_s": tps, "peak_mem_gib": 1.0}

    result = {"engine": True, "rows": [
        row("bf16", 100.0), row("bf16+capacity+graphs", 120.0), row("bf16+capacity+graphs+moments16", 125.0),
        row("delayed+capacity+graphs", 144.0), row("delayed+capacity+graphs:raw", 132.0),
        row("delayed+capacity+graphs+head", 150.0), row("delayed+capacity+graphs+moments16", 160.0)]}
    lines = {line.split(" | ")[1]: line for line in summarize(result)[0].splitlines()[2:]}
    assert lines["delayed+capacity+graphs"] == "| m | delayed+capacity+graphs | x | 144 | 1.44 | 1.20 | 1.09 | 1.00 |"
    assert lines["delayed+capacity+graphs+head"].endswith(" | 150 | 1.50 | 1.25 | 1.14 | 1.00 |")  # ours / raw
    assert lines["delayed+capacity+graphs+moments16"].endswith(" | 160 | 1.60 | 1.28 | - | 1.00 |")
    assert lines["bf16+capacity+graphs"].endswith(" | 120 | 1.20 | - | - | 1.00 |")  # (its own twin)
    result["engine"] = False  # without --engine moments16 is the FP8 weights' optimizer's: not BF16's
    lines = {line.split(" | ")[1]: line for line in summarize(result)[0].splitlines()[2:]}
    assert lines["delayed+capacity+graphs+moments16"].endswith(" | 160 | 1.60 | 1.33 | - | 1.00 |")


def test_a_failed_engine_config_is_a_row_and_the_others_run_on(monkeypatch, tmp_path, capsys):
    """--engine runs each config in a process of its own: one that ends in an error (a capture that fails, an
    out-of-memory) becomes a ``failed`` row with the error's last line (the traceback printed), and the configs
    after it run, as a GPU burst needs; the table and --plot-only's reading take the row as unmeasured."""
    import torch

    from fp8_recipes.bench import train as bench
    from fp8_recipes.bench.output import load_result

    def apart(cfg, label, **kwargs):
        if label == "delayed+graphs":
            raise RuntimeError("Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of "
                               "memory (exit code 0)")
        return {"config": label, "te_recipe": "x", "tokens_per_s": {"bf16": 100.0}.get(label, 130.0),
                "peak_mem_gib": 1.0, "loss": 5.0, "step_ms": 1.0, "megatron_fp8": None}

    monkeypatch.setattr(bench, "_run_config_apart", apart)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    result = bench.bench_train(["tiny"], ["delayed+graphs", "delayed"], engine=True, out_dir=tmp_path)
    assert [(r["config"], r.get("failed")) for r in result["rows"]] == [
        ("bf16", None), ("delayed+graphs", "torch.OutOfMemoryError: CUDA out of memory (exit code 0)"),
        ("delayed", None)]
    out = capsys.readouterr()
    assert "tiny delayed+graphs: failed: torch.OutOfMemoryError" in out.out and "Traceback" in out.err
    table, _, series = summarize(result)
    assert "| tiny | delayed+graphs | failed: torch.OutOfMemoryError: CUDA out of memory (exit code 0) |" in table
    assert series["delayed"] == [pytest.approx(1.3)] and "delayed+graphs" not in series
    assert load_result(next(tmp_path.glob("*.json")), "train")["rows"][1]["failed"]


def test_attn_lever_goes_through_the_schema():
    assert with_levers(load_recipe("delayed"), ["attn", "head"]).attention == "fp8"
    with pytest.raises(ValueError, match="set attention: bf16"):
        with_levers(load_recipe("blockwise"), ["attn"])  # block-scaled activations: refused by the schema


@pytest.mark.parametrize("name", ["delayed", "tensorwise", "blockwise", "safe"])
def test_raw_config_is_the_adapters_mapping(name):
    """NAME:raw gives Megatron-Core the fields the Bridge / NeMo adapters would (one mapping, integrations/common)."""
    recipe = load_recipe(name)
    plan = PrecisionPlan(recipe, ModelLayout.gpt(4), Hardware("cuda", (9, 0), "2.20.2", "NVIDIA H200"))
    raw = raw_megatron_fp8(plan.at(10**6).modules["decoder.layers.1.mlp.linear_fc1"].te, recipe)
    if recipe.layers.bf16_first or recipe.layers.bf16_last:
        assert raw is None  # plain recipes only
        return
    native = megatron_fp8_fields(recipe, compute_capability=(9, 0), num_layers=4)
    assert raw and raw == {k: v for k, v in native.items() if k in raw} and raw["fp8_recipe"] == native["fp8_recipe"]


def test_fp8param_lever_goes_through_the_schema():
    assert with_levers(load_recipe("tensorwise"), ["fp8param"]).fp8_param
    assert not with_levers(load_recipe("tensorwise"), ["masters"]).fp8_param  # its baseline: BF16-stored weights
    check_configs(["delayed+fp8param", "delayed+masters", "blockwise+fp8param:raw"])
    with pytest.raises(ValueError, match=r"^schedule.bf16_warmup_steps: 100 with fp8_param: true"):
        with_levers(load_recipe("safe"), ["fp8param"])  # a BF16 warmup: refused by the schema


def test_moe_model_levers_and_moments16():
    check_configs(["bf16+nofuse", "delayed+pad", "delayed+pad:raw", "tensorwise+pad+nofuse+head",
                   "delayed+masters+moments16", "delayed+fp8param+moments16"])
    with pytest.raises(ValueError, match=r"^--configs delayed\+moments16: moments16 is the fp8param / masters "):
        check_configs(["delayed+moments16"])
    assert with_levers(load_recipe("delayed"), ["pad", "nofuse"]) == load_recipe("delayed")  # model keys only


def test_engine_step_levers():
    check_configs(["bf16+nogaf", "delayed+nogaf", "delayed+nogaf:raw", "delayed+pad+nogaf"], engine=True)
    assert with_levers(load_recipe("delayed"), ["nogaf"]) == load_recipe("delayed")  # the step's lever, not the recipe's
    with pytest.raises(ValueError, match=r"^--configs delayed\+nogaf: nogaf: a lever of the engine's step; add "
                                         r"--engine$"):
        check_configs(["delayed+nogaf"])
    with pytest.raises(ValueError, match=r"^--configs delayed\+fp8param: --engine runs the trainer's optimizer"):
        check_configs(["delayed+fp8param"], engine=True)


def test_moments16_with_the_engine_is_the_distributed_optimizers():
    """--engine: moments16 (on bf16 too) keeps the trainer's distributed optimizer's moments in BF16 (Megatron-LM's
    precision-aware optimizer); it never changes the recipe."""
    from fp8_recipes.bench.train import ENGINE_MOMENTS16
    from fp8_recipes.training.config import TrainerConfig

    check_configs(["bf16+moments16", "delayed+capacity+graphs+moments16", "delayed+moments16:raw"], engine=True)
    assert with_levers(load_recipe("delayed"), ["moments16", "graphs"]) == load_recipe("delayed")
    trainer = TrainerConfig.from_cfg({"use_distributed_optimizer": True, **ENGINE_MOMENTS16})
    assert (trainer.use_precision_aware_optimizer, trainer.exp_avg_dtype, trainer.exp_avg_sq_dtype) == (
        True, "bf16", "bf16")
    with pytest.raises(ValueError, match=r"^--configs bf16\+moments16: moments16 on bf16 is the trainer's "
                                         r"optimizer's: add --engine \(without it"):
        check_configs(["bf16+moments16"])  # (without --engine: the FP8 weights' optimizer's)
    with pytest.raises(ValueError, match=r"add \+fp8param or \+masters, or --engine"):
        check_configs(["delayed+moments16"])


def test_emulated_lever_runs_the_emulated_backend():
    """NAME+emulated (and bf16+emulated: the bf16 recipe) plan the emulated backend on a GPU with TE: what an NVFP4
    step on Hopper is made of, split into the local spec's own cost and the fake quantization's."""
    from fp8_recipes.bench.train import _decide
    from fp8_recipes.plan.precision import Backend

    check_configs(["bf16+emulated", "tensorwise+emulated", "delayed+capacity+emulated"])
    assert with_levers(load_recipe("tensorwise"), ["emulated"]).backend == "emulated"
    for label, bad in (("delayed+emulated:raw", ":raw"), ("delayed+masters+emulated", "masters")):
        with pytest.raises(ValueError, match=rf"^--configs {label.replace('+', '[+]')}: emulated runs .*{bad}"):
            check_configs([label])
    with pytest.raises(ValueError, match="--engine"):
        check_configs(["bf16+emulated"], engine=True)
    cfg = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "seq_length": 64,
           "vocab_size": 256}
    for label in ("bf16+emulated", "tensorwise+emulated"):
        run = _decide(cfg, label)
        assert run.ours and run.emulated and run.plan.backend is Backend.EMULATED and run.skipped is None, label
    assert not _decide(cfg, "bf16").ours


def test_graphs_lever_is_megatrons_own_cuda_graphs(megatron_cpu, monkeypatch):
    """Lever graphs: Megatron-Core's TE CUDA graphs as scripts/train.py runs them (model keys cuda_graph_impl and, for
    attngraphs, cuda_graph_modules: [attn]; test_graphs.py), on the engine's step, for bf16, NAME:raw and this
    project's TE backend (captured under the plan's one TE recipe: a plan whose layers differ is skipped, saying why;
    not the emulated backend)."""
    from fp8_recipes.bench import train as bench
    from fp8_recipes.bench.train import GRAPH_CAPTURE_STEP, GRAPH_LEVERS, _decide, load_model_cfg
    from fp8_recipes.plan.precision import StepPlan

    check_configs(["bf16+graphs", "delayed+graphs:raw", "blockwise+pad+graphs:raw", "bf16+attngraphs",
                   "delayed+graphs", "tensorwise+capacity+graphs", "blockwise+attngraphs"], engine=True, warmup=3)
    assert with_levers(load_recipe("delayed"), ["graphs"]) == load_recipe("delayed")  # the step's lever
    assert GRAPH_LEVERS["attngraphs"] == {"cuda_graph_modules": ["attn"]} and GRAPH_LEVERS["graphs"] == {}
    monkeypatch.setattr(bench.Hardware, "detect", classmethod(lambda cls: H200))
    tiny = {**load_model_cfg("tiny"), "vocab_size": 256}
    for label in ("delayed+graphs", "fast+graphs", "safe+graphs"):  # (safe: BF16 first and last layers)
        run = _decide(tiny, label, engine=True)
        assert run.ours and run.graphs == "graphs" and run.plan.te is not None and run.skipped is None, label
    monkeypatch.setattr(StepPlan, "graph_problem", lambda sp, layers: "layer 1 runs other")
    assert _decide(tiny, "delayed+graphs", engine=True).skipped == "layer 1 runs other"  # (test_te_backend.py)
    assert _decide(tiny, "delayed+graphs:raw", engine=True).skipped is None  # Megatron-Core's own recipe
    for label, configs, kwargs, match in (
            ("delayed+emulated+graphs", ["delayed+emulated+graphs"], {"engine": True},
             "capture TE-spec layers; the emulated backend runs the local spec; drop [+]emulated or [+]graphs$"),
            ("bf16+graphs", ["bf16+graphs"], {}, "a lever of the engine's step; add --engine$"),
            ("bf16+graphs", ["bf16+graphs"], {"engine": True, "warmup": GRAPH_CAPTURE_STEP},
             f"--warmup {GRAPH_CAPTURE_STEP + 1} or more$"),
            ("bf16+graphs+attngraphs", ["bf16+graphs+attngraphs"], {"engine": True}, "keep one$")):
        with pytest.raises(ValueError, match=rf"^--configs {label.replace('+', '[+]')}: .*{match}"):
            check_configs(configs, **kwargs)


def test_models_the_benchmark_cannot_build_or_fit_are_refused_before_any_run():
    """bench_train refuses in one line, before a model is built: a model without its own vocabulary (its random tokens
    need one) and, with --engine, a model whose BF16 weights, fp32 gradients and optimizer state exceed the GPU (on
    2026-12-06 4 Mixtral layers ran out of an H100's 79 GiB at the optimizer's first step, with a traceback; the
    estimate says ~106 GiB, which the H200's 139 GiB hold)."""
    from fp8_recipes.bench.train import check_fits, check_models

    check_models(["mixtral_8x7b_4l", "llama3_8b_8l"])
    with pytest.raises(ValueError, match=r"^--models moe_small: its vocab_size is '\$\{data.vocab_size\}'.* "
                                         r"\(gpt_125m, .*mixtral_8x7b_4l"):
        check_models(["llama3_8b_8l", "moe_small"])
    h100, h200 = int(79.2 * 2**30), int(139.8 * 2**30)
    assert check_fits(["mixtral_8x7b_4l"], [], seq=4096, mbs=1, engine=True, gpu_bytes=h200) == {}
    assert check_fits(["mixtral_8x7b_4l"], [], seq=4096, mbs=1, engine=False, gpu_bytes=h100) == {}  # plain AdamW
    assert check_fits(["qwen3_30b_a3b_4l", "llama3_8b_8l"], ["delayed"], seq=4096, mbs=1, engine=True,
                      gpu_bytes=h100) == {}
    with pytest.raises(ValueError, match=r"^--configs bf16: --engine's step of mixtral_8x7b_4l needs about 10\d GiB "
                                         r".*this one has 79 GiB \(75 usable\); add \+grads16\+moments16 \(BF16 "
                                         r"gradients / Adam moments: about 6\d GiB\), run it on a larger GPU, with "
                                         r"fewer --layers, or without --engine$"):
        check_fits(["llama3_8b_8l", "mixtral_8x7b_4l"], ["bf16"], seq=4096, mbs=1, engine=True, gpu_bytes=h100)
    with pytest.raises(ValueError, match=r"has 110 GiB \(104 usable\)"):  # (CUDA's context, NCCL, fragmentation)
        check_fits(["mixtral_8x7b_4l"], ["delayed"], seq=4096, mbs=1, engine=True, gpu_bytes=110 * 2**30)


def test_grads16_and_moments16_fit_four_mixtral_layers_on_an_h100(monkeypatch):
    """--engine with grads16 (DDP's gradient buffer in BF16) and moments16 (Adam's moments in BF16): the 4 Mixtral
    layers' step (~106 GiB in fp32, an H200's) fits an H100's 79 GiB; the plain bf16 baseline, which does not, is
    skipped with its reason and the table and plot read each row against BF16 at its levers."""
    import torch

    from fp8_recipes.bench import train as bench
    from fp8_recipes.training.config import TrainerConfig

    h100 = int(79.2 * 2**30)
    both = ["bf16+capacity+graphs+grads16+moments16", "delayed+capacity+graphs+head+grads16+moments16"]
    bench.check_configs(both, engine=True, warmup=2)
    assert bench.engine_trainer(["capacity", "grads16", "moments16"]) == {**bench.ENGINE_MOMENTS16,
                                                                          "grad_reduce_in_fp32": False}
    trainer = TrainerConfig.from_cfg({"use_distributed_optimizer": True, **bench.engine_trainer(["grads16"])})
    assert trainer.grad_reduce_in_fp32 is False
    skip = bench.check_fits(["mixtral_8x7b_4l"], both, seq=4096, mbs=1, engine=True, gpu_bytes=h100)
    assert list(skip) == ["mixtral_8x7b_4l"]
    assert re.fullmatch(r"the plain BF16 step needs about 10\d GiB \(75 usable\): read x BF16 same levers",
                        skip["mixtral_8x7b_4l"])
    with pytest.raises(ValueError, match=r"^--configs delayed\+moments16: --engine's step of mixtral_8x7b_4l needs "
                                         r"about 8\d GiB .*\(75 usable\); add \+grads16 \(BF16 gradients / Adam "
                                         r"moments: about 7\d GiB\), run it"):  # (only the lever it lacks)
        bench.check_fits(["mixtral_8x7b_4l"], ["delayed+moments16"], seq=4096, mbs=1, engine=True, gpu_bytes=h100)
    # the plain baseline skipped, a config whose BF16 at the same levers is not listed has nothing to be read against
    with pytest.raises(ValueError, match=r"^--configs delayed\+capacity\+graphs\+head\+grads16\+moments16: the plain "
                                         r"bf16 baseline cannot fit this GPU, and nothing else measures BF16 at this "
                                         r"config's levers; add bf16\+capacity\+graphs\+grads16\+moments16 to "
                                         r"--configs$"):
        bench.check_fits(["mixtral_8x7b_4l"], both[1:], seq=4096, mbs=1, engine=True, gpu_bytes=h100)
    assert list(bench.check_fits(["mixtral_8x7b_4l"], ["bf16+moments16+graphs+grads16+capacity", both[1]], seq=4096,
                                 mbs=1, engine=True, gpu_bytes=h100)) == ["mixtral_8x7b_4l"]  # (twin, lever order)
    with pytest.raises(ValueError, match=r"^--configs delayed\+grads16: grads16: a lever of the engine's step; "
                                         r"add --engine$"):
        bench.check_configs(["delayed+grads16"])

    runs = []
    monkeypatch.setattr(bench, "_run_config_apart", lambda cfg, label, **kw: runs.append(label) or {
        "config": label, "te_recipe": "x", "tokens_per_s": 130.0 if "delayed" in label else 100.0,
        "peak_mem_gib": 1.0, "loss": 5.0, "step_ms": 1.0})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    result = bench.bench_train(["tiny"], both, engine=True, skip_baseline={"tiny": "too big"})
    assert runs == both and result["rows"][0] == {"model": "tiny", "config": "bf16", "skipped": "too big",
                                                  "wall_s": pytest.approx(0, abs=1)}
    table, _, series = summarize(result)
    assert "| tiny | bf16 | skipped: too big |" in table
    assert "| tiny | delayed+capacity+graphs+head+grads16+moments16 | x | 130 | - | 1.30 | - | 1.00 |" in table
    assert series == {both[0]: [1.0], both[1]: [pytest.approx(1.3)]}
    # a second model whose plain bf16 ran: the plot still reads one kind of ratio, BF16 at the same levers, for both
    result["rows"] += [{"model": "big", "config": label, "te_recipe": "x", "tokens_per_s": tps, "peak_mem_gib": 1.0}
                       for label, tps in (("bf16", 50.0), ("bf16+graphs+capacity+moments16+grads16", 100.0),
                                          (both[1], 120.0))]
    table, _, series = summarize(result)
    assert "| big | delayed+capacity+graphs+head+grads16+moments16 | x | 120 | 2.40 | 1.20 | - | 1.00 |" in table
    assert series[both[1]] == [pytest.approx(1.3), pytest.approx(1.2)]  # (not 2.40: x plain BF16)


def test_layers_time_a_models_layer_shape_on_a_smaller_gpu(monkeypatch):
    """--layers N builds each model with N layers of its shape (4 Mixtral layers need the H200 on the engine's step,
    2 fit an H100's 79 GiB) and names the rows NAME@Nl, so they never read as the whole model's."""
    from fp8_recipes.bench.train import check_fits, load_model_cfg, model_label

    h100 = int(79.2 * 2**30)
    two = load_model_cfg("mixtral_8x7b_4l", layers=2)
    assert two == {**load_model_cfg("mixtral_8x7b_4l"), "num_layers": 2}
    assert model_label("mixtral_8x7b_4l", 2) == "mixtral_8x7b_4l@2l" and model_label("tiny") == "tiny"
    assert check_fits(["mixtral_8x7b_4l"], [], seq=4096, mbs=1, engine=True, gpu_bytes=h100, layers=2) == {}
    with pytest.raises(ValueError, match=r"^--configs delayed: --engine's step of mixtral_8x7b_4l at --layers 3 "
                                         r"needs about \d+ GiB .* with fewer --layers, or without --engine$"):
        check_fits(["mixtral_8x7b_4l"], ["delayed"], seq=4096, mbs=1, engine=True, gpu_bytes=h100, layers=3)

    import torch

    from fp8_recipes.bench import train as bench

    built = []
    monkeypatch.setattr(bench, "_run_config_apart", lambda cfg, label, **kw: built.append(cfg["num_layers"]) or {
        "config": label, "te_recipe": "x", "tokens_per_s": 1.0, "peak_mem_gib": 1.0, "loss": 5.0, "step_ms": 1.0})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    result = bench.bench_train(["tiny"], ["delayed"], engine=True, layers=1)
    assert built == [1, 1] and {r["model"] for r in result["rows"]} == {"tiny@1l"}
