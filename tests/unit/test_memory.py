"""The memory estimator (fp8_recipes/plan/memory.py) against what was measured: peaks of scripts/train.py on one H200
(docs/bench/bench_engine_h200.json and bench_bf16moments_h200.json, written by scripts/bench_parallel.py) within 10%,
the fp8_param saving (bench_fp8param_h200.json), the published Llama 3 parameter counts; each term's exact bytes on
a small config; docs/scale.md's Llama 3 table equal to the estimator's."""

import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fp8_recipes import cli
from fp8_recipes.plan.memory import (GIB, LLAMA3, OptimizerPrecision, estimate_memory, estimate_stages,
                                microbatches_in_flight, parameter_counts)
from fp8_recipes.plan.precision import ParallelLayout

ROOT = Path(__file__).resolve().parents[2]


def total_params(model: dict) -> int:
    c = parameter_counts(model)
    return c["embedding"] + c["output_layer"] + c["layers"] * c["layer"] + c["final_norm"]


@pytest.mark.parametrize("name, billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85)])
def test_llama3_parameter_counts(name, billions):
    assert total_params(LLAMA3[name]) / 1e9 == pytest.approx(billions, abs=0.01)


def test_estimate_within_ten_percent_of_the_h200_peaks():
    measured = json.loads((ROOT / "docs" / "bench" / "bench_engine_h200.json").read_text())
    runs = [r for r in measured["runs"] if r["layout"] == "1gpu" and "peak_gib" in r]
    assert {r["recipe"] for r in runs} == {"bf16", "delayed"}
    model = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "llama3_8b_8l.yaml"))
    for run in runs:
        estimate = estimate_memory(model, ParallelLayout(), micro_batch_size=measured["micro_batch_size"],
                                   seq_length=model["seq_length"], fp8=run["recipe"] != "bf16")
        assert estimate.total_gib == pytest.approx(run["peak_gib"], rel=0.10), (run, estimate.rows())


def test_layout_divides_what_it_shards():
    model = LLAMA3["llama3-70b"]
    one = estimate_memory(model, ParallelLayout(tp=8), micro_batch_size=1, seq_length=8192, fp8=False)
    dp = estimate_memory(model, ParallelLayout(tp=8, pp=4, dp=2), micro_batch_size=1, seq_length=8192, fp8=False)
    replicated = estimate_memory(model, ParallelLayout(tp=8, pp=4, dp=2), micro_batch_size=1, seq_length=8192,
                                 fp8=False, distributed_optimizer=False)
    assert replicated.optimizer == pytest.approx(2 * dp.optimizer)  # the distributed optimizer: 1 / DP
    assert dp.stage == 0 and dp.logits == 0  # the first stage: 4 micro-batches in flight outweigh the logits
    assert one.weights / 4 < dp.weights < one.weights / 3.5  # 80 layers over 4 stages, + the embedding on stage 0
    cp = estimate_memory(model, ParallelLayout(tp=8, pp=4, cp=2, dp=2), micro_batch_size=1, seq_length=8192, fp8=False)
    assert cp.activations == pytest.approx(dp.activations / 2) and cp.optimizer == pytest.approx(dp.optimizer / 2)
    fp8 = estimate_memory(model, ParallelLayout(tp=8, pp=4, dp=2), micro_batch_size=1, seq_length=8192, fp8=True)
    assert fp8.fp8_weights > 0 and fp8.activations < dp.activations


