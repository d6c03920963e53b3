"""The recorder under tensor and context parallelism (observe/recorder.py: ShardGroups): which operands are split over
which ranks, their statistics merged into those of the whole tensor, and what happens when ranks disagree or a run
fails. The ranks are simulated (a fake all_gather_object); tests/integration/test_parallel_cpu.py runs two."""

from __future__ import annotations

import pytest
import torch

from fp8_recipes.numerics import fake_quant
from fp8_recipes.observe.config import DebugConfig
from fp8_recipes.observe.recorder import NumericsRecorder, ShardGroups
from fp8_recipes.observe.stats import measure, rows
from fp8_recipes.recipe.schema import Scaling, TensorPolicy

TP, CP = "tp-group", "cp-group"
QKV, PROJ, FC1, FC2 = (f"decoder.layers.0.{m}" for m in ("self_attention.linear_qkv", "self_attention.linear_proj",
                                                          "mlp.linear_fc1", "mlp.linear_fc2"))
HEAD = "output_layer"


def test_which_operands_are_split_over_which_ranks():
    """Weights: every TP shard. Without SP, a row-parallel linear's input (features) and a column-parallel one's
    output gradient (features); the rest is the same tensor on every TP rank. With SP everything is split over TP.
    CP splits activations and gradients (tokens), never weights."""
    plain, sp, cp = ShardGroups(tensor=TP), ShardGroups(tensor=TP, sequence_parallel=True), ShardGroups(context=CP)
    for module in (QKV, FC1, HEAD):  # column-parallel
        assert [plain.groups(module, r) for r in ("weights", "activations", "gradients")] == [(TP,), (), (TP,)]
    for module in (PROJ, FC2):  # row-parallel
        assert [plain.groups(module, r) for r in ("weights", "activations", "gradients")] == [(TP,), (TP,), ()]
    assert all(sp.groups(m, r) == (TP,) for m in (QKV, PROJ, FC1, FC2, HEAD)
               for r in ("weights", "activations", "gradients"))
    assert [cp.groups(QKV, r) for r in ("weights", "activations", "gradients")] == [(), (CP,), (CP,)]
    assert ShardGroups(tensor=TP, context=CP).groups(FC2, "activations") == (TP, CP)  # tensor-parallel first
    assert ShardGroups().groups(QKV, "weights") == ()


def _recorder(tmp_path, shards):
    rec = NumericsRecorder(DebugConfig.from_dict({"interval": 1}), tmp_path, tensorboard=False, shards=shards)
    rec.step = 1
    return rec


def _stats(x, policy):
    return measure(x, fake_quant(x, policy).float(), policy)


@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise"])
def test_split_operands_merge_into_the_whole_tensors_statistics(scaling, tmp_path, monkeypatch):
    """Two TP ranks, each with half of a weight (rows) and the same column-parallel input: the written weight row is
    the whole weight's statistics (counts and extremes exact, sums up to order); the replicated input is rank 0's."""
    import torch.distributed as dist

    policy = TensorPolicy(scaling=Scaling(scaling))
    torch.manual_seed(0)
    weight, act = torch.randn(256, 128), torch.randn(64, 128)
    weight[200, 5] = 40.0  # the whole weight's amax lives in rank 1's half
    halves = weight.split(128)
    key_w, key_a = (QKV, "fprop", "weights"), (QKV, "fprop", "activations")
    ranks = []
    for r in range(2):
        rec = _recorder(tmp_path / f"rank{r}", ShardGroups(tensor=TP))
        rec._pending = {key_w: _stats(halves[r], policy), key_a: _stats(act, policy)}
        ranks.append(rec)
    # rank 1's part of the gather, as rank 1 would send it (its split operands, in its order)
    sent = {}

    def fake_all_gather(out, obj, group=None):
        assert group == TP
        sent[len(sent) % 2] = obj
        out[:] = [obj, theirs]

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", fake_all_gather)
    theirs = ([key_w], [ranks[1]._pending[key_w]])
    pending = dict(ranks[0]._pending)
    ranks[0]._merge_shards(pending)
    assert sent[0][0] == [key_w]  # only the split operand travels
    got, whole = rows([pending[key_w]])[0], _stats(weight, policy).row()
    if scaling == "blockwise":  # per-block scales: the same blocks either way (tensorwise: each shard is scaled by
        for k in ("mse", "cosine"):  # its own amax, as TE's current scaling without SP, so the errors differ)
            assert got[k] == pytest.approx(whole[k], rel=1e-6), k
        assert got["underflow_pct"] == whole["underflow_pct"]
    for k in ("numel", "amax", "min_nonzero"):
        assert got[k] == whole[k], k
    assert pending[key_a] is ranks[0]._pending[key_a]  # the replicated input: rank 0's own, not gathered


