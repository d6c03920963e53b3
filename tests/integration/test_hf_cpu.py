"""From and to Hugging Face on the CPU (issue 16): a small Llama-shaped model trained here, exported with
``fp8-recipes export ... --to hf`` and loaded by ``transformers``.

- BF16: transformers' logits equal ours within BF16 rounding; greedy decoding of 32 tokens gives the same tokens.
- FP8 (128x128 blocks and per tensor): transformers' dequantized weights are exactly our numerics core's
  quantize/dequantize under Transformer Engine's weight rules; our model holding those weights (imported with
  ``model.init_from``'s loader) gives transformers' logits and the same 32 greedy tokens.
- export -> ``model.init_from=hf:`` at TP=2 and at PP=2 x VPP=2 (torchrun, 2 gloo ranks) -> export is
  byte-identical (one step at a learning rate far below a BF16 ulp leaves the weights as they were).
- Refusals: a model that is not Llama-shaped, a HF checkpoint of another vocabulary or shape, in one line each.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason='the hf extra: pip install -e ".[hf]"')
from safetensors.torch import load_file  # noqa: E402  (the hf extra)

from fp8_recipes.integrations.hf_llama import _fp8_policy  # noqa: E402
from fp8_recipes.numerics import fake_quant  # noqa: E402
from fp8_recipes.training.hf import export_hf, load_hf_weights  # noqa: E402
from test_train_cpu import ROOT, compose_train, small_run  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
LAYERS, STEPS, NEW_TOKENS = 4, 40, 32
PANGRAM = b"the quick brown fox jumps over the lazy dog. "


def train(run_dir: Path, dataset: list[str], *extra: str, steps: int = STEPS) -> Path:
    """A run of scripts/train.py's composed config in this process, with the .hydra/config.yaml Hydra writes."""
    from omegaconf import OmegaConf

    from fp8_recipes.training.run import run_training

    overrides = [o for o in small_run(run_dir, LAYERS, steps) if not o.startswith("trainer.save_checkpoints=")]
    cfg = compose_train([*overrides, *dataset, "trainer.lr=1e-2", *extra])
    with pytest.MonkeyPatch.context() as mp:
        for var in LAUNCH_VARS:
            mp.delenv(var, raising=False)
        run_training(cfg)
    (run_dir / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    return run_dir


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> list[str]:
    """A corpus a tiny model learns in 40 steps: a pangram over and over (bytes tokenizer, 20 documents). The
    model then continues it with confident, varied tokens: greedy decoding compares something."""
    from fp8_recipes.megatron.data import prepare_dataset

    root = tmp_path_factory.mktemp("pangram")
    for n in range(20):
        (root / "corpus").mkdir(exist_ok=True)
        (root / "corpus" / f"{n:02d}.txt").write_bytes(PANGRAM * 40)
    prepare_dataset(str(root / "corpus"), root / "bytes", tokenizer_kind="bytes")
    return [f"data.path={root / 'bytes'}", f"data.inputs={root / 'corpus'}", "data.tokenizer=bytes",
            "data.split='80,10,10'"]


@pytest.fixture(scope="module")
def run(dataset, tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("hf_run"), dataset)


@pytest.fixture(scope="module")
def exports(run, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_out")
    return {"bf16": export_hf(run, root / "bf16", progress=lambda _: None),
            "fp8": export_hf(run, root / "fp8", dtype="fp8", progress=lambda _: None),
            "fp8_tensor": export_hf(run, root / "fp8_tensor", dtype="fp8", block=None, progress=lambda _: None)}


def build_ours(run: Path, dtype: torch.dtype):
    """(our model holding the run's checkpoint with ``dtype`` parameters, its model config)."""
    from fp8_recipes.megatron.model_config import run_model_cfg
    from fp8_recipes.plan.precision import Hardware
    from fp8_recipes.recipe.pack import load_recipe
    from fp8_recipes.rundir import load_run_config
    from fp8_recipes.training.checkpoint import load_checkpoint
    from fp8_recipes.training.run import attach_emulated

    cfg = load_run_config(run)
    data = Path(cfg.data.path)
    model_cfg = run_model_cfg(cfg, json.loads((data / "meta.json").read_text()), data)
    chunks, _, _ = attach_emulated(model_cfg, load_recipe("bf16"), Hardware(), dtype, torch.device("cpu"))
    load_checkpoint(run, models=chunks, restore_rng=False)
    return chunks, model_cfg


@pytest.fixture
def ours(run, megatron_cpu):
    return build_ours(run, torch.bfloat16)


def prompt() -> torch.Tensor:
    return torch.tensor([list(PANGRAM[:30])])  # the bytes tokenizer: ids = bytes


def our_logits(chunks, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return chunks[0](ids, pos, None)[..., :vocab].float()


def their_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def greedy(logits_of, ids: torch.Tensor) -> list[int]:
    for _ in range(NEW_TOKENS):
        ids = torch.cat([ids, logits_of(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, -NEW_TOKENS:].tolist()


def load_hf(path: Path, dtype: torch.dtype = torch.bfloat16):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def assert_bf16_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal within BF16 rounding: each of the 4 layers rounds its residual stream, norms and attention to BF16 in
    its own order, so allow 4 BF16 ulps at the logits' largest magnitude (a wrong mapping, e.g. k and v swapped,
    is off by the logits' whole size). test_fp32_export_... shows the mapping itself exact."""
    ulp = 2.0 ** (math.floor(math.log2(a.abs().max().item())) - 7)
    assert (a - b).abs().max().item() <= 4 * ulp, ((a - b).abs().max().item(), ulp)


def assert_parity(chunks, model_cfg, hf_model) -> None:
    ids, vocab = prompt(), model_cfg["vocab_size"]
    assert_bf16_close(our_logits(chunks, ids, vocab), their_logits(hf_model, ids))
    ours = greedy(lambda x: our_logits(chunks, x, vocab), ids)
    assert ours == greedy(lambda x: their_logits(hf_model, x), ids)
    assert len(set(ours)) > 1  # a model that says one token over and over would agree trivially


def test_bf16_export_gives_our_logits_in_transformers(exports, ours):
    chunks, model_cfg = ours
    out = exports["bf16"]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json",
                     "tokenizer.json", "tokenizer_config.json"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x  # é"
    assert tokenizer(text)["input_ids"] == list(text.encode())  # the run's bytes tokenizer, as HF reads it
    assert tokenizer.decode(list(text.encode())) == text
    assert_parity(chunks, model_cfg, load_hf(out))


def test_the_mapping_is_exact_in_fp32(run, exports, megatron_cpu):
    """Both models in float32 holding the same (BF16) weights agree to float32 rounding: nothing but the
    arithmetic's precision separates them."""
    chunks, model_cfg = build_ours(run, torch.float32)
    ids = prompt()
    ours, theirs = our_logits(chunks, ids, model_cfg["vocab_size"]), their_logits(load_hf(exports["bf16"],
                                                                                          torch.float32), ids)
    assert (ours - theirs).abs().max().item() <= 1e-5 * ours.abs().max().item()


@pytest.mark.parametrize("name, block", [("fp8", (128, 128)), ("fp8_tensor", None)])
def test_fp8_export_matches_our_model_with_the_quantized_weights(name, block, exports, ours):
    chunks, model_cfg = ours
    out = exports[name]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == (list(block) if block else None)
    saved = load_file(out / "model-00001-of-00001.safetensors")
    bf16 = load_file(exports["bf16"] / "model-00001-of-00001.safetensors")
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                "model.layers.0.input_layernorm.weight"):
        assert saved[key].dtype == torch.bfloat16 and torch.equal(saved[key], bf16[key])
    hf_model = load_hf(out)
    for i, layer in enumerate(hf_model.model.layers):
        for module, proj in [("self_attn", p) for p in "qkvo"] + [("mlp", p) for p in ("gate", "up", "down")]:
            key = f"model.layers.{i}.{module}.{proj}_proj.weight"
            assert saved[key].dtype == torch.float8_e4m3fn
            scale_inv = saved[key + "_scale_inv"]
            rows, cols = saved[key].shape
            assert scale_inv.shape == ((-(-rows // 128), -(-cols // 128)) if block else ())
            # transformers' dequantized weight is exactly our quantize/dequantize of the BF16 weight
            assert torch.equal(getattr(getattr(layer, module), f"{proj}_proj").weight,
                               fake_quant(bf16[key], _fp8_policy(block)))
    load_hf_weights(chunks, out, model_cfg)  # our model with the quantized weights (model.init_from's loader)
    assert_parity(chunks, model_cfg, hf_model)


@pytest.mark.parametrize("layout", [["trainer.tensor_model_parallel_size=2"],
                                    ["trainer.pipeline_model_parallel_size=2",
                                     "trainer.virtual_pipeline_model_parallel_size=2", "trainer.micro_batch_size=2"]],
                         ids=["tp2", "pp2vpp2"])
def test_export_import_export_is_byte_identical(layout, exports, dataset, tmp_path, free_port):
    first = exports["bf16"]
    run_dir = tmp_path / "imported"
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCH_VARS, "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    overrides = [o for o in small_run(run_dir, LAYERS, 1) if not o.startswith("trainer.save_checkpoints=")]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), "scripts/train.py", *overrides, *dataset,
                           f"model.init_from=hf:{first}", "trainer.lr=1e-30", "trainer.min_lr=0", *layout],
                          cwd=ROOT, env=env, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "model.init_from: hf:" in proc.stderr + proc.stdout
    again = export_hf(run_dir, tmp_path / "again", progress=lambda _: None)
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in first.iterdir())
    for path in first.iterdir():
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name


def test_not_llama_shaped_and_mismatched_checkpoints_are_refused_in_one_line(run, exports, dataset, tmp_path):
    from omegaconf import OmegaConf

    from fp8_recipes.cli import main

    gpt = tmp_path / "gpt"  # the run's checkpoint under a config that says GPT-2 (LayerNorm, GELU, learned positions)
    shutil.copytree(run, gpt)
    cfg = OmegaConf.load(gpt / ".hydra" / "config.yaml")
    cfg.model.normalization, cfg.model.activation = "LayerNorm", "gelu"
    OmegaConf.save(cfg, gpt / ".hydra" / "config.yaml")
    meta = json.loads((gpt / "checkpoints" / "step_40" / "meta.json").read_text())  # and its record says so too (a
    meta["model"].update(normalization="LayerNorm", activation="gelu")  # config alone is refused as edited)
    (gpt / "checkpoints" / "step_40" / "meta.json").write_text(json.dumps(meta))
    proc = subprocess.run([sys.executable, "-m", "fp8_recipes.cli", "export", str(gpt), "--to", "hf",
                           str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and not (tmp_path / "out").exists()
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: the model is not Llama-shaped "
                                                                     "(model.normalization=LayerNorm, "), proc.stderr
    assert main(["export", str(run), "--to", "hf", str(tmp_path / "x"), "--block", "3y"]) == 1

    def refusal(*overrides: str) -> str:
        with pytest.raises(ValueError) as e:
            train(tmp_path / "refused", dataset, *overrides, steps=1)
        assert "\n" not in str(e.value)
        return str(e.value)

    hf = f"model.init_from=hf:{exports['bf16']}"
    assert refusal(hf, "model.num_layers=2").startswith(
        f"model.init_from: {exports['bf16']} has another shape than the model config: model.num_layers=2 vs 4; "
        "set model.num_layers=4")
    assert refusal(hf, "model.vocab_size=512").startswith(
        f"model.init_from: {exports['bf16']} has vocab_size 257, the model 512")
    assert refusal("model.init_from=hf:/nonexistent").startswith("model.init_from: /nonexistent has no config.json")


def _damage_config(run: Path) -> str:
    (run / ".hydra" / "config.yaml").write_text(": : :\n")
    return "/.hydra/config.yaml: line 1: YAML syntax error: "


def _flip_shard(run: Path) -> str:
    """100 bytes of the latest checkpoint's shard flipped, its size kept: a resume refuses it by its checksum."""
    shard = next((run / "checkpoints" / "step_40").glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 100] = bytes(b ^ 0xFF for b in data[middle:middle + 100])
    shard.write_bytes(bytes(data))
    return f"step_40 is damaged: {shard.name} does not match its checksum"


def _edit_hidden_size(run: Path) -> str:
    """The config says 256 wide, the weights are 128: the export wrote a config.json its tensors did not fit."""
    config = run / ".hydra" / "config.yaml"
    config.write_text(config.read_text().replace("hidden_size: 128\n", "hidden_size: 256\n", 1))
    return f"not a checkpoint of this run's model: model.hidden_size is 128 in {run}/checkpoints/step_40, 256 in"


def _truncate_tokenizer(run: Path) -> str:
    """The run's dataset (a copy, named in the copy's config) with its tokenizer.json cut short."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    shutil.copytree(cfg.data.path, run.parent / "data", ignore=shutil.ignore_patterns("cache"))
    cfg.data.path = str(run.parent / "data")
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    tokenizer = run.parent / "data" / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes()[:40])
    return (f"data.path: '{run.parent / 'data'}' is damaged (tokenizer.json does not load: JSONDecodeError: "
            f"Unterminated string")


DAMAGES = {"config": _damage_config, "flipped shard": _flip_shard, "edited config": _edit_hidden_size,
           "truncated tokenizer": _truncate_tokenizer}


@pytest.mark.parametrize("damage", DAMAGES)
def test_export_and_eval_of_a_damaged_or_edited_run_are_one_line(damage, run, tmp_path):
    """A copy of the run with one file damaged or edited by hand: ``fp8-recipes export`` and scripts/eval_checkpoint.py
    each end in one ``error:`` line naming their argument and the damage, no traceback, nothing written."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("tb"))
    says = DAMAGES[damage](copy)
    out, parity = tmp_path / "hf", tmp_path / "parity.json"
    for cmd, key in (([sys.executable, "-m", "fp8_recipes.cli", "export", str(copy), "--to", "hf", str(out)], "SOURCE"),
                     ([sys.executable, "scripts/eval_checkpoint.py", str(copy), "--out", str(parity)], "run_dir")):
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert len(errors) == 1 and errors[0] == proc.stderr.strip().splitlines()[-1], proc.stderr[-3000:]
        assert errors[0].startswith(f"error: {'data.path' if says.startswith('data.path') else key}: ") and \
            says in errors[0], errors[0]
        assert not out.exists() and not parity.exists()