def test_memory_command(capsys):
    assert cli.main(["memory", "llama3-70b", "--layout", "tp=4,pp=4,vpp=5,cp=2,dp=4", "--fp8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama3-70b: tp=4, pp=4, vpp=5, cp=2, dp=4: 128 GPUs, micro-batch 1, seq 8192, FP8")
    assert "  total" in out and "GiB" in out
    assert cli.main(["memory", "llama3-1b"]) == 1
    assert "is not a model" in capsys.readouterr().err
    assert GIB == 2**30


# A small Llama-style config: per layer 36,864 linear parameters (qkv 64 x 128, proj 64 x 64, fc1 64 x 256,
# fc2 128 x 64) + 128 norm; embedding and head 256 x 64 each, final norm 64: 180,800 parameters in all.
SMALL = {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
         "vocab_size": 256, "normalization": "RMSNorm", "activation": "swiglu"}
SMALL_PARAMS, SMALL_LINEARS = 180_800, 4 * 36_864


def small(layout: ParallelLayout | None = None, **kwargs):
    kwargs = {"micro_batch_size": 1, "seq_length": 32, "fp8": False, **kwargs}
    return estimate_memory(SMALL, layout or ParallelLayout(), **kwargs)


def test_small_config_counts():
    assert total_params(SMALL) == SMALL_PARAMS and parameter_counts(SMALL)["layers"] * 36_864 == SMALL_LINEARS


def test_optimizer_bytes_follow_the_dtypes_sharded_over_dp():
    dp2 = ParallelLayout(dp=2)
    assert small(dp2).optimizer == 12 * SMALL_PARAMS / 2  # fp32 main params + two fp32 moments
    assert small(dp2, distributed_optimizer=False).optimizer == 12 * SMALL_PARAMS
    bf16 = OptimizerPrecision(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    assert small(dp2, optimizer=bf16).optimizer == (2 + 2 + 2) * SMALL_PARAMS / 2  # main params: 16-bit remainders
    mixed = OptimizerPrecision(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", main_params_dtype="fp16")
    assert small(dp2, optimizer=mixed).optimizer == (2 + 4 + 2) * SMALL_PARAMS / 2
    aware = OptimizerPrecision(use_precision_aware_optimizer=True)  # fp32 moments, remainders only
    assert small(dp2, optimizer=aware).optimizer == (4 + 4 + 2) * SMALL_PARAMS / 2


def test_grads_follow_grad_reduce_in_fp32():
    assert small().grads == 4 * SMALL_PARAMS
    assert small(optimizer=OptimizerPrecision(grad_reduce_in_fp32=False)).grads == 2 * SMALL_PARAMS


def test_fp8_param_drops_the_bf16_copy_of_fp8_linears():
    plain, stored = small(fp8=True), small(fp8=True, fp8_param=True)
    assert plain.weights == 2 * SMALL_PARAMS and stored.weights == 2 * (SMALL_PARAMS - SMALL_LINEARS)
    assert plain.fp8_weights == stored.fp8_weights == 2 * SMALL_LINEARS  # the FP8 parameter takes the copy's place
    assert stored.optimizer == plain.optimizer == 12 * SMALL_PARAMS
    bf16 = OptimizerPrecision(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    # fp32 main params kept whole with FP8-stored weights (no remainders)
    assert small(fp8=True, fp8_param=True, optimizer=bf16).optimizer == (2 + 2 + 4) * SMALL_PARAMS


def test_what_the_trainer_refuses_the_estimator_refuses():
    with pytest.raises(ValueError, match="--fp8"):
        small(fp8_param=True)
    with pytest.raises(ValueError, match="distributed optimizer"):
        small(fp8=True, fp8_param=True, distributed_optimizer=False)
    with pytest.raises(ValueError, match="distributed optimizer"):
        small(optimizer=OptimizerPrecision(use_precision_aware_optimizer=True), distributed_optimizer=False)
    with pytest.raises(ValueError, match="trainer.exp_avg_dtype=bf16: needs trainer.use_precision_aware_optimizer"):
        OptimizerPrecision(exp_avg_dtype="bf16")
    with pytest.raises(ValueError, match="trainer.main_params_dtype='bf16'"):
        OptimizerPrecision(use_precision_aware_optimizer=True, main_params_dtype="bf16")


def test_optimizer_keys_are_the_trainers():
    from fp8_recipes.training.config import TrainerConfig

    trainer = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "trainer" / "gpu.yaml"))
    assert set(OptimizerPrecision.__dataclass_fields__) <= set(TrainerConfig.__dataclass_fields__)
    assert OptimizerPrecision.from_trainer({**trainer, "use_precision_aware_optimizer": True,
                                            "exp_avg_dtype": "bf16"}).moment_bytes == 6


def test_microbatches_in_flight_as_megatron_core_schedules_them():
    pp4 = ParallelLayout(pp=4)
    assert [microbatches_in_flight(pp4, k) for k in range(4)] == [4, 3, 2, 1]  # 1F1B: pp - stage
    assert [microbatches_in_flight(pp4, k, num_microbatches=2) for k in range(4)] == [2, 2, 2, 1]
    # interleaved, 2 chunks: warm-up 2 x (pp - stage - 1) + (vpp - 1) x pp chunk-micro-batches, + 1, halves
    vpp = ParallelLayout(pp=4, vpp=2)
    assert [microbatches_in_flight(vpp, k) for k in range(4)] == [11 / 2, 9 / 2, 7 / 2, 5 / 2]
    assert microbatches_in_flight(ParallelLayout(pp=8, vpp=4), 0) == 8 + 7 / 4
    assert microbatches_in_flight(ParallelLayout(), 0) == 1


def test_stages_embedding_first_head_and_logits_last():
    first, last = estimate_stages(SMALL, ParallelLayout(pp=2), micro_batch_size=1, seq_length=32, fp8=False)
    layer = 36_992
    assert first.weights == 2 * (2 * layer + 256 * 64)  # two layers + the embedding
    assert last.weights == 2 * (2 * layer + 256 * 64 + 64)  # two layers + the LM head + the final norm
    per_token_layer = 2 * (2 * 64 + 2 * 64 + (128 + 64 + 2 * 128 + 128))  # BF16, no TP: 1,664 bytes
    assert first.activations == 2 * 2 * 32 * per_token_layer and first.in_flight == 2  # 2 micro-batches in flight
    assert last.activations == 1 * 2 * 32 * per_token_layer and last.in_flight == 1
    assert first.logits == 0 and last.logits == 8 * 32 * 256  # BF16 logits + fp32 copy + BF16 gradient
    assert small(ParallelLayout(pp=2)) == first  # the peak: the first stage's second micro-batch outweighs the head
    tied = {**SMALL, "share_embeddings_and_output_weights": True}
    one, = estimate_stages(tied, ParallelLayout(), micro_batch_size=1, seq_length=32, fp8=False)
    assert one.weights == 2 * (SMALL_PARAMS - 256 * 64)  # one embedding matrix, shared by the head
    _, tied_last = estimate_stages(tied, ParallelLayout(pp=2), micro_batch_size=1, seq_length=32, fp8=False)
    assert tied_last.weights == last.weights  # the last stage keeps its own copy of the embedding for the head


def test_memory_command_prints_the_stages(capsys):
    assert cli.main(["memory", "llama3-70b", "--layout", "tp=8,pp=4,dp=2", "--fp8", "--fp8-param",
                     "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "FP8-stored weights" in out and "precision-aware: moments bf16/bf16, main params fp32" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    assert [r[:3] for r in rows] == [["0", "20", "4.00"], ["1", "20", "3.00"], ["2", "20", "2.00"], ["3", "20", "1.00"]]
    assert cli.main(["memory", "llama3-8b", "--layout", "dp=8"]) == 0
    assert "per stage" not in capsys.readouterr().out
    assert cli.main(["memory", "llama3-8b", "--fp8-param"]) == 1
    assert "--fp8" in capsys.readouterr().err


def _peak(run: dict) -> float:
    return run.get("peak_gib", run.get("peak_mem_gib"))


def test_bf16_moments_within_ten_percent_and_the_saving_as_measured():
    measured = json.loads((ROOT / "docs" / "bench" / "bench_bf16moments_h200.json").read_text())
    model = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "llama3_8b_8l.yaml"))
    bf16 = OptimizerPrecision(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    peaks = {}
    for run in measured["runs"]:
        estimate = estimate_memory(model, ParallelLayout(), micro_batch_size=measured["micro_batch_size"],
                                   seq_length=model["seq_length"], fp8=run["recipe"] != "bf16",
                                   optimizer=bf16 if run["layout"] == "1gpu-bf16moments" else None)
        assert estimate.total_gib == pytest.approx(_peak(run), rel=0.10), (run, estimate.rows())
        peaks[run["layout"], run["recipe"]] = (_peak(run), estimate.total_gib)
    for recipe in ("bf16", "delayed"):
        (fp32_measured, fp32_estimate), (bf16_measured, bf16_estimate) = (peaks["1gpu", recipe],
                                                                          peaks["1gpu-bf16moments", recipe])
        assert fp32_estimate - bf16_estimate == pytest.approx(fp32_measured - bf16_measured, rel=0.02)


def test_fp8_param_saving_as_measured():
    measured = json.loads((ROOT / "docs" / "bench" / "bench_fp8param_h200.json").read_text())
    rows = {r["config"]: r for r in measured["rows"]}
    model = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "llama3_8b_16l.yaml"))
    kwargs = {"micro_batch_size": 2, "seq_length": 4096, "fp8": True}
    saving = (estimate_memory(model, ParallelLayout(), **kwargs).total
              - estimate_memory(model, ParallelLayout(), fp8_param=True, **kwargs).total) / GIB
    for recipe in ("delayed", "tensorwise", "blockwise"):
        measured = _peak(rows[f"{recipe}+masters"]) - _peak(rows[f"{recipe}+fp8param"])
        assert saving == pytest.approx(measured, rel=0.02), recipe


# docs/scale.md's table: (model, layout) as in the doc; every number the estimator's.
SCALE_LAYOUTS = [("llama3-8b", "dp=8"), ("llama3-8b", "tp=2,dp=4"), ("llama3-8b", "pp=2,dp=4"),
                 ("llama3-70b", "tp=8"), ("llama3-70b", "tp=8,pp=4,dp=2"), ("llama3-70b", "tp=4,pp=4,dp=4"),
                 ("llama3-70b", "tp=4,pp=4,vpp=5,cp=2,dp=4"), ("llama3-405b", "tp=8,pp=9,dp=2"),
                 ("llama3-405b", "tp=8,pp=9,cp=2,dp=4"), ("llama3-405b", "tp=8,pp=14,vpp=3,cp=2,dp=4")]
SCALE_HEADER = ("| model | layout (GPUs) | peak stage (FP8) | weights | grads | optimizer (distributed / replicated) | "
                "FP8 weights | activations BF16 / FP8 | logits | total BF16 | total FP8 | total FP8, replicated "
                "optimizer | total FP8, fp8_param + BF16 moments |\n|" + "---|" * 13)


def scale_rows() -> list[str]:
    bf16_moments = OptimizerPrecision(use_precision_aware_optimizer=True, exp_avg_dtype="bf16",
                                      exp_avg_sq_dtype="bf16")

    def total(gib: float) -> str:
        return f"{gib:.0f}" if gib <= 140 else f"**{gib:.0f}** (over)"

    rows = []
    for name, text in SCALE_LAYOUTS:
        layout = ParallelLayout.parse(text)

        common = {"micro_batch_size": 1, "seq_length": 8192}
        fp8 = estimate_memory(LLAMA3[name], layout, fp8=True, **common)
        bf16 = estimate_memory(LLAMA3[name], layout, fp8=False, **common)
        replicated = estimate_memory(LLAMA3[name], layout, fp8=True, distributed_optimizer=False, **common)
        lean = estimate_memory(LLAMA3[name], layout, fp8=True, fp8_param=True, optimizer=bf16_moments, **common)
        stage = f"{fp8.stage} of {layout.pp}" if layout.pp > 1 else "-"
        rows.append(f"| {name} | {text} ({layout.gpus}) | {stage} | {fp8.weights / GIB:.1f} | {fp8.grads / GIB:.1f} | "
                    f"{fp8.optimizer / GIB:.1f} / {replicated.optimizer / GIB:.1f} | {fp8.fp8_weights / GIB:.1f} | "
                    f"{bf16.activations / GIB:.1f} / {fp8.activations / GIB:.1f} | {fp8.logits / GIB:.1f} | "
                    f"{total(bf16.total_gib)} | {total(fp8.total_gib)} | {total(replicated.total_gib)} | "
                    f"{total(lean.total_gib)} |")
    return rows


STAGE_LAYOUTS = [("llama3-8b", "pp=2,dp=4"), ("llama3-70b", "tp=4,pp=4,vpp=5,cp=2,dp=4"),
                 ("llama3-405b", "tp=8,pp=9,cp=2,dp=4")]


def stage_rows() -> list[str]:
    """docs/scale.md's per-stage table: FP8, distributed optimizer; (micro-batches in flight) and GiB per stage."""
    rows = []
    for name, text in STAGE_LAYOUTS:
        stages = estimate_stages(LLAMA3[name], ParallelLayout.parse(text), micro_batch_size=1, seq_length=8192,
                                 fp8=True)
        cells = ", ".join(f"{s.total_gib:.1f} ({s.in_flight:g})" for s in stages)
        rows.append(f"| {name} | {text} | {cells} |")
    return rows


def test_scale_tables_are_the_estimators():
    text = (ROOT / "docs" / "scale.md").read_text()
    assert SCALE_HEADER in text
    for row in scale_rows() + stage_rows():
        assert row in text, row


# ---------------------------------------------------------------------------------------------------------------
# Mixture-of-Experts

# SMALL with 4 routed experts of FFN 32 (top-2) in layers 0 and 2: per MoE layer attention 12,288 (qkv 8,192 + proj
# 4,096), norms 128, router 4 x 64, each expert 64 x 64 (fc1, SwiGLU) + 32 x 64 (fc2) = 6,144.
SMALL_MOE = {**SMALL, "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_layer_freq": 2}
EXPERT, MOE_LAYER, MOE_LINEARS = 6_144, 12_672, 12_288
MOE_PARAMS = 256 * 64 * 2 + 64 + 2 * 36_992 + 2 * (MOE_LAYER + 4 * EXPERT)


def moe(layout: ParallelLayout, model: dict | None = None, **kwargs):
    return estimate_memory(model or SMALL_MOE, layout, **{"micro_batch_size": 1, "seq_length": 32, "fp8": False,
                                                         **kwargs})


def test_moe_parameter_counts():
    c = parameter_counts(SMALL_MOE)
    assert (c["moe_layers"], c["experts"], c["expert"], c["router"], c["moe_layer"], c["moe_layer_linears"]) == (
        2, 4, EXPERT, 256, MOE_LAYER, MOE_LINEARS)
    mixtral = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "mixtral_8x7b_4l.yaml"))
    c = parameter_counts({**mixtral, "num_layers": 32})  # the whole Mixtral-8x7B: 46.7 B parameters
    total = c["embedding"] + c["output_layer"] + c["final_norm"] + c["moe_layers"] * (
        c["moe_layer"] + c["experts"] * c["expert"])
    assert total / 1e9 == pytest.approx(46.70, abs=0.01)


