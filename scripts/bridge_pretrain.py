"""Megatron-Bridge pretraining of a small GPT on mock data with an fp8-recipes recipe (GPU + TE + megatron-bridge).

    torchrun --nproc-per-node 1 scripts/bridge_pretrain.py                    # recipe hybrid, 40 steps
    torchrun --nproc-per-node 8 scripts/bridge_pretrain.py --recipe safe --steps 400
    torchrun --nproc-per-node 1 scripts/bridge_pretrain.py --recipe moe_blockwise --moe mixtral_8x7b_4l
                                                     # the small GPT with a conf/model's MoE keys (8 experts, top-2)
    python scripts/bridge_pretrain.py --dry-run --compute-capability 9.0     # what would run on an H200 (any
                                                                              # machine where megatron-bridge imports)

The recipe becomes Bridge's MixedPrecisionConfig when Megatron-Core's own config can express it (``hybrid`` on
an H100/H200: ``fp8="hybrid", fp8_recipe="blockwise"``, the plan's substitutions logged), otherwise BF16 plus the
FP8RecipeCallback that runs BF16 warmup, stages and per-layer BF16 (``safe``). See docs/nemo.md.
Run on one H200 with megatron-bridge 0.6.2 (recipes hybrid and a shortened safe, 40 steps each): docs/nemo.md.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from fp8_recipes.checks import OneLineArgumentParser  # (one error line for a usage error)

    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="hybrid", help="pack name or YAML path (default: hybrid)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers", type=int, default=8, help="transformer layers of the small GPT (hidden 1024)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--moe", metavar="MODEL", default=None, help="a conf/model name whose Mixture-of-Experts keys go "
                   "onto the small GPT (apply_moe), e.g. mixtral_8x7b_4l (8 experts of FFN 14336, top-2, alltoall)")
    p.add_argument("--out", default="runs/bridge", help="tensorboard / logs directory")
    p.add_argument("--dry-run", action="store_true", help="print the precision settings and exit")
    p.add_argument("--compute-capability", default=None, metavar="MAJOR.MINOR",
                   help="the GPU the job runs on (default: this machine's); e.g. 9.0 for a --dry-run on a CPU")
    return p.parse_args(argv)


def small_gpt(layers: int, seq: int):
    """A ~200M-parameter Llama-style GPT (Bridge's GPTModelProvider: TE layer spec when TE is installed)."""
    import torch.nn.functional as F
    from megatron.bridge.models import GPTModelProvider

    return GPTModelProvider(num_layers=layers, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16,
                            num_query_groups=8, seq_length=seq, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=F.silu, position_embedding_type="rope", add_bias_linear=False,
                            share_embeddings_and_output_weights=False, vocab_size=32768,
                            make_vocab_size_divisible_by=128)


def build_config(args: argparse.Namespace):
    from megatron.bridge.recipes.common import _pretrain_common

    cfg = _pretrain_common()  # Bridge's own pretraining defaults (mock data when no blend is given)
    cfg.model = small_gpt(args.layers, args.seq)
    if args.moe:  # our MoE keys onto Bridge's provider (TransformerConfig fields of the same names), checked
        from fp8_recipes.integrations.bridge import apply_moe

        apply_moe(cfg.model, args.moe)
    cfg.model.gradient_accumulation_fusion = False  # needs APEX's fused_weight_gradient_mlp_cuda (pip installs lack it)
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model = "NullTokenizer", None
    cfg.tokenizer.vocab_size = cfg.model.vocab_size
    cfg.dataset.seq_length = args.seq
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = args.steps, 16, 2
    cfg.scheduler.lr_warmup_iters = max(1, args.steps // 10)
    cfg.validation.eval_interval, cfg.validation.eval_iters = args.steps, 2
    cfg.logger.log_interval, cfg.logger.tensorboard_dir = 1, f"{args.out}/tb"
    cfg.checkpoint.save = cfg.checkpoint.load = None  # a demo: nothing to resume
    return cfg


def main(argv: list[str] | None = None) -> int:
    from fp8_recipes.integrations.bridge import apply_recipe
    from fp8_recipes.recipe.schema import RecipeError

    args = parse_args(argv)
    try:
        cfg = build_config(args)
    except ValueError as e:  # apply_moe: a bad MoE key or model name, one line
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    except ImportError as e:  # Bridge missing, or present without the Transformer Engine it imports
        print(f"error: megatron-bridge: cannot import ({e}); install it with Transformer Engine on a GPU machine "
              f"(pip install -e '.[bridge,gpu]', see docs/nemo.md)", file=sys.stderr)
        return 2
    try:
        cc = tuple(int(v) for v in args.compute_capability.split(".")) if args.compute_capability else None
        callbacks = apply_recipe(cfg, args.recipe, compute_capability=cc)
    except RecipeError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    mp = cfg.mixed_precision
    moe = f" experts={cfg.model.num_moe_experts} top-{cfg.model.moe_router_topk}" if args.moe else ""
    print(f"recipe {args.recipe}: fp8={mp.fp8!r} fp8_recipe={mp.fp8_recipe!r} "
          f"factory={mp.fp8_quantizer_factory!r} callbacks={[type(c).__name__ for c in callbacks]}{moe}")
    if args.dry_run:
        return 0
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from fp8_recipes.integrations.bridge import use_prebuilt_dataset_helpers

    use_prebuilt_dataset_helpers()  # Bridge 0.6.2 would `make` helpers a pip-installed Megatron-Core ships built
    pretrain(cfg, forward_step, callbacks=callbacks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