def test_ranks_that_observed_different_operands_fail_loudly(tmp_path, monkeypatch):
    import torch.distributed as dist

    policy = TensorPolicy(scaling=Scaling.TENSORWISE)
    rec = _recorder(tmp_path, ShardGroups(tensor=TP))
    rec._pending = {(QKV, "fprop", "weights"): _stats(torch.randn(16, 16), policy)}
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [obj, ([(FC1, "fprop", "weights")],
                                                                                          obj[1])]))
    with pytest.raises(RuntimeError, match=r"^numerics: step 1: the ranks of a shard group observed different "
                                           r"operands"):
        rec._merge_shards(dict(rec._pending))


def test_a_failed_run_writes_its_unsplit_rows_without_waiting_for_other_ranks(tmp_path, monkeypatch):
    """close(merge=False): the run ended in an error that may be this rank's alone; no collective is entered (its
    peers may never join one), the rows that needed other ranks' parts are dropped, the rest written."""
    import json

    import torch.distributed as dist

    policy = TensorPolicy(scaling=Scaling.TENSORWISE)
    rec = _recorder(tmp_path, ShardGroups(tensor=TP))
    rec._pending = {(QKV, "fprop", "weights"): _stats(torch.randn(16, 16), policy),
                    (QKV, "fprop", "activations"): _stats(torch.randn(16, 16), policy)}
    monkeypatch.setattr(dist, "all_gather_object", lambda *a, **k: pytest.fail("a collective after a failure"))
    rec.close(merge=False)
    written = [json.loads(line) for line in (tmp_path / "numerics.jsonl").read_text().splitlines()]
    assert [(r["module"], r["gemm"], r["role"]) for r in written] == [(QKV, "fprop", "activations")]


E0, E2 = (f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2" for e in (0, 2))
ETP, EP = "etp-group", "ep-group"


def test_routed_experts_follow_the_expert_grid():
    """A routed expert is split over its expert tensor-parallel ranks (weights; fc2's input by features), never by
    sequence parallelism (the dispatcher hands every expert-TP rank the same tokens), and gathered over the expert-
    parallel ranks; a dense module as before."""
    shards = ShardGroups(tensor=TP, sequence_parallel=True, expert_tensor=ETP, experts=EP)
    assert [shards.groups(E0, r) for r in ("weights", "activations", "gradients")] == [(ETP,), (ETP,), ()]
    assert shards.groups(FC2, "gradients") == (TP,) and shards.gathered(FC2) is None
    assert shards.gathered(E0) == EP and ShardGroups().gathered(E0) is None


def test_expert_parallel_ranks_gather_each_others_experts(tmp_path, monkeypatch):
    """EP=2: rank 0 holds expert 0, rank 1 expert 2; after the expert tensor-parallel merge (an expert without a
    token on one rank: folded from the rank that has it), every rank holds both experts' rows, in expert order,
    and the dense rows as they were."""
    import torch.distributed as dist

    policy = TensorPolicy(scaling=Scaling.TENSORWISE)
    torch.manual_seed(0)
    dense, mine, theirs, half = (_stats(torch.randn(16, 16), policy) for _ in range(4))
    rec = _recorder(tmp_path, ShardGroups(expert_tensor=ETP, experts=EP))
    pending = {(FC1, "fprop", "activations"): dense, (E0, "fprop", "weights"): mine,
               (E0, "fprop", "activations"): mine}
    calls = []

    def fake_all_gather(out, obj, group=None):
        calls.append((group, obj[0]))
        if group == ETP:  # the other expert-TP rank: the other half of E0's weight, and no token for E0 this step
            out[:] = [obj, ([(E0, "fprop", "weights")], [half])]
        else:  # the other EP rank's experts
            out[:] = [obj, ([(E2, "fprop", "weights")], [theirs])]

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", fake_all_gather)
    rec._merge_shards(pending)
    assert [g for g, _ in calls] == [ETP, EP]
    assert list(pending) == [(FC1, "fprop", "activations"), (E0, "fprop", "weights"), (E0, "fprop", "activations"),
                             (E2, "fprop", "weights")]
    assert rows([pending[(E0, "fprop", "weights")]])[0]["numel"] == 2 * 256  # both expert-TP halves
    assert rows([pending[(E2, "fprop", "weights")]])[0] == rows([theirs])[0]