def test_experts_shard_over_ep_and_their_state_over_expert_dp():
    e = moe(ParallelLayout(ep=2, dp=2))
    experts = 2 * 2 * EXPERT  # 2 MoE layers x 2 of the 4 experts on each EP rank
    dense = MOE_PARAMS - 2 * 4 * EXPERT
    assert e.weights == 2 * (dense + experts) and e.grads == 4 * (dense + experts)
    # the dense parts over dp x cp = 2, the experts over expert DP = dp / EP = 1
    assert e.optimizer == 12 * dense / 2 + 12 * experts
    shares = dict(e.experts)
    assert (shares["weights"], shares["optimizer"]) == (2 * experts, 12 * experts)
    assert moe(ParallelLayout(dp=2)).optimizer == 12 * MOE_PARAMS / 2  # no EP: every expert sharded over DP
    assert moe(ParallelLayout(ep=2, dp=4)).optimizer == 12 * dense / 4 + 12 * experts / 2
    # expert TP 1 under TP 2 (sequence parallel): each rank holds whole experts, expert DP = tp x dp / (1 x EP)
    etp = moe(ParallelLayout(tp=2, dp=2, ep=2, etp=1))
    assert dict(etp.experts)["weights"] == 2 * experts and dict(etp.experts)["optimizer"] == 12 * experts / 2


