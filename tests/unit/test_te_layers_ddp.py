"""Modules the TE backend adds to a model that Megatron-Core's DDP already wraps with its forward pre-hooks
(``overlap_param_gather`` with the distributed optimizer, as Megatron-Bridge's callback attaches after wrapping):
DDP's ``disable_forward_pre_hook`` looks every module up, and an added one (the experts' ``Fp8Padding``) raised
KeyError in Bridge's pretrain on the H100. On the CPU, one rank, a real DDP."""

from __future__ import annotations

import pytest
import torch

from fp8_recipes.megatron.model import unwrap_model
from fp8_recipes.megatron.te_layers import _hook_new_modules
from tiny_engine import tiny_engine

TRAINER = {"micro_batch_size": 4, "global_batch_size": 4, "use_distributed_optimizer": True,
           "overlap_grad_reduce": True, "overlap_param_gather": True}


def test_without_the_hook_ddp_cannot_disable_its_hooks():
    with tiny_engine(TRAINER) as engine:
        ddp = engine.chunks[0]
        assert ddp.remove_forward_pre_hook_handles  # the hooks are on: the case Bridge runs in
        unwrap_model(ddp).decoder.padding = torch.nn.Identity()  # as _pad_expert_tokens adds Fp8Padding
        with pytest.raises(KeyError):
            ddp.disable_forward_pre_hook(param_sync=False)


def test_modules_added_after_ddp_get_its_forward_pre_hook_and_removed_ones_lose_it():
    with tiny_engine(TRAINER) as engine:
        ddp = engine.chunks[0]
        gpt = unwrap_model(ddp)
        gpt.decoder.padding = torch.nn.Identity()
        _hook_new_modules(engine.chunks)
        old = gpt.decoder.padding
        gpt.decoder.padding = torch.nn.Identity()  # a module replaced by a later attach: its hook must go too,
        _hook_new_modules(engine.chunks)            # or DDP's count check after removing the hooks fails
        handles = ddp.remove_forward_pre_hook_handles
        assert set(handles) == set(ddp.module.modules()) and old not in handles
        assert not old._forward_pre_hooks and len(gpt.decoder.padding._forward_pre_hooks) == 1
        _hook_new_modules(engine.chunks)  # idempotent: no second hook
        assert len(gpt.decoder.padding._forward_pre_hooks) == 1
        ddp.disable_forward_pre_hook(param_sync=False)  # no KeyError, and every handle went
        assert not handles and not gpt.decoder.padding._forward_pre_hooks


def test_chunks_without_hooks_are_left_alone():
    with tiny_engine({"micro_batch_size": 4, "global_batch_size": 4}) as engine:
        ddp = engine.chunks[0]
        before = dict(ddp.remove_forward_pre_hook_handles)
        unwrap_model(ddp).decoder.padding = torch.nn.Identity()
        _hook_new_modules(engine.chunks)
        _hook_new_modules([unwrap_model(ddp)])  # a bare model (scripts/train.py attaches before wrapping)
        assert ddp.remove_forward_pre_hook_handles == before == {}
