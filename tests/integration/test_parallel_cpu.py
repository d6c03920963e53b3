"""Multi-rank training on the CPU (gloo) through Megatron-Core's parallel state: tensor parallelism (TP=2) with FP8
recipes, and the loss trajectories of TP=2 and DP=2 runs against the 1-rank run of the same global batch.

test_train_cpu.py already checks 2-rank *data* parallelism for bit-identical replicas, scales and amax histories;
test_model_cpu.py checks a TP=2 model forward/backward. Here: whole TP=2 runs of scripts/train.py, and equal losses
across parallel layouts.

What ``recipe.amax_reduction`` means under TP=2, DP=1 (emulated backend; backends/groups.py):

* ``data_tensor`` (the default) MAX-reduces over Megatron's amax reduction group, the data x tensor (x context)
  parallel ranks of one pipeline stage: what Megatron-LM hands TE (``get_amax_reduction_group(
  with_context_parallel=True)``). Every rank of every replica gets the same scales for every tensor. With DP=1 the
  group is the TP group, so the run equals the ``tensor`` one bit for bit (a MAX is exact in any order);
  test_train_cpu.py's DP=2 run covers the data-parallel half with this default.
* ``data`` reduces over Megatron's data-parallel group, which has one rank here: nothing is reduced, and each TP
  rank scales from what *it* sees. Replicated operands agree anyway (the input of a column-parallel layer, the
  output gradient of a row-parallel layer, the replicated LM-head input); sharded ones do not: a column-parallel
  layer's weight shard (rows of W), a row-parallel layer's input and weight shards have per-shard amaxes, so per-
  shard scales. Each shard's GEMM is local and dequantized before Megatron's all-reduce, so that is numerically
  valid (finer-grained scaling), just not what TE/Megatron do.
* ``tensor`` MAX-reduces over the TP group only (Megatron-LM's ``--tp-only-amax-red``): with TP and DP both > 1
  it keeps scales equal within a model replica but not across replicas (activation and gradient scales, from
  different data); ``data`` the converse.

Scales differing across TP ranks are a change of rounding only, so FP8 runs of different layouts agree with the
1-rank run more loosely than BF16 runs (see LOSS_TOL).

Every run here trains on the same global batches, as every run does (training/run.py: one global stream of
micro-batches dealt out round robin to the data-parallel ranks, megatron/data.py:data_parallel_batches), so
1 rank x 2 accumulated micro-batches, DP=2 x 1 and TP=2 x 2 train on the same 4 sequences per step.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train_cpu import assert_learns, dataset  # noqa: E402,F401  (dataset: the shared session fixture)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8

# Test-only driver, one interpreter per rank (interpreter start-up, ~8 s of CPU, dwarfs an 8-step run): runs
# scripts/train.py (its Hydra main, as `python scripts/train.py ARGS` would) once per run listed in argv[1]; each run
# sets up and tears down the process group and Megatron's parallel state. Hooks around it: each optimizer step's
# loss and the final scales, per rank.
DRIVER = r'''
import inspect, json, os, runpy, sys
from fp8_recipes.training import engine as engine_module, loop

_train, _train_step = loop.train, engine_module.Engine.train_step
_losses, _dump = [], {}


def _step(self, *args, **kwargs):
    out = _train_step(self, *args, **kwargs)
    _losses.append(out.loss)
    return out


def train(*args, **kwargs):
    bound = inspect.signature(_train).bind(*args, **kwargs).arguments
    summary = _train(**bound)
    precision = bound["precision"]
    from megatron.core import parallel_state as ps
    states = getattr(getattr(precision, "inner", precision), "states", {})
    _dump.update(rank=bound["rank"], tp_rank=ps.get_tensor_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
                 pp_rank=ps.get_pipeline_model_parallel_rank(), losses=list(_losses),
                 scales=precision.scales() if hasattr(precision, "scales") else {},
                 fp8_modules={n: s.plan.any_fp8 for n, s in states.items()},
                 recompute=bound["engine"].config.recompute_granularity)
    return summary


loop.train, engine_module.Engine.train_step = train, _step
for name, dump_dir, args, port in json.loads(open(sys.argv[1]).read()):
    _losses.clear()
    _dump.clear()
    if port:  # one rendezvous per run: the runs of a chain set up and tear down their own process group
        os.environ["MASTER_PORT"] = str(port)
    sys.argv = ["scripts/train.py", *args]
    try:
        runpy.run_path("scripts/train.py", run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    with open(os.path.join(dump_dir, f"rank{_dump['rank']}.json"), "w") as f:
        json.dump(_dump, f)
'''

# Loss agreement with the 1-rank run, per step, relative. BF16 recipe (FP32 master weights, BF16 GEMMs): the layouts
# differ only in summation order (TP: partial GEMM sums all-reduced; DP: gradients all-reduced instead of
# accumulated), a few BF16 roundings that compound slowly: observed DP=2 bit-identical, TP=2 <= 7e-5 over 8 steps;
# 1e-3 leaves >10x headroom and still catches a wrong batch or a missed reduction (steps move the loss by ~5%).
# FP8 (E4M3, 3 mantissa bits): per-shard or TP-reduced scales move elements' rounding by up to half an E4M3 ulp
# (~6%), averaging out over thousands of elements per GEMM: observed <= 6e-4 (delayed and tensorwise); 1e-2.
LOSS_TOL = {"bf16": 1e-3, "delayed": 1e-2, "tensorwise": 1e-2, "safe": 1e-2}

PP2 = ["trainer.pipeline_model_parallel_size=2"]
FOUR_LAYERS = ["model.num_layers=4"]
SAFE_NOW = ["++recipe.schedule.bf16_warmup_steps=0", "++recipe.schedule.enable={weights:0,activations:0,gradients:0}"]
DISTOPT = ["trainer.use_distributed_optimizer=true", "trainer.overlap_grad_reduce=true",
           "trainer.overlap_param_gather=true"]


RUNS = {  # name: (recipe, processes, TP, extra overrides)
    "bf16-1": ("bf16", 1, 1, []),
    "delayed-1": ("delayed", 1, 1, ["++recipe.amax_reduction=tensor", "++debug.interval=4"]),
    "tensorwise-1": ("tensorwise", 1, 1, []),
    "bf16-dp2": ("bf16", 2, 1, []),
    "bf16-tp2": ("bf16", 2, 2, []),
    # with statistics (merged over the TP ranks: test_statistics_merge_the_tensor_parallel_shards); the
    # data_tensor run below, without them, must still train bit for bit like it
    "delayed-tp2-tensor": ("delayed", 2, 2, ["++recipe.amax_reduction=tensor", "++debug.interval=4"]),
    "delayed-tp2-data": ("delayed", 2, 2, ["++recipe.amax_reduction=data"]),
    # the default amax_reduction, Megatron-Core's amax reduction group; its TP=2 checkpoint, made old to refuse at TP=1
    "delayed-tp2-data_tensor": ("delayed", 2, 2, ["trainer.save_checkpoints=true"]),
    "tensorwise-tp2-data": ("tensorwise", 2, 2, ["++recipe.amax_reduction=data"]),
    # Megatron-Core's engine past one model replica (4 layers, so each of 2 stages / 4 chunks holds some)
    "bf16-4l-1": ("bf16", 1, 1, FOUR_LAYERS),
    "bf16-4l-recompute-full": ("bf16", 1, 1, [*FOUR_LAYERS, "trainer.recompute_granularity=full",
                                              "trainer.recompute_method=uniform", "trainer.recompute_num_layers=1"]),
    "bf16-4l-recompute-selective": ("bf16", 1, 1, [*FOUR_LAYERS, "trainer.recompute_granularity=selective"]),
    "bf16-pp2": ("bf16", 2, 1, [*FOUR_LAYERS, *PP2]),
    "bf16-vpp2": ("bf16", 2, 1, [*FOUR_LAYERS, *PP2, "trainer.virtual_pipeline_model_parallel_size=2"]),
    "bf16-tp2-pp2": ("bf16", 4, 2, [*FOUR_LAYERS, *PP2]),
    "safe-4l-1": ("safe", 1, 1, [*FOUR_LAYERS, *SAFE_NOW]),
    "safe-pp2": ("safe", 2, 1, [*FOUR_LAYERS, *PP2, *SAFE_NOW]),
    "delayed-pp2-stats": ("delayed", 2, 1, [*FOUR_LAYERS, *PP2, "++debug.interval=4"]),
    # the distributed optimizer with overlapped reduce and gather; its checkpoint: resumed at DP=1 below
    "delayed-dp2-distopt": ("delayed", 2, 1, [*DISTOPT, "trainer.save_checkpoints=true"]),
}


def _args(recipe: str, tp: int, extra: list[str], dataset: list[str], run_dir: Path) -> list[str]:
    # vocab 512: padded to a multiple of 128 x TP, so TP=1 and TP=2 build the same embedding (and the same init)
    return [f"+recipe={recipe}", *dataset, f"trainer.max_steps={STEPS}", "trainer.warmup_steps=2",
            "trainer.eval_interval=0", "trainer.eval_iters=1", "trainer.micro_batch_size=2",
            "trainer.global_batch_size=4", "trainer.save_checkpoints=false", "model.num_layers=2",
            "model.vocab_size=512", f"trainer.tensor_model_parallel_size={tp}", f"run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dataset, free_port) -> dict[str, dict]:
    """Every run above, all at once: the 1-rank ones one after another in one interpreter; each 2-rank one as two
    processes with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT; test_train_cpu.py covers torchrun
    itself: its launcher would cost another interpreter per run, and a process group cannot be set up twice in one
    torchrun worker). {name: {"ranks": [per-rank dumps], "run_dir": ...}}."""
    tmp = tmp_path_factory.mktemp("parallel")
    (tmp / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "OMP_NUM_THREADS", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")}
    env["OMP_NUM_THREADS"] = "1"

    def spawn(spec_file: Path, specs: list, rank_env: dict | None = None) -> subprocess.Popen:
        """The driver on ``specs``; its output to files beside the spec (a chain's ranks print for minutes: pipes
        read one process at a time would fill and stall the other rank of a collective)."""
        spec_file.write_text(json.dumps(specs))
        with open(spec_file.with_suffix(".out"), "w") as out, open(spec_file.with_suffix(".err"), "w") as err:
            proc = subprocess.Popen([sys.executable, str(tmp / "driver.py"), str(spec_file)], cwd=ROOT,
                                    env={**env, **(rank_env or {})}, text=True, stdout=out, stderr=err)
        proc.err_file = spec_file.with_suffix(".err")
        return proc

    # Interpreter start-up dwarfs a run: the 2-rank runs share two chains of 2 interpreters (each chain's ranks run
    # its runs one after another), a 4-rank run has its own 4, the 1-rank runs one interpreter.
    chains: list[tuple[str, int, list]] = [("2-rank chain a", 2, []), ("2-rank chain b", 2, [])]
    single: list = []
    for name, (recipe, n, tp, extra) in RUNS.items():
        (tmp / name / "dump").mkdir(parents=True)
        spec = [name, str(tmp / name / "dump"), _args(recipe, tp, extra, dataset, tmp / name / "run"),
                free_port() if n > 1 else 0]
        if n == 1:
            single.append(spec)
        elif n == 2:
            min(chains[:2], key=lambda c: len(c[2]))[2].append(spec)
        else:
            chains.append((name, n, [spec]))
    procs = [("1-rank runs", spawn(tmp / "single.json", single))]
    for what, n, specs in chains:
        for r in range(n):
            procs.append((f"{what} rank {r}", spawn(tmp / f"{what.replace(' ', '-')}-spec{r}.json", specs, dict(
                RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(specs[0][3])))))
    try:
        for what, p in procs:
            p.wait(timeout=900)
            stderr = p.err_file.read_text()
            assert p.returncode == 0, f"{what}: {stderr[-4000:]}"
            assert "Traceback" not in stderr and "error:" not in stderr, f"{what}: {stderr[-4000:]}"
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
    return {name: {"ranks": [json.loads((tmp / name / "dump" / f"rank{r}.json").read_text()) for r in range(n)],
                   "run_dir": tmp / name / "run"} for name, (_, n, _, _) in RUNS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["delayed-tp2-tensor", "delayed-tp2-data", "delayed-tp2-data_tensor",
                                  "tensorwise-tp2-data"])
def test_tensor_parallel_fp8(name, runs):
    r0, r1 = runs[name]["ranks"]
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1) and r0["dp_rank"] == r1["dp_rank"] == 0
    assert len(r0["losses"]) == STEPS
    assert_learns(r0["losses"])
    assert r0["losses"] == r1["losses"]  # the vocab-parallel loss is all-reduced over TP: bit-identical
    summary = json.loads((runs[name]["run_dir"] / "summary.json").read_text())
    assert summary["final_stage"] == "fp8 w+a+g" and summary["skipped_steps"] == 0
    s0, s1 = r0["scales"], r1["scales"]
    if name.startswith("tensorwise"):  # current scaling: no scale state to compare (a scale per GEMM operand)
        assert s0 == s1 == {n: {} for n in s0}
        return
    assert set(s0) == set(s1) and len(s0) == 2 * 4 + 1
    fp8 = [s for n, per in s0.items() if n != "output_layer" for s in per.values()]
    assert fp8 and all(s != 1.0 for s in fp8)
    if name.endswith("tensor"):  # amaxes MAX-reduced over the TP group (DP x TP: the same ranks here)
        assert s0 == s1  # one set of scales on both ranks
        if name.endswith("data_tensor"):  # ...and the very run of amax_reduction=tensor, bit for bit
            tensor = runs["delayed-tp2-tensor"]["ranks"][0]
            assert s0 == tensor["scales"] and r0["losses"] == tensor["losses"]
        return
    # amax_reduction=data with DP=1: a group of one, nothing reduced. Replicated operands still agree exactly...
    for n in s0:
        kind = n.rsplit(".", 1)[-1]
        if kind in ("linear_qkv", "linear_fc1"):  # column-parallel: the input is replicated, W is split by rows
            assert s0[n]["activations"] == s1[n]["activations"], n
        if kind in ("linear_proj", "linear_fc2"):  # row-parallel: the output gradient is replicated
            assert s0[n]["gradients"] == s1[n]["gradients"], n
    assert s0["output_layer"] == s1["output_layer"]
    # ...sharded weights do not: each TP rank scales its own shard (per-shard scales, unlike TE/Megatron)
    weights = [n for n in s0 if n != "output_layer"]
    assert any(s0[n]["weights"] != s1[n]["weights"] for n in weights)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name,reference", [("bf16-dp2", "bf16-1"), ("bf16-tp2", "bf16-1"),
                                            ("delayed-tp2-tensor", "delayed-1"), ("delayed-tp2-data", "delayed-1"),
                                            ("delayed-tp2-data_tensor", "delayed-1"),
                                            ("tensorwise-tp2-data", "tensorwise-1"),
                                            ("bf16-pp2", "bf16-4l-1"), ("bf16-vpp2", "bf16-4l-1"),
                                            ("bf16-tp2-pp2", "bf16-4l-1"), ("safe-pp2", "safe-4l-1"),
                                            ("bf16-4l-recompute-full", "bf16-4l-1"),
                                            ("bf16-4l-recompute-selective", "bf16-4l-1"),
                                            ("delayed-dp2-distopt", "delayed-1")])
def test_loss_matches_one_rank(name, reference, runs):
    ref = runs[reference]["ranks"][0]["losses"]
    assert len(ref) == STEPS and all(math.isfinite(x) for x in ref)
    for dump in runs[name]["ranks"]:
        assert _rel(dump["losses"], ref) < LOSS_TOL[RUNS[name][0]], (dump["losses"], ref)
    # metrics.jsonl (rank 0) holds the same losses
    rows = [json.loads(line) for line in (runs[name]["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows if r.get("kind") == "train"] == runs[name]["ranks"][0]["losses"]


@pytest.mark.slow
def test_resume_refuses_another_tensor_parallel_size_of_an_old_checkpoint(runs, dataset, tmp_path):
    """A checkpoint holds one payload per TP rank (its shards). One written before checkpoints recorded their
    optimizer index (no ``reshardable`` in meta.json) cannot be resharded: resuming it at TP=1 ends in one line,
    exit 2, before any process group or model is built (training/checkpoint.py:resume_skip). Resharding itself:
    test_reshard_cpu.py."""
    import shutil

    import torch

    from fp8_recipes.training.checkpoint import read_checkpoint

    saved = runs["delayed-tp2-data_tensor"]["run_dir"] / "checkpoints" / f"step_{STEPS}"
    shards = [read_checkpoint(saved, tp_rank)["model"][0] for tp_rank in (0, 1)]
    qkv = [name for name in shards[0] if name.endswith("linear_qkv.weight")]
    assert qkv and not any(torch.equal(shards[0][name], shards[1][name]) for name in qkv)  # each rank its own shard
    meta = json.loads((saved / "meta.json").read_text())
    assert (meta["tensor_model_parallel_size"], meta["data_parallel_size"], meta["reshardable"]) == (2, 1, True)
    step_dir = tmp_path / "old" / "checkpoints" / f"step_{STEPS}"
    shutil.copytree(saved, step_dir)
    del meta["reshardable"]
    (step_dir / "meta.json").write_text(json.dumps(meta))
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")}
    proc = subprocess.run([sys.executable, "scripts/train.py",
                           *_args("delayed", 1, [f"trainer.resume={step_dir}"], dataset, run_dir)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        f"error: trainer.tensor_model_parallel_size: 1 differs from the checkpoint's 2 ({step_dir} was written before "
        f"checkpoints could be resharded; resume with trainer.tensor_model_parallel_size=2)"]
    assert not run_dir.exists()


@pytest.mark.slow
def test_pipeline_stages_hold_their_layers_and_the_plan_spans_them(runs):
    """PP=2: stage 0 holds layers 0-1 (and the embedding), stage 1 layers 2-3 and the LM head, under their global
    names; `safe` keeps layer 0 BF16 on stage 0 and layer 3 and the LM head BF16 on stage 1, layers 1 and 2 FP8.
    Interleaved (VPP=2): stage 0 holds layers 0 and 2, stage 1 layers 1 and 3 (Megatron-Core's chunk offsets)."""
    def layers(dump):
        return sorted({int(n.split(".")[2]) for n in dump["fp8_modules"] if n.startswith("decoder.layers.")})

    stage0, stage1 = sorted(runs["safe-pp2"]["ranks"], key=lambda d: d["pp_rank"])
    assert (stage0["pp_rank"], stage1["pp_rank"]) == (0, 1)
    assert layers(stage0) == [0, 1] and layers(stage1) == [2, 3]
    assert "output_layer" in stage1["fp8_modules"] and "output_layer" not in stage0["fp8_modules"]
    fp8 = {**stage0["fp8_modules"], **stage1["fp8_modules"]}
    for name, on in fp8.items():
        layer = int(name.split(".")[2]) if name.startswith("decoder.layers.") else None
        assert on == (layer in (1, 2)), name  # bf16_first: 1 on stage 0, bf16_last: 1 and the head on stage 1
    assert stage0["losses"] == stage1["losses"]  # the last stage's loss, on every rank
    v0, v1 = sorted(runs["bf16-vpp2"]["ranks"], key=lambda d: d["pp_rank"])
    assert layers(v0) == [0, 2] and layers(v1) == [1, 3]
    summary = json.loads((runs["safe-pp2"]["run_dir"] / "summary.json").read_text())
    assert summary["final_stage"] == "fp8 w+a+g"
    plan = (runs["safe-pp2"]["run_dir"] / "plan.txt").read_text()
    assert "bf16_first: 1" in plan and "bf16_last: 1" in plan
    assert "  stage 0          layers 0-1      0 bf16, 1 emulated  + embedding" in plan
    assert "  stage 1          layers 2-3      2 emulated, 3 bf16  + LM head bf16" in plan


@pytest.mark.slow
def test_four_ranks_tensor_and_pipeline_parallel(runs):
    """TP=2 x PP=2 on 4 ranks: each (stage, TP rank) once, every rank reports the same losses."""
    dumps = runs["bf16-tp2-pp2"]["ranks"]
    assert sorted((d["pp_rank"], d["tp_rank"]) for d in dumps) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(d["losses"] == dumps[0]["losses"] for d in dumps)


@pytest.mark.slow
def test_distributed_optimizer_shards_and_resumes_at_one_rank(runs, dataset, tmp_path):  # noqa: F811
    """DP=2 with the distributed optimizer (overlapped reduce and gather): replicas keep one set of delayed scales
    (the default amax_reduction, data x tensor);
    its checkpoint holds the whole optimizer state (gathered onto DP rank 0) and resumes at DP=1, where the first
    resumed step's loss equals the loss a DP=2 continuation reports up to summation order."""
    from fp8_recipes.training.checkpoint import read_checkpoint

    r0, r1 = runs["delayed-dp2-distopt"]["ranks"]
    assert r0["scales"] == r1["scales"] and r0["losses"] == r1["losses"]
    step_dir = runs["delayed-dp2-distopt"]["run_dir"] / "checkpoints" / f"step_{STEPS}"
    meta = json.loads((step_dir / "meta.json").read_text())
    assert meta["data_parallel_size"] == 2 and meta["use_distributed_optimizer"] is True
    optimizer = read_checkpoint(step_dir)["optimizer"]
    assert optimizer["distributed"] is True and optimizer["param_state"][0] is not None
    run_dir = tmp_path / "resumed"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")}
    args = _args("delayed", 1, [*DISTOPT, f"trainer.resume={step_dir}", f"trainer.max_steps={STEPS + 2}"], dataset,
                 run_dir)
    proc = subprocess.run([sys.executable, "scripts/train.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("kind") == "train"]
    assert [r["step"] for r in rows if r.get("kind") == "train"] == [STEPS + 1, STEPS + 2]
    assert all(math.isfinite(x) for x in losses) and losses[0] < r0["losses"][0]  # trained weights, not fresh ones
    # the plain optimizer cannot read it: refused in one line, before anything is built
    refused = subprocess.run([sys.executable, "scripts/train.py", *_args(
        "delayed", 1, [f"trainer.resume={step_dir}"], dataset, tmp_path / "refused")], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert [line for line in refused.stderr.splitlines() if line.strip()] == [
        f"error: trainer.use_distributed_optimizer: false differs from the checkpoint's true ({step_dir}; resume "
        f"with trainer.use_distributed_optimizer=true)"]


@pytest.mark.slow
def test_activation_recompute_reaches_megatron_core(runs):
    """trainer.recompute_* become TransformerConfig's: the runs above train the same losses as without (recompute
    repeats the forward in the backward; it changes memory, not numerics)."""
    assert runs["bf16-4l-recompute-full"]["ranks"][0]["recompute"] == "full"
    assert runs["bf16-4l-recompute-selective"]["ranks"][0]["recompute"] == "selective"
    assert runs["bf16-4l-1"]["ranks"][0]["recompute"] is None


@pytest.mark.slow
def test_statistics_per_pipeline_stage(runs):
    """Each stage's first rank writes its own modules' statistics: stage 0 to numerics.jsonl, stage 1 to
    numerics.stage1.jsonl; read_numerics (and the doctor) read them as one."""
    from fp8_recipes.rundir import read_numerics

    run_dir = runs["delayed-pp2-stats"]["run_dir"]
    def modules(path):
        return {json.loads(line)["module"] for line in path.read_text().splitlines()}

    stage0, stage1 = modules(run_dir / "numerics.jsonl"), modules(run_dir / "numerics.stage1.jsonl")
    assert {m.split(".")[2] for m in stage0 if m.startswith("decoder.")} == {"0", "1"}
    assert {m.split(".")[2] for m in stage1 if m.startswith("decoder.")} == {"2", "3"}
    assert "output_layer" not in stage0 and not stage0 & stage1
    rows = read_numerics(run_dir)
    assert len({r["step"] for r in rows}) == 2 and {r["module"] for r in rows} == stage0 | stage1
    assert (run_dir / "numerics_underflow.png").is_file() and (run_dir / "numerics_underflow.stage1.png").is_file()


@pytest.mark.slow
def test_statistics_merge_the_tensor_parallel_shards(runs):
    """At TP=2 each rank holds half of every weight, of a row-parallel linear's input and of a column-parallel
    one's output gradient: rank 0 writes rows merged from both ranks, which describe the whole tensors the 1-rank
    run measures (the same elements counted; amax and underflow as close as the two runs' weights are)."""
    def rows(name):
        return {(r["step"], r["module"], r["gemm"], r["role"]): r for r in map(
            json.loads, (runs[name]["run_dir"] / "numerics.jsonl").read_text().splitlines())}

    one, two = rows("delayed-1"), rows("delayed-tp2-tensor")
    assert set(one) == set(two) and len({k[0] for k in one}) == 2, sorted(set(one) ^ set(two))[:4]
    first = min(k[0] for k in one)  # before any update: the same weights in both runs
    weights = 0
    for key, ref in one.items():
        got = two[key]
        assert got["numel"] == ref["numel"], (key, got["numel"], ref["numel"])  # unmerged: half for split operands
        assert got["cosine"] == pytest.approx(ref["cosine"], abs=1e-3), key
        assert got["underflow_pct"] == pytest.approx(ref["underflow_pct"], abs=1.0), key
        if key[0] == first and key[3] == "weights":  # both halves of each weight, element for element
            weights += 1
            assert all(got[k] == ref[k] for k in ("amax", "min_nonzero", "underflow_pct", "saturation_pct")), key
    assert weights == 2 * 4 * 2  # 2 layers x 4 linears x 2 GEMMs reading the weights (fprop, dgrad)
