"""Checkpoints stored through torch.distributed.checkpoint (training/checkpoint.py): a step dir is a DCP dir
(``.metadata`` + ``.distcp`` files); a payload comes back with its exact Python structure (int optimizer-state keys,
empty dicts, tuples, OrderedDict metadata); data-parallel replicas are written once, by DP rank 0; checkpoints of
earlier formats (1: ``tp_RR.pt`` files; 2: ``tpRR`` payloads of the engine before Megatron-Core's) are refused in
one line, also by scripts/train.py (exit 2, before anything runs).

The optimizer state here comes from a stand-in with the engine's state interface (``models``,
``optimizer_state_dict``, ``load_optimizer_state_dict``) around a torch AdamW: what is tested is the storage of an
optimizer-shaped state. Megatron-Core's own optimizer state through a real engine: tests/integration/test_resume_cpu.py
and test_pipeline_cpu.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8_recipes.training.checkpoint import (FORMAT_VERSION, checkpoint_meta, find_resume, load_checkpoint,
                                             read_checkpoint, resolve_checkpoint, save_checkpoint)

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 256  # a 256x256 Linear + AdamW state: ~0.8 MB of tensors, so a duplicated copy would double the size

# Run as a plain script: one process, no process group; under torchrun: each rank a data-parallel replica.
WORKER = f'''
import os, sys, torch
from fp8_recipes.training.checkpoint import load_checkpoint, save_checkpoint
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from test_checkpoint_dcp import StateEngine
distributed = "RANK" in os.environ
if distributed:
    import torch.distributed as dist
    dist.init_process_group("gloo")
rank = int(os.environ.get("RANK", 0))
torch.manual_seed(0)
model = torch.nn.Linear({WIDTH}, {WIDTH})
optimizer = torch.optim.AdamW(model.parameters())
model(torch.ones(2, {WIDTH})).sum().backward()
optimizer.step()
save_checkpoint(sys.argv[1], 1, engine=StateEngine(model, optimizer), extra={{"rank": rank}})
fresh = torch.nn.Linear({WIDTH}, {WIDTH})
load_checkpoint(sys.argv[1], models=fresh)
assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
if distributed:
    dist.destroy_process_group()
'''


def leaves(obj: object, path: tuple = ()) -> list[tuple]:
    """Every container and leaf of ``obj`` as (key path, type, content): two objects with equal lists are equal in
    values and in types, dict key types included (what a round trip must keep)."""
    if isinstance(obj, dict):
        return [(path, type(obj), tuple(obj))] + [leaf for k, v in obj.items() for leaf in leaves(v, (*path, k))]
    if isinstance(obj, (list, tuple)):
        return [(path, type(obj), len(obj))] + [leaf for i, v in enumerate(obj) for leaf in leaves(v, (*path, i))]
    if isinstance(obj, torch.Tensor):
        return [(path, obj.dtype, tuple(obj.shape), obj.tolist())]
    return [(path, type(obj), obj)]


def assert_same(a: object, b: object) -> None:
    assert leaves(a) == leaves(b)


class State:
    """Anything with ``state_dict()``, like the precision backend and the fp32 master weights."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state