def test_moe_activations_routed_rows_router_and_dispatch():
    e = moe(ParallelLayout(ep=2, dp=2))
    dense_layer = 32 * 1_664  # per token: test_stages_embedding_first_head_and_logits_last's
    attention, router = 32 * 2 * (2 * 64 + 64 + 128 + 64), 32 * (2 * 64 + 8 * 4)  # + the MLP norm out, fp32 scores
    routed = 32 * 2 * 2 * (64 + 2 * 32 + 32)  # top-2 rows: fc1 in, fc1 out (SwiGLU), fc2 in, BF16
    dispatch = 2 * (32 * 2) * 64 * 2  # permuted tokens sent + experts' output, one layer
    assert e.activations == 2 * dense_layer + 2 * (attention + router + routed) + dispatch
    assert dict(e.experts)["activations"] == 2 * routed and dict(e.experts)["dispatch"] == dispatch
    f = moe(ParallelLayout(ep=2, dp=2), fp8=True)
    # FP8: fc1's and fc2's inputs kept as FP8; each of the 2 local experts padded by up to 16 rows
    assert dict(f.experts)["activations"] == 2 * (64 + 2 * 16) * (2 * (64 + 2 * 32 + 32) - (64 + 32))
    assert f.fp8_weights == 2 * (2 * 36_864 + 2 * MOE_LINEARS + 2 * 2 * EXPERT)  # the router stays BF16
    padded = moe(ParallelLayout(ep=2, dp=2), {**SMALL_MOE, "moe_router_padding_for_quantization": True}, fp8=True)
    # the router pads each of the 4 experts' share of the sending rank: those rows ride through the dispatch too
    assert dict(padded.experts)["dispatch"] == 2 * (64 + 16 * 4) * 64 * 2
    one = moe(ParallelLayout())
    assert dict(one.experts)["dispatch"] == (32 * 2) * 64 * 2  # no all-to-all copy without EP
    # padded to capacity 1.5: every expert 1.5x its balanced share of rows (dropping alone keeps the balanced share)
    cap = {**SMALL_MOE, "moe_expert_capacity_factor": 1.5}
    assert dict(moe(ParallelLayout(ep=2, dp=2), cap).experts) == dict(e.experts)
    full = moe(ParallelLayout(ep=2, dp=2), {**cap, "moe_pad_expert_input_to_capacity": True})
    assert dict(full.experts)["activations"] == 1.5 * 2 * routed and dict(full.experts)["dispatch"] == 1.5 * dispatch


