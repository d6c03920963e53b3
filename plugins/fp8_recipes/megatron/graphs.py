"""Megatron-Core's per-layer CUDA graphs through Transformer Engine, captured on the engine's model as Megatron-LM's
training loop does at ``--cuda-graph-impl transformer_engine`` (model keys cuda_graph_impl, cuda_graph_modules,
cuda_graph_warmup_steps: megatron/model_config.py).

    init_distributed(..., cuda_graphs=True)          # TE's RNG tracker and a side stream, before the model exists
    graphs = LayerGraphs(engine, seq_length=4096, micro_batch_size=1, global_batch_size=8)
    ...                                              # eager steps
    precision.begin_step(step); graphs.capture(precision); engine.train_step(...)   # replayed from then on

Each layer's scopes are captured once (TECudaGraphHelper: one graph per layer and micro-batch of a step; with one
pipeline stage one micro-batch's, replayed for each) and replayed by the layers' own ``__call__`` in training mode;
evaluation runs eager. Under this project's TE backend the capture takes the plan's quantization arguments
(TEPrecision.graph_capture: per layer FP8 or not, its one TE recipe object, cached FP8 weights, the amax group), not
those of Megatron-Core's FP8 config, which that backend leaves unset; the replay runs under each layer's autocast
(backends/te.py wraps Megatron-Core's replay as it wraps the forward). What a graph holds cannot change after the
capture: the training loop captures once the recipe's last stage has begun, and training/run.py refuses what would
change it (the autopilot, the BF16 fallback, statistics hooks inside the graphs).

Needs a GPU and Transformer Engine; imports Megatron-Core's helper only when built.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LayerGraphs", "graph_side_stream"]


def graph_side_stream() -> None:
    """Make a side stream the process's current stream, before the model, DDP and the eager steps exist, as
    Megatron-LM's initialize does for --cuda-graph-impl transformer_engine. DDP keeps each parameter's AccumulateGrad
    node, and torch (2.11) runs a node on the stream current at its creation; TE captures the backward with
    torch.autograd.backward, so the captured gradients reach those nodes, and a node made on the default (legacy)
    stream cannot join the capture ("operation would make the legacy stream depend on a capturing blocking stream",
    measured on an H100 on 2026-12-06). A side stream joins it (docs/facts.md, "Transformer Engine's CUDA graphs
    under Megatron-Core's DDP")."""
    torch.cuda.set_stream(torch.cuda.Stream())


class LayerGraphs:
    """The engine's layers' graphs: built beside the engine, captured once by :meth:`capture`."""

    def __init__(self, engine: Any, *, seq_length: int, micro_batch_size: int, global_batch_size: int) -> None:
        from megatron.core.num_microbatches_calculator import (init_num_microbatches_calculator,
                                                               unset_num_microbatches_calculator)
        from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

        class PlanGraphHelper(TECudaGraphHelper):
            def _get_cuda_graph_input_data(helper):  # noqa: N805 - the helper, beside this object's self
                sample_args, kwargs = super()._get_cuda_graph_input_data()
                kwargs.update(self._capture_kwargs(helper.config,
                                                   [c.layer_number - 1 for c in helper.flattened_callables]))
                return sample_args, kwargs

        # (the helper reads Megatron-Core's micro-batch calculator, which Megatron-LM initialises and this plugin's
        # engine does not otherwise use)
        unset_num_microbatches_calculator()
        init_num_microbatches_calculator(0, None, global_batch_size, micro_batch_size, engine.dp_size)
        from megatron.core import parallel_state as ps

        self._engine, self._precision, self._clone_param_grads = engine, None, False
        self._stages = ps.get_pipeline_model_parallel_world_size()
        self._helper = PlanGraphHelper(model=engine.chunks, config=engine.config, seq_length=seq_length,
                                       micro_batch_size=micro_batch_size, optimizers=[engine.optimizer])

    def capture(self, precision: Any, *, clone_param_grads: bool = False) -> None:
        """Capture every layer's graphs now (after ``precision.begin_step``: the plan's stage is the one the graphs
        keep), with DDP's forward pre-hooks off during the capture and set by hand on the graphed modules after it,
        as Megatron-LM does. ``precision``: this project's backend (its graph_capture) or None (BF16 or
        Megatron-Core's own FP8 config). ``clone_param_grads``: Megatron-Core 0.19.2's capture as it is (the
        benchmark's ``:raw`` configs), see :meth:`_capture_kwargs`."""
        engine = self._engine
        self._precision = precision if hasattr(precision, "graph_capture") else None
        self._clone_param_grads = clone_param_grads
        hooks = all(getattr(chunk, "use_forward_hook", False) for chunk in engine.chunks)  # (with param gather)
        if hooks:
            for chunk in engine.chunks:
                chunk.disable_forward_pre_hook(param_sync=False)
        self._helper.create_cudagraphs()
        if self._precision is not None:
            self._precision.graphs_captured()  # (the delayed state as the step found it)
        if hooks:
            for chunk in engine.chunks:
                chunk.enable_forward_pre_hook()
            self._helper.cuda_graph_set_manual_hooks()
        if not self._helper.graphs_created() and self._stages == 1:
            # (with several pipeline stages a stage may hold none of the scopes' layers, and its peers go on)
            raise RuntimeError("cuda graphs: Megatron-Core's TECudaGraphHelper found no layer to capture")

    def _capture_kwargs(self, config: Any, layers: list[int]) -> dict[str, Any]:
        """What this project adds to Megatron-Core's make_graphed_callables arguments: the plan's (TE recipe, FP8
        per layer, cached weights, amax group: TEPrecision.graph_capture) for ``layers``, the callables' layer
        indexes; and, where Megatron-Core's gradient_accumulation_fusion is on, ``clone_param_grads_on_return=False``.
        TE 2.20.2 clones every weight gradient a graph's backward returns (its default), and Megatron-Core 0.19.2
        keeps that default; under the fusion the wgrad GEMMs have written into DDP's main_grad inside the graph and
        the returned weight gradients are placeholders that DDP's gradient hook drops (the others, a norm's or the
        router's, it adds to main_grad in that hook, before the graph replays again). The clone copied the size of
        every expert weight per layer and micro-batch: 32 ms of a 425 ms step on 2 Mixtral layers (H100,
        2026-12-07, docs/benchmarks.md)."""
        kwargs = self._precision.graph_capture(layers) if self._precision is not None else {}
        if getattr(config, "gradient_accumulation_fusion", False) and not self._clone_param_grads:
            kwargs["clone_param_grads_on_return"] = False
        return kwargs

    def delete(self) -> None:
        """Free the graphs (Megatron-LM's end of training)."""
        if self._helper.graphs_created():
            self._helper.delete_cuda_graphs()