class StateEngine:
    """The engine's state interface (training/engine.py) around a plain model and torch optimizer."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.models, self.optimizer = [model], optimizer
        self.cfg = type("Cfg", (), {"use_distributed_optimizer": False})()

    def optimizer_state_dict(self) -> dict:
        return {"distributed": False, "state_dict": self.optimizer.state_dict()}

    def load_optimizer_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["state_dict"])


def trained_model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """A bf16 model after two AdamW steps (optimizer state present) under a scheduler."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    for _ in range(2):
        model(torch.randn(3, 8, dtype=torch.bfloat16)).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def test_payload_round_trips_exactly_through_a_dcp_dir(tmp_path):
    model, optimizer, scheduler = trained_model_and_optimizer()
    precision = State({"recipe": "delayed", "scalers": {"decoder.layers.0": {"weights": {
        "history": torch.arange(4.0), "scale": torch.tensor(2.0)}}}, "empty": {}, "pair": (1, "a", None)})
    random.seed(5)
    step_dir = save_checkpoint(tmp_path, 2, engine=StateEngine(model, optimizer), scheduler=scheduler,
                               precision=precision, extra={"trainer": {}, "n": 3})

    names = sorted(p.name for p in step_dir.iterdir())
    assert names[0] == ".metadata" and names[-2:] == ["checksums.json", "meta.json"]
    assert all(n.endswith(".distcp") for n in names[1:-2])
    assert resolve_checkpoint(tmp_path) == step_dir and checkpoint_meta(step_dir)["tensor_model_parallel_size"] == 1
    payload = read_checkpoint(step_dir)
    assert payload["format_version"] == FORMAT_VERSION == 3 and payload["step"] == 2
    assert_same(payload["model"], [model.state_dict()])  # one state dict per model chunk
    assert payload["model"][0]._metadata == model.state_dict()._metadata  # module versions load_state_dict reads
    assert_same(payload["optimizer"]["state_dict"], optimizer.state_dict())  # state keyed by int parameter index
    assert_same(payload["scheduler"], scheduler.state_dict())
    assert_same(payload["precision"], precision.state)  # the empty dict and the tuple included
    assert_same(payload["extra"], {"trainer": {}, "n": 3})
    assert payload["rng"]["python"] == random.getstate() and torch.equal(payload["rng"]["cpu"], torch.get_rng_state())

    # load_checkpoint puts it into fresh objects; the optimizer continues exactly
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda step: 0.5 ** step)
    assert load_checkpoint(tmp_path, engine=StateEngine(fresh, fresh_opt), scheduler=fresh_sched) == 2
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    for m, o in ((model, optimizer), (fresh, fresh_opt)):
        m(x).float().sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_missing_tensor_parallel_rank_is_named(tmp_path):
    model, _, _ = trained_model_and_optimizer()
    step_dir = save_checkpoint(tmp_path, 1, models=model)
    with pytest.raises(FileNotFoundError, match=r"holds no state of pipeline rank 0, tensor-parallel rank 1 \(it "
                                                r"holds pp00tp00\)"):
        read_checkpoint(step_dir, tp_rank=1)
    with pytest.raises(FileNotFoundError, match=r"pipeline rank 1, tensor-parallel rank 0"):
        read_checkpoint(step_dir, pp_rank=1)
    (step_dir / "meta.json").unlink()  # (save_checkpoint always writes it) the TP size from DCP's metadata then
    assert checkpoint_meta(step_dir) == {"step": 1, "tensor_model_parallel_size": 1}


def dir_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.glob("*.distcp"))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_data_parallel_replicas_are_written_once(tmp_path, free_port):
    """Two gloo ranks, each a replica of the same model and optimizer: the checkpoint is as large as one rank's,
    its entries are rank 0's (the lowest rank holding them), and both ranks load it back."""
    (tmp_path / "worker.py").write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    one = subprocess.run([sys.executable, str(tmp_path / "worker.py"), str(tmp_path / "dp1")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), str(tmp_path / "worker.py"), str(tmp_path / "dp2")], env=env,
                         capture_output=True, text=True, timeout=180)
    assert two.returncode == 0, two.stderr[-3000:]

    dp1, dp2 = (tmp_path / name / "checkpoints" / "step_1" for name in ("dp1", "dp2"))
    assert checkpoint_meta(dp2)["data_parallel_size"] == 2 and (dp2 / ".metadata").is_file()
    size1, size2 = dir_bytes(dp1), dir_bytes(dp2)
    assert size1 > 3 * WIDTH * WIDTH * 4  # weight, exp_avg, exp_avg_sq in fp32
    assert abs(size2 - size1) < 0.02 * size1, (size1, size2)  # not twice: each replica entry once
    assert sum(p.stat().st_size for p in dp2.glob("__1_*.distcp")) == 0  # rank 1 wrote nothing
    a, b = read_checkpoint(dp1), read_checkpoint(dp2)
    assert b["extra"] == {"rank": 0}  # the entries kept are data-parallel rank 0's
    assert_same(a["model"], b["model"])
    assert_same(a["optimizer"], b["optimizer"])


def write_format_2(run_dir: Path) -> Path:
    """What the engine before Megatron-Core's left: a DCP dir whose payload key is ``tp00`` + latest."""
    import torch.distributed.checkpoint as dcp

    step_dir = run_dir / "checkpoints" / "step_4"
    dcp.save({"tp00": {"skeleton": b"x", "tensors": {"w": torch.zeros(2)}}}, storage_writer=dcp.FileSystemWriter(
        step_dir), no_dist=True)
    (run_dir / "checkpoints" / "latest").write_text("step_4\n")
    return step_dir


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_format_2_checkpoint_is_refused_in_one_line(tmp_path):
    step_dir = write_format_2(tmp_path / "old")
    with pytest.raises(ValueError, match=r"^trainer\.resume: .*step_4 is a format-2 checkpoint, which this version "
                                         r"cannot read \(format 3: Megatron-Core's optimizer state.*start a fresh run$"):
        find_resume("auto", tmp_path / "old")
    with pytest.raises(ValueError, match="format-2"):
        find_resume(str(step_dir), tmp_path / "elsewhere")


