"""Expert parallelism on the CPU (issue 28 item 2): tiny_moe trained by scripts/train.py on gloo ranks with
``trainer.expert_model_parallel_size``, against the same model at EP=1.

EP is carved out of the data-parallel ranks, as in Megatron-LM: at EP=2 on 2 ranks each rank reads its own
micro-batches (data parallel 2 for the dense modules) and holds half of every MoE layer's experts (expert data
parallel 1); Megatron-Core's allgather dispatcher hands each expert the tokens of both ranks. So EP=2 trains on the
batches EP=1 x DP=2 trains on, from the same weights (megatron/model.py draws every expert as at EP=1), and the
step-1 losses are equal bit for bit. After it they differ by summation order only: an expert's weight gradient is
one GEMM over both ranks' tokens at EP=2, two halves all-reduced at DP=2 (observed <= 1.7e-4 relative over 6 steps
in bf16, delayed and blockwise; LOSS_TOL 1e-3 leaves 5x headroom and still catches a dropped expert or a wrong
reduction, which move the loss by percents).

Delayed amaxes of an expert's GEMMs are reduced over the ranks that hold that expert (backends/groups.py): at EP=1
x DP=2 both ranks hold every expert and end with one set of scales; at EP=2 x expert DP=2 (4 ranks) ranks 0 and 2
hold experts 0-1, ranks 1 and 3 experts 2-3, and each pair agrees. EP with pipeline parallelism needs 4 ranks too
(EP=2 x PP=2): one 4-step run beside the EP=2 x expert DP=2 one (each ~30 s on 2 shared cores), against PP=2 at EP=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_parallel_cpu import DRIVER  # noqa: E402  (one interpreter per rank runs a chain of scripts/train.py runs)
from test_train_cpu import assert_learns, dataset  # noqa: E402,F401  (dataset: the shared session fixture)

ROOT = Path(__file__).resolve().parents[2]
STEPS, SAVED = 4, 2
LOSS_TOL = 1e-3
EP2 = ["trainer.expert_model_parallel_size=2"]
DISTOPT = ["trainer.use_distributed_optimizer=true"]
PP2 = ["trainer.pipeline_model_parallel_size=2", "model.num_layers=4"]  # MoE layers 0 and 2: one on each stage
# EP=2 x PP=2 (dense DP=2) against PP=2 alone (DP=1, 2 micro-batches accumulated): the same samples per step, FP8 amaxes
# MAX-reduced over the DP ranks instead of taken over both micro-batches, gradients all-reduced instead of summed;
# test_parallel_cpu.py's FP8 tolerance for layouts (observed 6.7e-4 over 4 steps, step 1 bit for bit)
PP_LOSS_TOL = 1e-2

STATS = ["++debug.interval=2"]  # numerics statistics at steps 1 and 3 (they never change the numerics)
RUNS = {  # name: (recipe, processes, extra overrides); each chain runs its runs in this order
    "delayed-ep2": ("delayed", 2, [*EP2, *DISTOPT, f"trainer.save_interval={SAVED}", "trainer.save_checkpoints=true",
                                   *STATS]),
    "delayed-dp2": ("delayed", 2, [*DISTOPT, *STATS, f"trainer.save_interval={SAVED}", "trainer.save_checkpoints=true"]),
    "blockwise-ep2": ("blockwise", 2, [*EP2, f"trainer.save_interval={SAVED}", "trainer.save_checkpoints=true"]),
    "blockwise-dp2": ("blockwise", 2, []),
    "delayed-pp2": ("delayed", 2, [*PP2]),
    "delayed-etp2": ("delayed", 2, ["trainer.expert_tensor_parallel_size=2", f"trainer.save_interval={SAVED}",
                                    "trainer.save_checkpoints=true", *STATS]),
    "delayed-ep2-edp2": ("delayed", 4, [*EP2, "trainer.global_batch_size=8"]),
    # (the autopilot on: it records the statistics, gathers every rank's rows, and takes no action in 4 steps)
    "delayed-ep2-pp2": ("delayed", 4, [*EP2, *PP2, f"trainer.save_interval={SAVED}", "trainer.save_checkpoints=true",
                                       "autopilot=on", "++autopilot.interval=2"]),
}
RESUMED = "delayed-ep2-resumed"  # delayed-ep2's step-2 checkpoint continued to step 4, after it in its chain
# step-2 checkpoints continued at another EP size (resharded), each after the run that wrote it in its chain:
# {name: (the run whose checkpoint it continues, recipe, overrides)}
RESHARDED = {"delayed-ep2-as-ep1": ("delayed-ep2", "delayed", DISTOPT),
             "delayed-ep1-as-ep2": ("delayed-dp2", "delayed", [*EP2, *DISTOPT]),
             "blockwise-ep2-as-ep1": ("blockwise-ep2", "blockwise", [])}  # (the plain optimizer: a state per rank)


def _args(recipe: str, extra: list[str], dataset: list[str], run_dir: Path) -> list[str]:
    return ["model=tiny_moe", f"+recipe={recipe}", *dataset, f"trainer.max_steps={STEPS}", "trainer.warmup_steps=2",
            "trainer.eval_interval=0", "trainer.eval_iters=1", "trainer.micro_batch_size=2",
            "trainer.global_batch_size=4", "trainer.save_checkpoints=false",
            *([] if "model.num_layers=4" in extra else ["model.num_layers=2"]), "model.vocab_size=512",
            f"run_dir={run_dir}", *extra]


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "OMP_NUM_THREADS", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dataset, free_port) -> dict[str, dict]:  # noqa: F811
    """Every run above: the 2-rank ones in two chains (two interpreters each), the 4-rank one on its own, all at
    once. {name: {"ranks": [per-rank dumps by global rank], "run_dir": ...}}."""
    tmp = tmp_path_factory.mktemp("expert_parallel")
    (tmp / "driver.py").write_text(DRIVER)
    specs = {}
    for name, (recipe, _, extra) in RUNS.items():
        (tmp / name / "dump").mkdir(parents=True)
        specs[name] = [name, str(tmp / name / "dump"), _args(recipe, extra, dataset, tmp / name / "run"), free_port()]
    for name, (source, recipe, extra) in {RESUMED: ("delayed-ep2", "delayed", [*EP2, *DISTOPT]), **RESHARDED}.items():
        (tmp / name / "dump").mkdir(parents=True)
        saved = tmp / source / "run" / "checkpoints" / f"step_{SAVED}"
        resumed = _args(recipe, [*extra, f"trainer.resume={saved}"], dataset, tmp / name / "run")
        specs[name] = [name, str(tmp / name / "dump"), resumed, free_port()]
    chains = [(2, [specs[n] for n in ("delayed-ep2", RESUMED, "delayed-ep2-as-ep1", "blockwise-ep2",
                                      "blockwise-ep2-as-ep1")]),
              (2, [specs[n] for n in ("delayed-dp2", "delayed-ep1-as-ep2", "blockwise-dp2", "delayed-pp2",
                                      "delayed-etp2")]),
              (4, [specs["delayed-ep2-edp2"], specs["delayed-ep2-pp2"]])]
    procs = []
    for c, (world, chain) in enumerate(chains):
        for r in range(world):
            spec_file = tmp / f"chain{c}-rank{r}.json"
            spec_file.write_text(json.dumps(chain))
            with open(spec_file.with_suffix(".out"), "w") as out, open(spec_file.with_suffix(".err"), "w") as err:
                procs.append((f"chain {c} rank {r}", spec_file.with_suffix(".err"), subprocess.Popen(
                    [sys.executable, str(tmp / "driver.py"), str(spec_file)], cwd=ROOT, text=True, stdout=out,
                    stderr=err, env={**_clean_env(), **_rank_env(r, world, chain[0][3])})))
    try:
        for what, err, p in procs:
            p.wait(timeout=900)
            assert p.returncode == 0, f"{what}: {err.read_text()[-4000:]}"
            assert "Traceback" not in err.read_text(), f"{what}: {err.read_text()[-4000:]}"
    finally:
        for _, _, p in procs:
            if p.poll() is None:
                p.kill()
    worlds = {**{n: w for n, (_, w, _) in RUNS.items()}, RESUMED: 2, **{n: 2 for n in RESHARDED}}
    return {name: {"ranks": sorted((json.loads((tmp / name / "dump" / f"rank{r}.json").read_text())
                                    for r in range(world)), key=lambda d: d["rank"]),
                   "run_dir": tmp / name / "run"} for name, world in worlds.items()}


def _experts(scales: dict) -> set[int]:
    return {int(n.split(".")[6]) for n in scales if ".local_experts." in n}


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_ep2_trains_the_losses_of_ep1_dp2(runs, recipe):
    """Each EP rank holds its half of the experts; the step-1 loss equals EP=1 x DP=2's bit for bit (same weights,
    same batches), the rest within summation order; every rank reports the same losses."""
    ep, dp = runs[f"{recipe}-ep2"]["ranks"], runs[f"{recipe}-dp2"]["ranks"]
    assert [_experts(d["scales"]) for d in ep] == [{0, 1}, {2, 3}]  # (blockwise: names with no delayed scale)
    assert ep[0]["losses"] == ep[1]["losses"] and dp[0]["losses"] == dp[1]["losses"]
    assert len(ep[0]["losses"]) == STEPS
    assert_learns(ep[0]["losses"])
    assert ep[0]["losses"][0] == dp[0]["losses"][0]
    assert _rel(ep[0]["losses"], dp[0]["losses"]) < LOSS_TOL, (ep[0]["losses"], dp[0]["losses"])
    summary = json.loads((runs[f"{recipe}-ep2"]["run_dir"] / "summary.json").read_text())
    assert summary["skipped_steps"] == 0


@pytest.mark.slow
def test_delayed_scales_agree_on_the_ranks_holding_each_expert(runs):
    """Dense modules: one set of scales on every rank. Experts: the same scales on the ranks that hold them (DP=2:
    both; EP=2 x expert DP=2: ranks 0 and 2, ranks 1 and 3), and their own: the dense group, all 4 ranks, would MAX
    each EP rank's first expert with the other's (expert 0's amaxes with expert 2's), giving both the same scales."""
    def dense(scales):
        return {n: s for n, s in scales.items() if ".local_experts." not in n}

    def experts(scales):
        return {n: s for n, s in scales.items() if ".local_experts." in n}

    dp, ep = runs["delayed-dp2"]["ranks"], runs["delayed-ep2"]["ranks"]
    assert dp[0]["scales"] == dp[1]["scales"] and _experts(dp[0]["scales"]) == {0, 1, 2, 3}
    assert dense(ep[0]["scales"]) == dense(ep[1]["scales"])
    four = runs["delayed-ep2-edp2"]["ranks"]
    assert [_experts(d["scales"]) for d in four] == [{0, 1}, {2, 3}, {0, 1}, {2, 3}]
    assert all(dense(d["scales"]) == dense(four[0]["scales"]) for d in four)
    assert experts(four[0]["scales"]) == experts(four[2]["scales"])
    assert experts(four[1]["scales"]) == experts(four[3]["scales"])
    for local, other in ((0, 2), (1, 3)):
        for fc in ("linear_fc1", "linear_fc2"):
            mine, theirs = (four[r]["scales"][f"decoder.layers.0.mlp.experts.local_experts.{e}.{fc}"]
                            for r, e in ((0, local), (1, other)))
            assert mine["weights"] != theirs["weights"], (local, other, fc)  # other experts, other weights
    assert all(d["losses"] == four[0]["losses"] for d in four)
    assert_learns(four[0]["losses"])


@pytest.mark.slow
def test_ep2_checkpoint_holds_every_expert_and_resumes_bit_exactly(runs):
    """One payload per EP rank (``pp00tp00ep00``, ``pp00tp00ep01``: before, DCP kept one ``pp00tp00`` and dropped EP
    rank 1's experts); the expert optimizer state of each is there (each EP rank is its experts' data-parallel rank
    0), the dense one in EP rank 0's. Resumed from step 2, steps 3-4 are the uninterrupted run's bit for bit, and so
    are the final scales of every expert."""
    from fp8_recipes.training.checkpoint import _saved_payloads, read_checkpoint

    step_dir = runs["delayed-ep2"]["run_dir"] / "checkpoints" / f"step_{SAVED}"
    assert sorted(_saved_payloads(step_dir)) == ["pp00tp00ep00", "pp00tp00ep01"]
    meta = json.loads((step_dir / "meta.json").read_text())
    assert (meta["expert_model_parallel_size"], meta["expert_tensor_parallel_size"], meta["data_parallel_size"]) == (
        2, 1, 2)
    payloads = [read_checkpoint(step_dir, ep_rank=e) for e in (0, 1)]
    for e, payload in enumerate(payloads):
        held = {int(n.split(".")[6]) for n in payload["precision"]["scalers"] if ".local_experts." in n}
        assert held == {2 * e, 2 * e + 1}
        dense_state, expert_state = payload["optimizer"]["param_state"]
        assert expert_state is not None and (dense_state is not None) == (e == 0)
    uninterrupted, resumed = runs["delayed-ep2"]["ranks"], runs[RESUMED]["ranks"]
    rows = [json.loads(line) for line in (runs[RESUMED]["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "train"] == list(range(SAVED + 1, STEPS + 1))
    for before, after in zip(uninterrupted, resumed):
        assert after["losses"] == before["losses"][SAVED:]
        assert after["scales"] == before["scales"]


@pytest.mark.slow
def test_routing_rows_cover_every_expert_under_ep(runs):
    """routing.jsonl at EP=2: each EP rank counts its own experts, summed over the EP group: every expert has a
    count, and a row holds the tokens of both ranks' micro-batches (2 x 2 x 128 tokens, each to 2 experts)."""
    from fp8_recipes.rundir import read_jsonl

    rows = read_jsonl(runs["delayed-ep2"]["run_dir"] / "routing.jsonl")
    assert [(r["step"], r["layer"]) for r in rows] == [(s, 0) for s in range(1, STEPS + 1)]
    for r in rows:
        assert len(r["tokens"]) == 4 and sum(r["tokens"]) == 2 * 2 * 128 * 2, r
    assert any(r["tokens"][2] + r["tokens"][3] > 0 for r in rows)  # EP rank 1's experts counted


