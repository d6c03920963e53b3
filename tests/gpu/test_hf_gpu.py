"""From and to Hugging Face on the H200 (issue 16): a Llama-shaped model trained with ``+recipe=blockwise`` on
Transformer Engine, exported with ``fp8-recipes export ... --to hf`` and loaded by ``transformers`` on the GPU.

- BF16 export: transformers' logits equal our TE model's (every GEMM BF16) within BF16 rounding; greedy decoding
  of 32 tokens gives the same tokens.
- FP8 export (128x128 blocks): transformers' dequantized weights (``FineGrainedFP8Config(dequantize=True)``) are
  exactly our numerics core's quantize/dequantize of the trained BF16 weights, and our model holding them gives
  transformers' logits and the same 32 greedy tokens.
- FP8 export run by transformers' own FP8 kernels (H200: block-scaled FP8 GEMMs, activations quantized per 1x128)
  against our model running the same blocks in FP8 through TE: the greedy tokens agree; the logit gap is reported
  (where transformers can fetch its kernels: they come from the Hugging Face Hub).
- What the FP8 export saves on disk, measured (and checked against the count of projection parameters).

Every measured number goes to $OUT/hf_gpu.json (the test prints it too).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from fp8_recipes.backends.te import te_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                                                  reason="needs a CUDA GPU with Transformer Engine")]
transformers = pytest.importorskip("transformers", reason='the hf extra: pip install -e ".[hf]"')
from safetensors.torch import load_file  # noqa: E402  (the hf extra)

from fp8_recipes.integrations.hf_llama import _fp8_policy  # noqa: E402
from fp8_recipes.numerics import fake_quant  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_hf_cpu import NEW_TOKENS, PANGRAM, greedy, their_logits  # noqa: E402  (the CPU test's parity helpers)

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
# Llama-3's layer layout at a size whose every projection is a whole number of 128x128 blocks (head dim 128, as
# Llama's, so no block straddles q/k/v): 4 layers, hidden 512, 4 query heads in 2 KV groups, SwiGLU 1536.
LLAMA = ["model=llama3_8b_8l", "model.num_layers=4", "model.hidden_size=512", "model.ffn_hidden_size=1536",
         "model.num_attention_heads=4", "model.num_query_groups=2", "model.seq_length=256", "model.vocab_size=null"]
RESULTS: dict = {}


def _out() -> Path:
    out = Path(os.environ.get("OUT", "runs/gpu"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _record(key: str, value) -> None:
    RESULTS[key] = value
    (_out() / "hf_gpu.json").write_text(json.dumps(RESULTS, indent=2))
    print(f"hf_gpu: {key} = {value}")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """80 steps of +recipe=blockwise on TE over a pangram corpus (bytes tokenizer), the last checkpoint saved."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from fp8_recipes.megatron.data import prepare_dataset
    from fp8_recipes.recipe.pack import conf_dir
    from fp8_recipes.training.run import run_training

    root = tmp_path_factory.mktemp("pangram")
    (root / "corpus").mkdir()
    for n in range(20):
        (root / "corpus" / f"{n:02d}.txt").write_bytes(PANGRAM * 40)
    prepare_dataset(str(root / "corpus"), root / "bytes", tokenizer_kind="bytes")
    run_dir = root / "run"
    overrides = ["+recipe=blockwise", "trainer=gpu", *LLAMA, "trainer.max_steps=80", "trainer.warmup_steps=5",
                 "trainer.micro_batch_size=8", "trainer.global_batch_size=8", "trainer.lr=3e-3",
                 "trainer.min_lr=3e-4", "trainer.eval_interval=0", "trainer.eval_iters=1",
                 f"data.path={root / 'bytes'}", f"data.inputs={root / 'corpus'}", "data.tokenizer=bytes",
                 "data.split='80,10,10'", f"run_dir={run_dir}"]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    with pytest.MonkeyPatch.context() as mp:
        for var in LAUNCH_VARS:
            mp.delenv(var, raising=False)
        summary = run_training(cfg)
    _record("train_final_loss", summary.get("final_loss"))
    (run_dir / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    return run_dir


@pytest.fixture(scope="module")
def exports(run, tmp_path_factory) -> dict[str, Path]:
    from fp8_recipes.training.hf import export_hf

    root = tmp_path_factory.mktemp("hf_out")
    return {"bf16": export_hf(run, root / "bf16", progress=lambda _: None),
            "fp8": export_hf(run, root / "fp8", dtype="fp8", progress=lambda _: None)}


@pytest.fixture
def ours(run, megatron_gpu):
    """(our TE model holding the run's last checkpoint, its precision, its model config)."""
    from fp8_recipes.megatron.model_config import run_model_cfg
    from fp8_recipes.plan.precision import Hardware
    from fp8_recipes.recipe.pack import load_recipe
    from fp8_recipes.rundir import load_run_config
    from fp8_recipes.training.checkpoint import load_checkpoint
    from fp8_recipes.training.run import attach_te

    cfg = load_run_config(run)
    data = Path(cfg.data.path)
    model_cfg = run_model_cfg(cfg, json.loads((data / "meta.json").read_text()), data)
    chunks, _, precision = attach_te(model_cfg, load_recipe("blockwise"), Hardware.detect(), torch.bfloat16,
                                     torch.device("cuda"))
    step = load_checkpoint(run, models=chunks, precision=precision, restore_rng=False)
    precision.begin_step(step)  # the recipe's last stage: every planned GEMM FP8
    for chunk in chunks:
        chunk.eval()
    return chunks, precision, model_cfg


def prompt() -> torch.Tensor:
    return torch.tensor([list(PANGRAM[:30])], device="cuda")  # the bytes tokenizer: ids = bytes


def our_logits(chunks, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Our logits for ``ids``. TE's FP8 GEMMs need a token count divisible by 16: the sequence is padded on the
    right, which changes no logit of the tokens before (causal attention; activations quantized per token)."""
    n = ids.shape[1]
    padded = torch.nn.functional.pad(ids, (0, -n % 16))
    pos = torch.arange(padded.shape[1], device=ids.device).expand_as(padded)
    with torch.no_grad():
        return chunks[0](padded, pos, None)[:, :n, :vocab].float()


def load_hf(path: Path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda",
                                                             **kwargs).eval()


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest logit gap in BF16 ulps at the logits' largest magnitude."""
    ulp = 2.0 ** (math.floor(math.log2(a.abs().max().item())) - 7)
    return (a - b).abs().max().item() / ulp


def parity(name: str, ours_of, theirs_of, bound_ulps: float | None) -> None:
    ids = prompt()
    gap = ulps(ours_of(ids), theirs_of(ids))
    mine, theirs = greedy(ours_of, ids), greedy(theirs_of, ids)
    _record(name, {"logit_gap_bf16_ulps": round(gap, 2), "greedy_equal": mine == theirs,
                   "distinct_tokens": len(set(mine)), "ours": bytes(mine).decode(errors="replace")})
    assert mine == theirs, (mine, theirs)
    assert len(set(mine)) > 1  # a model that says one token over and over would agree trivially
    if bound_ulps is not None:
        assert gap <= bound_ulps, gap


def test_bf16_export_gives_our_logits_in_transformers(exports, ours):
    """Our TE model with every GEMM in BF16 against transformers' BF16 Llama on the same GPU. Each of the 4 layers
    rounds its residual stream, norms and attention to BF16 in its own kernels' order (TE's fused attention and
    norms here, PyTorch's SDPA there): 8 BF16 ulps at the logits' largest magnitude (a wrong mapping is off by the
    logits' whole size, hundreds of ulps)."""
    chunks, precision, model_cfg = ours
    vocab = model_cfg["vocab_size"]
    hf_model = load_hf(exports["bf16"])
    with precision.high_precision():
        parity("bf16_export", lambda x: our_logits(chunks, x, vocab), lambda x: their_logits(hf_model, x), 8)


def test_fp8_export_dequantized_matches_our_model_with_the_quantized_weights(exports, ours):
    from fp8_recipes.training.hf import load_hf_weights

    chunks, precision, model_cfg = ours
    out = exports["fp8"]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    saved = load_file(out / "model-00001-of-00001.safetensors")
    bf16 = load_file(exports["bf16"] / "model-00001-of-00001.safetensors")
    hf_model = load_hf(out, quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    checked = 0
    for i, layer in enumerate(hf_model.model.layers):
        for module, proj in [("self_attn", p) for p in "qkvo"] + [("mlp", p) for p in ("gate", "up", "down")]:
            key = f"model.layers.{i}.{module}.{proj}_proj.weight"
            assert saved[key].dtype == torch.float8_e4m3fn
            weight = getattr(getattr(layer, module), f"{proj}_proj").weight
            assert torch.equal(weight.cpu(), fake_quant(bf16[key], _fp8_policy((128, 128))))
            checked += 1
    load_hf_weights(chunks, out, model_cfg)  # our model holding the quantized weights (model.init_from's loader)
    vocab = model_cfg["vocab_size"]
    with precision.high_precision():
        parity("fp8_export_dequantized", lambda x: our_logits(chunks, x, vocab),
               lambda x: their_logits(hf_model, x), 8)
    _record("fp8_projections_checked", checked)


def test_fp8_export_on_transformers_fp8_kernels_agrees_with_our_fp8_model(exports, ours):
    """transformers' own FP8 path (block-scaled FP8 GEMMs, activations quantized per 1x128 with amax/448 scales)
    against our model running the same 128x128 weight blocks in FP8 through TE (activations per 1x128 with
    power-of-two scales): two FP8 computations of one model, so only the greedy tokens must agree.

    transformers 5.24 runs these GEMMs through the ``kernels`` package, which downloads the kernel from the Hugging
    Face Hub at load time: on a machine without network (our H200) this test cannot run and says so."""
    from fp8_recipes.training.hf import load_hf_weights

    pytest.importorskip("kernels", reason="transformers' FP8 GEMMs need the kernels package (0.16.x) and the Hugging "
                                          "Face Hub to fetch the kernel; the GPU machine has neither")
    chunks, precision, model_cfg = ours
    hf_model = load_hf(exports["fp8"])
    fp8_linears = sum(1 for m in hf_model.modules() if getattr(m, "weight", None) is not None
                      and m.weight.dtype == torch.float8_e4m3fn)
    _record("transformers_fp8_linears", fp8_linears)
    assert fp8_linears == 7 * model_cfg["num_layers"]  # transformers really keeps the projections in FP8
    load_hf_weights(chunks, exports["fp8"], model_cfg)
    precision.after_optimizer_step(0)  # new weights: TE quantizes them again at the next forward
    vocab = model_cfg["vocab_size"]
    parity("fp8_export_fp8_kernels", lambda x: our_logits(chunks, x, vocab), lambda x: their_logits(hf_model, x),
           None)


def test_what_the_fp8_export_saves_on_disk(exports, run):
    """Measured file sizes; the saving equals one byte per projection parameter (BF16 2 bytes -> FP8 1 byte) less
    the float32 scales of the 128x128 blocks."""
    sizes = {k: sum(p.stat().st_size for p in v.glob("*.safetensors")) for k, v in exports.items()}
    saved = load_file(exports["fp8"] / "model-00001-of-00001.safetensors")
    codes = sum(t.numel() for k, t in saved.items() if t.dtype == torch.float8_e4m3fn)
    scales = sum(t.numel() * 4 for k, t in saved.items() if k.endswith("_scale_inv"))
    _record("disk_bytes", {**sizes, "fp8_codes": codes, "scale_bytes": scales,
                           "saving_pct": round(100 * (1 - sizes["fp8"] / sizes["bf16"]), 1)})
    # safetensors headers differ by a few KiB (more tensor names in the FP8 file)
    assert abs((sizes["bf16"] - sizes["fp8"]) - (codes - scales)) < 64 * 1024