def test_moe_layouts_megatron_core_refuses_are_refused():
    with pytest.raises(ValueError, match=r"^--layout: ep=3 does not divide the 4 routed experts"):
        moe(ParallelLayout(ep=3, dp=3))
    with pytest.raises(ValueError, match=r"^--layout: expert TP x EP = 1 x 4 does not divide a stage's tp x cp x dp"):
        moe(ParallelLayout(ep=4, dp=2))
    with pytest.raises(ValueError, match=r"^sequence_parallel: .*trainer.sequence_parallel=true"):
        moe(ParallelLayout(tp=2), sequence_parallel=False)
    with pytest.raises(ValueError, match=r"^--layout: ep / etp split routed experts, and this model has none"):
        small(ParallelLayout(ep=2, dp=2))


def test_a_recipe_sets_the_fp8_layers_and_the_weight_copies():
    from fp8_recipes.plan.memory import fp8_layers_of, fp8_weight_copy_bytes
    from fp8_recipes.recipe.pack import load_recipe

    assert fp8_layers_of(load_recipe("safe"), 4) == {1, 2} and fp8_layers_of(load_recipe("delayed"), 4) == {0, 1, 2, 3}
    assert fp8_weight_copy_bytes(load_recipe("delayed")) == 2
    assert fp8_weight_copy_bytes(load_recipe("blockwise")) == 2 + 8 / 128**2
    assert fp8_weight_copy_bytes(load_recipe("mxfp8")) == 2 + 2 / 32
    all_fp8 = moe(ParallelLayout(), fp8=True)
    safe = moe(ParallelLayout(), fp8=True, fp8_layers={1, 2})  # layer 2 (MoE) and 1 (dense) FP8, 0 and 3 BF16
    assert safe.fp8_weights == 2 * (36_864 + MOE_LINEARS + 4 * EXPERT) < all_fp8.fp8_weights
    long = {"seq_length": 512}  # (at 32 tokens the FP8 padding, 16 rows per expert, outweighs what FP8 saves)
    assert (moe(ParallelLayout(), fp8=True, **long).activations < moe(ParallelLayout(), fp8=True, fp8_layers={1, 2},
                                                                      **long).activations
            < moe(ParallelLayout(), **long).activations)