@pytest.mark.slow
def test_expert_and_pipeline_parallel(runs):
    """EP=2 x PP=2 on 4 ranks: each stage holds its MoE layer (0 on stage 0, 2 on stage 1), each EP rank of a stage
    half of its experts; the losses are PP=2's at EP=1 (step 1 bit for bit); the checkpoint holds a payload per (stage,
    EP rank); routing rows cover every expert of both MoE layers."""
    from fp8_recipes.rundir import read_jsonl
    from fp8_recipes.training.checkpoint import _saved_payloads

    pp = runs["delayed-pp2"]["ranks"]
    assert [d["pp_rank"] for d in pp] == [0, 1] and pp[0]["losses"] == pp[1]["losses"]
    ranks = runs["delayed-ep2-pp2"]["ranks"]
    held = {(d["pp_rank"], frozenset((int(n.split(".")[2]), int(n.split(".")[6])) for n in d["scales"]
                                     if ".local_experts." in n)) for d in ranks}
    halves = [frozenset((layer, e) for e in experts) for layer in (0, 2) for experts in ((0, 1), (2, 3))]
    assert held == {(0, halves[0]), (0, halves[1]), (1, halves[2]), (1, halves[3])}, held
    assert all(d["losses"] == ranks[0]["losses"] for d in ranks)
    assert ranks[0]["losses"][0] == pp[0]["losses"][0]
    assert _rel(ranks[0]["losses"], pp[0]["losses"]) < PP_LOSS_TOL, (ranks[0]["losses"], pp[0]["losses"])
    step_dir = runs["delayed-ep2-pp2"]["run_dir"] / "checkpoints" / f"step_{SAVED}"
    assert sorted(_saved_payloads(step_dir)) == ["pp00tp00ep00", "pp00tp00ep01", "pp01tp00ep00", "pp01tp00ep01"]
    rows = read_jsonl(runs["delayed-ep2-pp2"]["run_dir"] / "routing.jsonl")
    assert sorted((r["step"], r["layer"]) for r in rows) == [(s, layer) for s in range(1, STEPS + 1)
                                                              for layer in (0, 2)]
    assert all(sum(r["tokens"]) == 2 * 2 * 128 * 2 for r in rows), rows


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RESHARDED))
def test_a_checkpoint_resumes_at_another_expert_parallel_size(runs, name):
    """A step-2 checkpoint continued at another EP size (EP=2 -> EP=1 x DP=2 with the distributed and the plain
    optimizer, EP=1 x DP=2 -> EP=2): every expert's weights, optimizer state and delayed scaling state are joined
    from the EP ranks' payloads and cut for the new layout, so step 3 (the forward pass of the weights and scales
    step 2 left, on the same batches) gives the uninterrupted run's loss bit for bit, and step 4 within summation
    order (EP=1 x DP=2 and EP=2 agree so from the start: test_ep2_trains_the_losses_of_ep1_dp2)."""
    source = RESHARDED[name][0]
    before, after = runs[source]["ranks"], runs[name]["ranks"]
    held = [{0, 1, 2, 3}] * 2 if name.endswith("ep1") else [{0, 1}, {2, 3}]
    if not name.startswith("blockwise"):  # (blockwise experts keep no delayed scales to name them)
        assert [_experts(d["scales"]) for d in after] == held
    assert after[0]["losses"] == after[1]["losses"] and len(after[0]["losses"]) == STEPS - SAVED
    assert after[0]["losses"][0] == before[0]["losses"][SAVED], (after[0]["losses"], before[0]["losses"])
    assert _rel(after[0]["losses"], before[0]["losses"][SAVED:]) < LOSS_TOL
    log = (runs[name]["run_dir"] / "train.log").read_text()
    ep = (2, 1) if name.endswith("ep1") else (1, 2)
    assert f"vpp=None ep={ep[0]} to tp=1 pp=1 vpp=None ep={ep[1]}" in log, log[-2000:]


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_is_evaluated_in_one_process(runs, caplog):
    """scripts/eval_checkpoint.py's evaluation of EP=2's step-2 checkpoint in one process (EP=1): the EP ranks'
    experts joined on load, as a resume at EP=1 joins them; FP8 and BF16 losses finite and apart. Under a recipe
    whose layer rules keep both layers BF16 (safe) it says so in one warning (a hostile-input sweep: a +0.000% gap
    without a word)."""
    import math

    from fp8_recipes.training.evaluate import evaluate_checkpoint

    step_dir = runs["delayed-ep2"]["run_dir"] / "checkpoints" / f"step_{SAVED}"
    result = evaluate_checkpoint(runs["delayed-ep2"]["run_dir"], checkpoint=step_dir, eval_iters=2)
    assert result["trained_steps"] == SAVED and math.isfinite(result["fp8_loss"]), result
    assert result["fp8_loss"] != result["bf16_loss"], result
    assert abs(result["fp8_loss"] / runs["delayed-ep2"]["ranks"][0]["losses"][SAVED] - 1) < 0.05, result
    assert not [r for r in caplog.records if "no GEMM of this model runs FP8" in r.getMessage()]
    safe = evaluate_checkpoint(runs["delayed-ep2"]["run_dir"], checkpoint=step_dir, eval_iters=1, recipe="safe")
    assert safe["fp8_loss"] == safe["bf16_loss"], safe
    said = [r.getMessage() for r in caplog.records if "no GEMM of this model runs FP8" in r.getMessage()]
    assert said and said[0].startswith("--recipe safe: no GEMM of this model runs FP8 at the evaluated step"), said