def write_format_1(run_dir: Path) -> Path:
    """What the previous version left: checkpoints/step_3/tp_00.pt (one torch.save file per TP rank) + latest."""
    step_dir = run_dir / "checkpoints" / "step_3"
    step_dir.mkdir(parents=True)
    torch.save({"format_version": 1, "step": 3}, step_dir / "tp_00.pt")
    (run_dir / "checkpoints" / "latest").write_text("step_3\n")
    return step_dir


def test_format_1_checkpoint_is_refused_in_one_line(tmp_path):
    step_dir = write_format_1(tmp_path / "old")
    for resume in ("auto", str(tmp_path / "old"), str(step_dir)):
        with pytest.raises(ValueError, match=r"^trainer\.resume: .*step_3 is a format-1 checkpoint, which this version "
                                             r"cannot read .*start a fresh run$"):
            find_resume(resume, tmp_path / "old")
    with pytest.raises(ValueError, match="format-1"):
        load_checkpoint(step_dir, models=torch.nn.Linear(2, 2))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_train_py_refuses_a_format_1_checkpoint(tmp_path):
    """scripts/train.py: one line on stderr, exit 2, before any process group, data or model (nothing written)."""
    step_dir = write_format_1(tmp_path / "old")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")}
    proc = subprocess.run([sys.executable, "scripts/train.py", f"run_dir={tmp_path / 'new'}",
                           f"trainer.resume={step_dir}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: trainer.resume: {step_dir} is a format-1 checkpoint"), lines
    assert not (tmp_path / "new").exists()


def test_eval_checkpoint_refuses_a_format_1_checkpoint(tmp_path):
    """evaluate_checkpoint (scripts/eval_checkpoint.py) names its argument: one line, no traceback."""
    from fp8_recipes.training.evaluate import evaluate_checkpoint

    step_dir = write_format_1(tmp_path)
    (tmp_path / ".hydra").mkdir()
    # a run dir as far as the refusal looks (load_run_config wants the three groups)
    (tmp_path / ".hydra" / "config.yaml").write_text("model: {}\ndata: {}\ntrainer: {}\n")
    with pytest.raises(ValueError, match=rf"^run_dir: {step_dir} is a format-1 checkpoint"):
        evaluate_checkpoint(tmp_path, recipe="bf16")


def test_export_and_evaluation_refuse_a_damaged_checkpoint_in_one_line(tmp_path):
    """A checkpoint whose shards are gone (latest names an empty step dir): one line naming the argument, before
    anything is read or written."""
    from fp8_recipes.training.evaluate import evaluate_checkpoint
    from fp8_recipes.training.hf import export_hf

    step_dir = tmp_path / "checkpoints" / "step_1"
    step_dir.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step_1\n")
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("model: {}\ndata: {}\ntrainer: {}\n")
    damaged = (rf"{step_dir} is damaged: its \.metadata \(the index of its shards\) is missing; name an intact "
               rf"step_N dir$")
    with pytest.raises(ValueError, match=rf"^run_dir: {damaged}"):
        evaluate_checkpoint(tmp_path, recipe="bf16")
    with pytest.raises(ValueError, match=rf"^--checkpoint: {damaged}"):  # (the script's option, when it names it)
        evaluate_checkpoint(tmp_path, checkpoint=tmp_path, recipe="bf16")
    with pytest.raises(ValueError, match=rf"^SOURCE: {damaged}"):
        export_hf(tmp_path, tmp_path.parent / "hf")
    assert not (tmp_path.parent / "hf").exists()


@pytest.mark.parametrize("case", ["latest not UTF-8", "empty meta.json"])
def test_train_py_and_export_name_a_damaged_checkpoint(case, tmp_path):
    """A `latest` that is not UTF-8 (was an internal error) and a `{}` meta.json (was read as another tensor-parallel
    size): one line calling the checkpoint damaged, from train.py (exit 2, the new run_dir never made) and export."""
    from fp8_recipes.training.hf import export_hf

    step_2, step_4 = two_checkpoints(tmp_path / "old")
    DAMAGE[case][0](step_4)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")}
    proc = subprocess.run([sys.executable, "scripts/train.py", f"run_dir={tmp_path / 'new'}",
                           f"trainer.resume={tmp_path / 'old'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("error: trainer.resume: ") and DAMAGE[case][1] in lines[0], lines
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match=r"^SOURCE: ") as e:
        export_hf(tmp_path / "old", tmp_path / "hf")
    assert DAMAGE[case][1] in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------------------------
# Integrity (issue 19): checksums written with every checkpoint, verified on resume; auto falls back to the
# newest intact checkpoint with one warning; a named damaged one is refused in one line


def two_checkpoints(run_dir: Path) -> tuple[Path, Path]:
    model, optimizer, _ = trained_model_and_optimizer()
    from test_checkpoint_dcp import StateEngine

    engine = StateEngine(model, optimizer)
    return save_checkpoint(run_dir, 2, engine=engine), save_checkpoint(run_dir, 4, engine=engine)


def flip_a_bit(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped bit": (lambda d: flip_a_bit(next(d.glob("__0_*.distcp"))), "does not match its checksum"),
    "truncated shard": (lambda d: (lambda p: p.write_bytes(p.read_bytes()[:100]))(next(d.glob("__0_*.distcp"))),
                        "bytes, "),
    "missing .metadata": (lambda d: (d / ".metadata").unlink(), "its .metadata (the index of its shards) is missing"),
    "truncated .metadata": (lambda d: (lambda p: p.write_bytes(p.read_bytes()[:100]))(d / ".metadata"),
                            ".metadata has 100 bytes"),  # (read before the damage checks once: an unpickling error)
    "garbage meta.json": (lambda d: (d / "meta.json").write_text("{not json"), "its meta.json is not valid JSON"),
    "latest names nothing": (lambda d: (d.parent / "latest").write_text("step_99\n"), "does not exist"),
    "empty meta.json": (lambda d: (d / "meta.json").write_text("{}"),
                        "its meta.json has no integer 'step' or 'tensor_model_parallel_size'"),
    "meta.json a list": (lambda d: (d / "meta.json").write_text("[1]"), "its meta.json is not a JSON object"),
    "checksums of another shape": (lambda d: (d / "checksums.json").write_text('{"a": 1}'),
                                   "its checksums.json is not a record of file sizes and checksums"),
    "latest not UTF-8": (lambda d: (d.parent / "latest").write_bytes(b"\xff\xfe\n"),
                         "checkpoints/latest is not UTF-8 text"),
    "latest a path": (lambda d: (d.parent / "latest").write_text("../../elsewhere\n"), "not a step_N name"),
}
POINTER = ("latest names nothing", "latest not UTF-8", "latest a path")  # step_4 itself is intact


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_latest_falls_back_to_the_newest_intact(case, tmp_path, caplog):
    import logging

    from fp8_recipes.training.checkpoint import checkpoint_damage, intact_checkpoint

    step_2, step_4 = two_checkpoints(tmp_path)
    assert checkpoint_damage(step_4) is None and (step_4 / "checksums.json").is_file()
    damage, says = DAMAGE[case]
    damage(step_4)
    fallback = step_4 if case in POINTER else step_2  # the newest intact one
    with caplog.at_level(logging.WARNING, logger="fp8_recipes"):
        assert find_resume("auto", tmp_path) == fallback
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "fp8_recipes"]
    assert len(warning) == 1 and says in warning[0] and warning[0].endswith(
        f"resuming from {fallback.name}, the newest intact checkpoint"), warning
    if fallback == step_2:  # named explicitly, a damaged checkpoint is refused in one line
        with pytest.raises(ValueError) as e:
            find_resume(str(step_4), tmp_path)
        assert str(e.value).startswith("trainer.resume: ") and "\n" not in str(e.value)
        assert f"{step_4} is damaged: " in str(e.value) or case == "missing .metadata"  # (no DCP dir at all then)
        # export and eval_checkpoint refuse what a resume refuses (a flipped bit was exported before)
        with pytest.raises(ValueError) as e:
            intact_checkpoint(step_4, "SOURCE")
        assert str(e.value).startswith("SOURCE: ") and "\n" not in str(e.value)
        assert f"{step_4} is damaged: " in str(e.value) and says in str(e.value) or case == "missing .metadata"
    for step_dir in (step_2, step_4):
        flip_a_bit(next(step_dir.glob("__0_*.distcp")), at=0.25)
    with pytest.raises(ValueError, match=r"^trainer.resume=auto: no intact checkpoint in .*; start fresh"):
        find_resume("auto", tmp_path)


def test_the_ranks_share_the_reading_of_a_checkpoint(tmp_path):
    """Before the process group: sizes only (quick_damage); in it, each of n ranks digests every n-th file and all
    agree (shared_damage): a flipped bit is found by exactly one share, a truncated file by the quick check."""
    from fp8_recipes.training.checkpoint import checkpoint_damage, quick_damage

    _, step_4 = two_checkpoints(tmp_path)
    flip_a_bit(next(step_4.glob("__0_*.distcp")))
    assert quick_damage(step_4) is None
    found = [checkpoint_damage(step_4, share=(i, 3)) for i in range(3)]
    assert sum(bool(f) for f in found) == 1 and "does not match its checksum" in next(f for f in found if f)
    assert checkpoint_damage(step_4) == next(f for f in found if f)
    data = next(step_4.glob("__0_*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    assert "bytes, " in quick_damage(step_4)


SHARED = f'''
import json, logging, os, sys
import torch.distributed as dist
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from fp8_recipes.training import checkpoint
dist.init_process_group("gloo")
read = []
digest = checkpoint._digest
checkpoint._digest = lambda path: read.append(path.parent.name + "/" + path.name) or digest(path)
logging.basicConfig(level=logging.WARNING, format="WARNING %(message)s")
got = checkpoint.find_resume("auto", sys.argv[1], damage=checkpoint.shared_damage)
# one file per rank: the two ranks share the launcher's stdout, where their lines can run together
mine = {{"rank": dist.get_rank(), "got": got.name, "read": read}}
Path(sys.argv[1], f"rank{{dist.get_rank()}}.json").write_text(json.dumps(mine))
dist.barrier()  # (both ranks done before either tears gloo down: else one may abort on the other's closed pairs)
dist.destroy_process_group()
'''


def test_shared_damage_in_a_process_group(tmp_path, free_port):
    """Two gloo ranks: each digests its own share of the files, both fall back to the same checkpoint, one warning."""
    import json

    _, step_4 = two_checkpoints(tmp_path)
    flip_a_bit(next(step_4.glob("__0_*.distcp")))
    script = tmp_path / "shared.py"
    script.write_text(SHARED)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")}
    env["PYTHONPATH"] = f"{ROOT / 'plugins'}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(script), str(tmp_path)], check=False, cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["got"] for r in ranks] == ["step_2", "step_2"], ranks
    for step in ("step_4", "step_2"):  # every recorded file digested once, by one rank
        files = sorted(json.loads((tmp_path / "checkpoints" / step / "checksums.json").read_text()))
        mine = [sorted(f.split("/")[1] for f in r["read"] if f.startswith(step + "/")) for r in ranks]
        assert sorted(mine[0] + mine[1]) == files and not set(mine[0]) & set(mine[1]), (step, mine)
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "newest intact" in line]
    assert len(warnings) == 1 and "resuming from step_2" in warnings[0], proc.stderr[-2000:]


def test_fp8_stored_weights_are_saved_as_their_bf16_values():
    # recipe fp8_param: true: TE QuantizedTensors go into DCP as BF16 (their exact bytes travel in the precision state)
    from fp8_recipes.training.checkpoint import _plain_weights

    class FP8Weight:
        def _get_quantizer(self):
            return None

        def dequantize(self):
            return torch.full((2,), 0.5, dtype=torch.bfloat16)

    plain = torch.ones(2)
    state = _plain_weights({"w": FP8Weight(), "b": plain, "_extra_state": None})
    assert torch.equal(state["w"], torch.full((2,), 0.5, dtype=torch.bfloat16)) and state["b"] is plain


def _meta_only(tmp_path: Path, **meta) -> Path:
    """A step dir with only the meta.json resume_skip reads (before any process group or model exists)."""
    import json

    step_dir = tmp_path / "checkpoints" / "step_4"
    step_dir.mkdir(parents=True)
    (step_dir / "meta.json").write_text(json.dumps({"step": 4, "global_batch_size": 4, "micro_batch_size": 2,
                                                    "reshardable": True, **meta}))
    return step_dir


@pytest.mark.parametrize("saved, wanted, says", [
    ({"expert_model_parallel_size": 1, "expert_tensor_parallel_size": 2}, {"expert_model_parallel_size": 1},
     "trainer.expert_tensor_parallel_size: 1 differs from the checkpoint's 2 (STEP; experts are resharded only "
     "where expert TP equals TP"),
    ({"expert_model_parallel_size": 1}, {"expert_model_parallel_size": 1, "expert_tensor_parallel_size": 2},
     "trainer.expert_tensor_parallel_size: 2 differs from the checkpoint's 1"),
    ({"expert_model_parallel_size": 1, "expert_tensor_parallel_size": 2},
     {"expert_model_parallel_size": 1, "expert_tensor_parallel_size": 2, "pipeline_model_parallel_size": 2},
     "trainer.pipeline_model_parallel_size: 2 differs from the checkpoint's 1 (STEP: expert TP 2 at TP 1 there, 2 "
     "at 1 here; experts are resharded only where expert TP equals TP"),
    ({"expert_model_parallel_size": 1}, {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1},
     "trainer.tensor_model_parallel_size: 2 differs from the checkpoint's 1 (STEP: expert TP 1 at TP 1 there, 1 at 2 "
     "here; experts are resharded only where expert TP equals TP"),
    ({"expert_model_parallel_size": 2, "reshardable": False}, {"expert_model_parallel_size": 1},
     "trainer.expert_model_parallel_size: 1 differs from the checkpoint's 2 (STEP; it was written before "
     "checkpoints could be resharded"),
])
def test_resume_refuses_what_cannot_reshard_experts(tmp_path, saved, wanted, says):
    """An expert TP other than TP (before or after: the experts cut otherwise than the dense layers, so neither
    expert TP nor TP may change), or another EP size of a checkpoint written before resharding: one line naming
    the key and the checkpoint's value."""
    from fp8_recipes.training.checkpoint import resume_skip

    step_dir = _meta_only(tmp_path, tensor_model_parallel_size=1, **saved)
    with pytest.raises(ValueError) as e:
        resume_skip(step_dir, global_batch_size=4, micro_batch_size=2,
                    **{"tensor_model_parallel_size": 1, **wanted})
    line = str(e.value)
    assert "\n" not in line and line.startswith(says.replace("STEP", str(step_dir))), line
    assert line.endswith(f"resume with {says.split(':')[0]}={says.split('checkpoint' + chr(39) + 's ')[1][0]})")


@pytest.mark.parametrize("saved, wanted", [
    ({"expert_model_parallel_size": 2}, {"expert_model_parallel_size": 1}),
    ({"expert_model_parallel_size": 1}, {"expert_model_parallel_size": 4}),
    ({"expert_model_parallel_size": 2}, {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2}),
    ({"expert_model_parallel_size": 2}, {"expert_model_parallel_size": 1, "pipeline_model_parallel_size": 2}),
    ({"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 2},
     {"expert_model_parallel_size": 1, "tensor_model_parallel_size": 1}),
])
def test_resume_reshards_experts_where_expert_tp_follows_tp(tmp_path, saved, wanted):
    """Another EP size, or another TP / PP layout at EP > 1, with expert TP = TP before and after: resumed
    (load_checkpoint reshards it), the data position as at the same layout."""
    from fp8_recipes.training.checkpoint import resume_skip

    step_dir = _meta_only(tmp_path, **{"tensor_model_parallel_size": 1, **saved})
    assert resume_skip(step_dir, global_batch_size=4, micro_batch_size=2,
                       **{"tensor_model_parallel_size": 1, **wanted}) == 8


def test_a_dense_checkpoint_still_reshards_across_tensor_parallel_sizes(tmp_path):
    """A dense model's expert TP is its TP (meta.json records it so): TP 2 -> 1 is resharded, not refused as
    another expert TP size."""
    from fp8_recipes.training.checkpoint import resume_skip

    step_dir = _meta_only(tmp_path, tensor_model_parallel_size=2, expert_model_parallel_size=1,
                          expert_tensor_parallel_size=2)
    assert resume_skip(step_dir, global_batch_size=4, micro_batch_size=2, tensor_model_parallel_size=1) == 8


def test_export_and_evaluation_refuse_experts_split_over_another_expert_tp(tmp_path):
    """Experts cut over expert TP != TP are refused in one line; a meta.json whose EP size its payloads were not
    written at is damage (a hand edit: naming the model or a trainer key instead would mislead)."""
    import json

    from fp8_recipes.checks import ConfigError
    from fp8_recipes.training.checkpoint import intact_checkpoint

    model, _, _ = trained_model_and_optimizer()
    step_dir = save_checkpoint(tmp_path, 1, models=model)
    meta = json.loads((step_dir / "meta.json").read_text())
    (step_dir / "meta.json").write_text(json.dumps({**meta, "expert_model_parallel_size": 2}))
    with pytest.raises(ConfigError, match=r"is damaged: its meta.json says expert_model_parallel_size 2, its "
                                          r"payloads were written at 1 \(pp00tp00\)"):
        intact_checkpoint(step_dir, "SOURCE")
    (step_dir / "meta.json").write_text(json.dumps({**meta, "expert_tensor_parallel_size": 2}))
    with pytest.raises(ConfigError, match=r"^SOURCE: .* was written at trainer.expert_tensor_parallel_size=2 "
                                          r"\(tensor parallel 1\): its experts are split otherwise"):
        intact_checkpoint(step_dir, "SOURCE")


def test_the_core_attentions_extra_state_may_differ_and_nothing_else():
    """An emulated run's checkpoint from the CPU (Megatron-Core's local attention: no extra state) loads into the
    GPU's build (TE's attention: an extra state entry) and back; any other missing or unexpected key still fails."""
    from fp8_recipes.training.checkpoint import _load_model_state

    class WithExtra(torch.nn.Module):
        def get_extra_state(self):
            return {"fp8": None}

        def set_extra_state(self, state):
            self.loaded = state

    class Layer(torch.nn.Module):
        def __init__(self, te: bool):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.core_attention = WithExtra() if te else torch.nn.Identity()

    local, te = Layer(te=False), Layer(te=True)
    _load_model_state(te, local.state_dict())  # missing core_attention._extra_state: tolerated
    assert torch.equal(te.linear.weight, local.linear.weight)
    _load_model_state(local, te.state_dict())  # unexpected core_attention._extra_state: tolerated
    with pytest.raises(RuntimeError, match="linear.bias"):
        _load_model_state(local, {k: v for k, v in te.state_dict().items() if k != "linear.bias"})


def test_a_zip_writer_error_on_a_full_disk_is_a_write_failure(tmp_path, monkeypatch):
    """torch's zip writer reports a full disk as a RuntimeError ("unexpected pos"): on a (nearly) full file system
    that is the write failure (exit 5, the temporary directory removed); anywhere else it stays a bug."""
    from fp8_recipes.training import checkpoint

    def write():
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint, "_nearly_full", lambda where: True)
    said = checkpoint._attempt(write, where=tmp_path)
    assert said.startswith("[Errno 28] ") and "unexpected pos 704" in said
    monkeypatch.setattr(checkpoint, "_nearly_full", lambda where: False)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        checkpoint._attempt(write, where=tmp_path)
    monkeypatch.undo()
    assert checkpoint._nearly_full(tmp_path / "not" / "yet") is False  # (this disk has room; a missing dir reads
    # its nearest existing parent)


@pytest.mark.parametrize("changes", [{}, {"num_query_groups": None, "ffn_hidden_size": None, "activation": "gelu",
                                          "normalization": "LayerNorm", "share_embeddings_and_output_weights": True,
                                          "vocab_size": 300}], ids=["tiny", "defaults"])
def test_a_model_config_describes_the_record_of_its_model(changes, tiny_model_cfg, megatron_cpu, tmp_path):
    """check_config_matches (the export's and the evaluation's check of a run config against a checkpoint) derives
    meta.json's model record from the config without building the model: it equals the built model's record, and
    the first key that differs is named with both values."""
    from fp8_recipes.megatron.model import build_model_chunks
    from fp8_recipes.training.checkpoint import _cfg_model_fields, _model_fields, check_config_matches

    cfg = {**tiny_model_cfg, "num_layers": 1, **changes}
    record = _model_fields(build_model_chunks(cfg, device=torch.device("cpu")))["model"]
    assert _cfg_model_fields(cfg, 1) == record
    step_dir = tmp_path / "step_1"
    step_dir.mkdir()
    (step_dir / "meta.json").write_text(json.dumps({"step": 1, "tensor_model_parallel_size": 1, "model": record}))
    check_config_matches(step_dir, cfg, "cfg.yaml", "SOURCE")
    with pytest.raises(ValueError, match=rf"^SOURCE: not a checkpoint of this run's model: model.hidden_size is 128 "
                                         rf"in {step_dir}, 256 in cfg.yaml; restore model.hidden_size: 128 in that"):
        check_config_matches(step_dir, {**cfg, "hidden_size": 256}, "cfg.yaml", "SOURCE")


def test_meta_records_the_expert_count_so_a_resume_names_it(tmp_path):
    """meta.json's model record holds num_moe_experts (the EP joins number experts by it): a run config with another
    count is named by its key, and a dense model records null."""
    from fp8_recipes.training.checkpoint import _cfg_model_fields, _model_difference

    moe = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256, "num_moe_experts": 4}
    meta = {"model": _cfg_model_fields(moe, 1)}
    assert meta["model"]["num_moe_experts"] == 4
    assert _model_difference(meta, _cfg_model_fields({**moe, "num_moe_experts": 8}, 1), same_tp=True) == (
        "num_moe_experts", "4", "8")
    dense = {k: v for k, v in moe.items() if k != "num_moe_experts"}
    assert _cfg_model_fields(dense, 1)["num_moe_experts"] is None
    # (a sweep: another expert width was named by a tensor's shape, not the key)
    assert meta["model"]["moe_ffn_hidden_size"] == 4 * 64  # (no width given: Megatron-Core's default)
    assert _model_difference(meta, _cfg_model_fields({**moe, "moe_ffn_hidden_size": 128}, 1), same_tp=True) == (
        "moe_ffn_hidden_size", "256", "128")
    assert _cfg_model_fields({**dense, "moe_ffn_hidden_size": 128}, 1)["moe_ffn_hidden_size"] is None  # (idle there)


@pytest.mark.parametrize("edit, says", [
    ({"expert_model_parallel_size": "abc"}, "its meta.json's 'expert_model_parallel_size' is \"abc\", not an integer >= 1"),
    ({"expert_tensor_parallel_size": [2]}, "its meta.json's 'expert_tensor_parallel_size' is [2], not an integer >= 1"),
    ({"expert_model_parallel_size": 0}, "its meta.json's 'expert_model_parallel_size' is 0, not an integer >= 1"),
    ({"consumed_samples": "lots"}, "its meta.json's 'consumed_samples' is \"lots\", not an integer >= 0"),
    ({"model": [1, 2]}, "its meta.json's 'model' is a list, not a mapping of model config keys"),
    ({"model": {"num_moe_experts": -4}}, "its meta.json's model 'num_moe_experts' is -4, not an integer >= 1 or null"),
])
def test_hand_edited_meta_values_are_damage(tmp_path, edit, says):
    """A hostile-input sweep: wrongly typed meta.json values ended in an internal error (int('abc')) or were read
    as another layout; now the checkpoint is damaged, in the line a resume, export and evaluation give."""
    import json

    from fp8_recipes.training.checkpoint import checkpoint_damage

    model, _, _ = trained_model_and_optimizer()
    step_dir = save_checkpoint(tmp_path, 1, models=model)
    meta = json.loads((step_dir / "meta.json").read_text())
    (step_dir / "meta.json").write_text(json.dumps({**meta, **edit}))
    assert checkpoint_damage(step_dir) == says


def test_a_shard_gone_without_its_checksum_record_is_damage_not_a_traceback(tmp_path):
    """checksums.json deleted (or {}) and a .distcp file deleted: the index still names it (was a raw traceback
    from DCP's CheckpointException, a BaseException); a file cut short reads as damage in one line too."""
    from fp8_recipes.checks import ConfigError
    from fp8_recipes.training.checkpoint import checkpoint_damage, read_checkpoint

    model, _, _ = trained_model_and_optimizer()
    step_dir = save_checkpoint(tmp_path, 1, models=model)
    (step_dir / "checksums.json").unlink()
    shard = next(step_dir.glob("__0_*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"is damaged: its shard pp00tp00 does not read \(.*\); resume from an "
                                          r"intact step_N dir"):
        read_checkpoint(step_dir)
    shard.unlink()
    assert checkpoint_damage(step_dir) == f"{shard.name} (named by its .metadata) is missing"


def test_a_graph_safe_trackers_generators_are_saved_as_state_tensors(monkeypatch):
    """Under CUDA graphs (model cuda_graph_impl) the model-parallel RNG tracker is TE's, whose states are torch
    Generators: a checkpoint holds them as state tensors (weights_only loading takes no Generator), and a tracker that
    is not graph-safe gets the tensors back as they are (a checkpoint of a graphed run resumed without graphs)."""
    from megatron.core.tensor_parallel import random as mp_random

    from fp8_recipes.training.checkpoint import _rng_state, _set_rng_state

    gen = torch.Generator().manual_seed(7)

    class Tracker:
        states = {"model-parallel-rng": gen}

        def get_states(self):
            return dict(self.states)

        def set_states(self, states):
            self.states = states

    tracker = Tracker()
    monkeypatch.setattr(mp_random, "get_cuda_rng_tracker", lambda: tracker)
    monkeypatch.setattr("megatron.core.tensor_parallel.get_cuda_rng_tracker", lambda: tracker)
    saved = _rng_state()["tracker"]
    assert isinstance(saved["model-parallel-rng"], torch.Tensor)
    assert torch.equal(saved["model-parallel-rng"], gen.get_state())
    _set_rng_state({"cpu": torch.get_rng_state(), "python": random.getstate(), "tracker": saved})
    assert torch.equal(tracker.states["model-parallel-rng"], gen.get_state())