def test_fp8_copies_only_for_the_linears_the_plan_runs_in_fp8(tmp_path, capsys):
    from fp8_recipes.plan.memory import fp8_modules_of
    from fp8_recipes.recipe.pack import load_recipe_dict
    from fp8_recipes.recipe.schema import Recipe

    def modules_of(**changes) -> frozenset[str]:
        return fp8_modules_of(Recipe.from_dict({**load_recipe_dict("tensorwise"), **changes}), SMALL_MOE)

    every = moe(ParallelLayout(), fp8=True)
    assert moe(ParallelLayout(), fp8=True, fp8_modules=modules_of()) == every  # every linear FP8: the default's
    bf16_experts = moe(ParallelLayout(), fp8=True, fp8_modules=modules_of(layers={"bf16_modules": ["*experts*"]}))
    assert bf16_experts.fp8_weights == 2 * (2 * 36_864 + 2 * MOE_LINEARS)  # the dense layers and MoE attention only
    assert dict(bf16_experts.experts)["fp8_weights"] == 0 and bf16_experts.activations == every.activations
    # expert 0 of each MoE layer BF16: EP rank 0 holds it; the estimate is rank 1's, with both of its experts FP8
    one = modules_of(layers={"bf16_modules": ["*.local_experts.0.*"]})
    assert dict(moe(ParallelLayout(ep=2, dp=2), fp8=True, fp8_modules=one).experts)["fp8_weights"] == 2 * 2 * 2 * EXPERT
    assert dict(moe(ParallelLayout(), fp8=True, fp8_modules=one).experts)["fp8_weights"] == 2 * 2 * 3 * EXPERT
    # a per-module policy that keeps the experts' weights BF16 leaves them no FP8 copy
    no_weights = modules_of(modules={"*.experts.*": {"weights": "none"}})
    assert dict(moe(ParallelLayout(), fp8=True, fp8_modules=no_weights).experts)["fp8_weights"] == 0
    assert len(modules_of(layers={"fp8_output_layer": True}) - modules_of()) == 1  # the LM head's copy
    recipe = tmp_path / "bf16_experts.yaml"
    recipe.write_text("defaults: [delayed, _self_]\nname: bf16_experts\nlayers: {bf16_modules: ['*experts*']}\n")
    for name in ("delayed", str(recipe)):
        assert cli.main(["memory", "mixtral_8x7b_4l", "--seq", "4096", "--recipe", name]) == 0
    delayed, kept = (float(re.search(r"^  fp8_weights +([\d.]+) GiB", out, re.M)[1])
                     for out in capsys.readouterr().out.split("mixtral_8x7b_4l: ")[1:])
    attention = 4096 * (6144 + 4096)  # qkv (GQA 32/8) and proj; 2 B per parameter, 4 layers
    assert (delayed, kept) == (pytest.approx(2 * 4 * (8 * 3 * 4096 * 14336 + attention) / GIB, abs=0.05),
                               pytest.approx(2 * 4 * attention / GIB, abs=0.05))