@pytest.mark.slow
def test_resume_at_another_expert_tensor_parallel_size_is_one_line(runs, dataset, tmp_path, free_port):  # noqa: F811
    """Expert TP=2's checkpoint (at TP=1) resumed at expert TP=1: refused before anything is built, exit 2, one
    `error:` line naming trainer.expert_tensor_parallel_size, no traceback on either rank, no run directory."""
    step_dir = runs["delayed-etp2"]["run_dir"] / "checkpoints" / f"step_{SAVED}"
    run_dir = tmp_path / "refused"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "scripts/train.py", *_args("delayed", [
        f"trainer.resume={step_dir}"], dataset, run_dir)], cwd=ROOT, env={**_clean_env(), **_rank_env(
            r, 2, port)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 2 and "Traceback" not in out + err, err[-3000:]
    lines = [line for out, err in outs for line in err.splitlines() if line.strip()]
    assert lines == [f"error: trainer.expert_tensor_parallel_size: 1 differs from the checkpoint's 2 ({step_dir}; "
                     f"experts are resharded only where expert TP equals TP; resume with "
                     f"trainer.expert_tensor_parallel_size=2)"], lines
    assert not run_dir.exists()


@pytest.mark.slow
def test_expert_tensor_parallel(runs):
    """Expert TP=2 at TP=1 (2 ranks: dense DP=2, expert DP=1): each rank holds half of every expert's FFN, so the
    checkpoint keys each payload by its expert TP rank too (``pp00tp00et00``, ``et01``); data_tensor reduces the
    experts' amaxes over expert TP x expert DP (a group Megatron-Core does not build: backends/groups.py), so both
    ranks end with one set of scales; the losses are EP=1 x DP=2's within summation order (the experts' fc2 partial
    sums all-reduced)."""
    from fp8_recipes.training.checkpoint import _saved_payloads

    r0, r1 = runs["delayed-etp2"]["ranks"]
    assert r0["scales"] == r1["scales"] and r0["losses"] == r1["losses"]
    assert _rel(r0["losses"], runs["delayed-dp2"]["ranks"][0]["losses"]) < LOSS_TOL
    step_dir = runs["delayed-etp2"]["run_dir"] / "checkpoints" / f"step_{SAVED}"
    assert sorted(_saved_payloads(step_dir)) == ["pp00tp00et00", "pp00tp00et01"]


@pytest.mark.slow
def test_numerics_rows_cover_every_expert_on_the_expert_grid(runs):
    """Statistics at EP=2, expert TP=2 and EP=2 x PP=2 (the autopilot's): one row per expert, GEMM and role at each
    statistics step, every expert there although each rank holds some (gathered over the EP ranks), each expert
    weight whole (merged over the expert-TP ranks: at step 1 the weights are the initial ones, the same in every
    layout, so their amax and size equal EP=1's exactly); the dense rows as at EP=1."""
    from fp8_recipes.rundir import read_metrics, read_numerics

    def table(name):
        rows = read_numerics(runs[name]["run_dir"])
        keys = [(r["step"], r["module"], r["gemm"], r["role"]) for r in rows]
        assert len(keys) == len(set(keys)), f"{name}: a row written twice"
        return {k: r for k, r in zip(keys, rows)}

    base = table("delayed-dp2")
    expected = {(s, m) for s, m, _, _ in base}
    assert {s for s, _ in expected} == {1, 3}
    assert {int(m.split(".")[6]) for _, m in expected if ".local_experts." in m} == {0, 1, 2, 3}
    for name in ("delayed-ep2", "delayed-etp2"):
        rows = table(name)
        assert {(s, m) for s, m, _, _ in rows} == expected, name
        for key, row in rows.items():
            if key[0] == 1 and key[3] == "weights":
                assert (row["numel"], row["amax"]) == (base[key]["numel"], base[key]["amax"]), (name, key)
    pp = table("delayed-ep2-pp2")
    experts = {(m.split(".")[2], m.split(".")[6]) for _, m, _, _ in pp if ".local_experts." in m}
    assert experts == {(layer, e) for layer in ("0", "2") for e in "0123"}  # both stages' MoE layers, all experts
    assert not [r for r in read_metrics(runs["delayed-ep2-pp2"]["run_dir"]) if r.get("kind") == "autopilot"]