def test_expert_tp_must_divide_the_experts_ffn_in_memory_and_training():
    from fp8_recipes.plan.precision import TRAINER_WORDS
    from fp8_recipes.training.config import TrainerConfig

    with pytest.raises(ValueError, match=r"^--layout: etp=3 \(the experts' TP size\) does not divide the experts' "
                                         r"FFN width \(model.moe_ffn_hidden_size=32\); set etp to a divisor of 32$"):
        moe(ParallelLayout(etp=3, dp=3))
    with pytest.raises(ValueError, match=r"^--layout: tp=3 \(the experts' TP size\) does not divide"):
        ParallelLayout(tp=3).check_experts(4, 32)
    ParallelLayout(tp=3, etp=1).check_experts(4, 32)
    trainer = TrainerConfig.from_cfg({"expert_tensor_parallel_size": 3})
    with pytest.raises(ValueError, match=r"^trainer\.expert_tensor_parallel_size=3 does not divide the experts' FFN "
                                         r"width \(model.moe_ffn_hidden_size=32\); pick a divisor of it$"):
        trainer.check_experts(SMALL_MOE, 3)
    with pytest.raises(ValueError, match=r"^trainer\.expert_tensor_parallel_size=3 does not divide"):
        ParallelLayout(etp=3, dp=3).check_experts(4, 32, TRAINER_WORDS)  # the trainer's check is this one
    with pytest.raises(ValueError, match=r"^trainer\.expert_model_parallel_size: expert tensor parallel x EP x "
                                         r"pipeline = 1 x 2 x 1 = 2 does not divide the 1 launched processes"):
        TrainerConfig.from_cfg({"expert_model_parallel_size": 2}).check_experts(SMALL_MOE, 1)
    with pytest.raises(ValueError, match=r"^trainer\.expert_tensor_parallel_size=1: the model has no experts"):
        TrainerConfig.from_cfg({"expert_tensor_parallel_size": 1}).check_experts(SMALL, 1)


def test_memory_command_estimates_an_moe_model(capsys):
    assert cli.main(["memory", "mixtral_8x7b_4l", "--seq", "4096", "--recipe", "delayed"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mixtral_8x7b_4l: tp=1, pp=1, cp=1, dp=1: 1 GPUs, micro-batch 1, seq 4096, FP8 (recipe "
                          "delayed)")
    assert "of which the routed experts (ep=1, expert TP 1" in out and "dispatch buffers" in out
    assert cli.main(["memory", "qwen3_30b_a3b_4l", "--seq", "4096", "--layout", "ep=8,dp=8", "--fp8"]) == 0
    assert "dp=8, ep=8: 8 GPUs" in capsys.readouterr().out
    assert cli.main(["memory", "mixtral_8x7b_4l", "--recipe", "delayed", "--fp8"]) == 1
    assert "drop --fp8" in capsys.readouterr().err
    assert cli.main(["memory", "mixtral_8x7b_4l", "--layout", "ep=3,dp=3"]) == 1
    assert capsys.readouterr().err.startswith("error: --layout: ep=3 does not divide the 8 routed experts")


def engine_peaks() -> dict[str, float]:
    """The engine's measured peaks (GiB) of mixtral_8x7b_4l on one H200, from the committed run log."""
    log = (ROOT / "docs" / "bench" / "memory_moe_engine_h200.log").read_text()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+) peak GiB ([\d.]+)", log, re.M)}


def moe_check_rows() -> list[str]:
    """docs/scale.md's MoE rows of the H200 check: mixtral_8x7b_4l on one GPU, micro-batch 1, seq 4096, as
    `fp8-recipes memory mixtral_8x7b_4l --seq 4096 --recipe bf16|delayed` prints them, and the engine's peak."""
    peaks = engine_peaks()
    model = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "mixtral_8x7b_4l.yaml"))
    rows = []
    for name in ("bf16", "delayed"):
        fp8 = name != "bf16"
        e = estimate_memory(model, ParallelLayout(), micro_batch_size=1, seq_length=4096, fp8=fp8)
        shares = dict(e.experts)
        rows.append(f"| {name} | " + " | ".join(f"{gib:.1f}" for _, gib in e.rows()[:-1])
                    + f" | {e.total_gib:.1f} | {shares['weights'] / GIB:.1f} / {shares['optimizer'] / GIB:.1f} | "
                    f"{shares['dispatch'] / GIB:.2f} | {peaks[name]:.2f} |")
        assert e.total_gib == pytest.approx(peaks[name], rel=0.05), (name, e.total_gib, peaks[name])
    return rows


def test_moe_check_rows_are_the_estimators():
    text = (ROOT / "docs" / "scale.md").read_text()
    for row in moe_check_rows():
        assert row in text, row


# docs/scale.md's Mixtral-8x7B table: (layout) as in the doc; every number the estimator's.
MOE_LAYOUTS = ["dp=8", "ep=8,dp=8", "tp=2,dp=4,ep=4", "tp=2,dp=4,ep=4,etp=1", "pp=4,dp=8", "pp=4,ep=8,dp=8"]
MOE_HEADER = ("| layout (GPUs) | peak stage (FP8) | weights | grads | optimizer | FP8 weights | activations BF16 / FP8 "
              "| logits | routed experts: weights / grads / optimizer | total BF16 | total FP8 | total FP8, "
              "fp8_param + BF16 moments |\n|" + "---|" * 12)


def moe_scale_rows() -> list[str]:
    from fp8_recipes.plan.memory import MIXTRAL

    lean_opt = OptimizerPrecision(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    rows = []
    for text in MOE_LAYOUTS:
        layout = ParallelLayout.parse(text)
        common = {"micro_batch_size": 1, "seq_length": 4096}
        fp8 = estimate_memory(MIXTRAL["mixtral-8x7b"], layout, fp8=True, **common)
        bf16 = estimate_memory(MIXTRAL["mixtral-8x7b"], layout, fp8=False, **common)
        lean = estimate_memory(MIXTRAL["mixtral-8x7b"], layout, fp8=True, fp8_param=True, optimizer=lean_opt, **common)
        x = dict(fp8.experts)
        stage = f"{fp8.stage} of {layout.pp}" if layout.pp > 1 else "-"

        def total(gib: float) -> str:
            return f"{gib:.0f}" if gib <= 140 else f"**{gib:.0f}** (over)"

        rows.append(f"| {text} ({layout.gpus}) | {stage} | {fp8.weights / GIB:.1f} | {fp8.grads / GIB:.1f} | "
                    f"{fp8.optimizer / GIB:.1f} | {fp8.fp8_weights / GIB:.1f} | {bf16.activations / GIB:.1f} / "
                    f"{fp8.activations / GIB:.1f} | {fp8.logits / GIB:.1f} | {x['weights'] / GIB:.1f} / "
                    f"{x['grads'] / GIB:.1f} / {x['optimizer'] / GIB:.1f} | {total(bf16.total_gib)} | "
                    f"{total(fp8.total_gib)} | {total(lean.total_gib)} |")
    return rows


def test_moe_scale_table_is_the_estimators():
    text = (ROOT / "docs" / "scale.md").read_text()
    assert MOE_HEADER in text
    for row in moe_scale_rows():
        assert row in text, row


def bench_train_estimate(model: dict, fp8: bool, *, micro_batch_size: int, seq_length: int) -> float:
    """GiB per GPU of scripts/bench_train.py's step (bench/train.py: no DDP, plain fused AdamW on the BF16 params):
    the estimator's weights, BF16 gradients, FP8 copies, activations and logits, with BF16 Adam moments (4 B per
    parameter, AdamW's state takes the parameters' dtype) and no main params."""
    e = estimate_memory(model, ParallelLayout(), micro_batch_size=micro_batch_size, seq_length=seq_length, fp8=fp8,
                        optimizer=OptimizerPrecision(grad_reduce_in_fp32=False))
    return (e.weights + e.grads + 4 * e.weights / 2 + e.fp8_weights + e.activations + e.logits) / GIB


@pytest.mark.parametrize("name, bench", [("mixtral_8x7b_4l", "bench_moe_mixtral_h200.json"),
                                         ("qwen3_30b_a3b_4l", "bench_moe_qwen3_h200.json")])
def test_moe_terms_within_five_percent_of_bench_trains_h200_peaks(name, bench):
    """The MoE terms (experts' weights and gradients, their FP8 copies, routed rows, router, dispatch, padding)
    against peaks measured on one H200 by scripts/bench_train.py (docs/benchmarks.md), in that benchmark's optimizer
    set-up; this engine's own peak (DDP buffer, distributed optimizer) is docs/scale.md's check against the engine."""
    measured = json.loads((ROOT / "docs" / "bench" / bench).read_text())
    model = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml"))
    rows = {r["config"]: r for r in measured["rows"]}
    for config in ("bf16", "delayed", "tensorwise", "blockwise", "delayed:raw"):
        estimate = bench_train_estimate(model, config != "bf16", micro_batch_size=measured["mbs"],
                                        seq_length=measured["seq"])
        assert estimate == pytest.approx(rows[config]["peak_mem_gib"], rel=0.05), (config, estimate)
