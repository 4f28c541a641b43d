"""The start-up self-check passes the Triton kernels (interpreted) and fails a subtly wrong backend."""

import logging

import pytest
import torch

from plugserve.conformance.self_check import self_check
from plugserve.core.forward_batch import Phase
from plugserve.core.specs import AttentionSpec, GemmSpec, MoESpec, RouterConfig
from plugserve.plugins.attention.triton import TritonAttention
from plugserve.plugins.gemm.torch_ref import TorchRefFp8Gemm
from plugserve.plugins.gemm.triton import TritonFp8Gemm
from plugserve.plugins.moe.configs import config_device
from plugserve.plugins.moe.triton import TritonMoE

CPU = torch.device("cpu")
SMALL_ATTENTION = AttentionSpec(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                v_head_dim=16, dtype=torch.float32, page_size=16)


@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
def test_triton_attention_passes(phase):
    self_check(TritonAttention(SMALL_ATTENTION, CPU), phase)


def test_triton_gemm_and_moe_pass():
    self_check(TritonFp8Gemm(GemmSpec(dtype=torch.float16), CPU), Phase.DECODE)
    router = RouterConfig(16, 4, "sigmoid", "noaux_tc", 4, 2, True)
    self_check(TritonMoE(MoESpec(dtype=torch.float16, router=router), CPU), Phase.DECODE)


def test_a_gemm_dropping_the_weight_scales_fails():
    class NoScales(TorchRefFp8Gemm):
        name = "no_scales"

        def prepare(self, weight, weight_scale_inv):
            return super().prepare(weight, torch.ones_like(weight_scale_inv))

    with pytest.raises(AssertionError, match="no_scales self-check: block-FP8 GEMM"):
        self_check(NoScales(GemmSpec(dtype=torch.float32), CPU), Phase.DECODE)


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_triton_moe_passes_holding_one_ranks_experts(ep_rank):
    """Under expert parallelism the backend holds E / ep_size experts: the self-check prepares those, as the
    model does, and expects only their terms."""
    router = RouterConfig(16, 4, "sigmoid", "noaux_tc", 4, 2, True)
    self_check(TritonMoE(MoESpec(dtype=torch.float16, router=router, ep_size=2, ep_rank=ep_rank), CPU), Phase.DECODE)


def test_decode_is_checked_at_a_wide_batch_too():
    """A backend may launch another kernel for wide batches (the Triton attention's Gluon block for fewer than 64
    heads): one that is wrong only there fails."""

    class WrongWhenWide(TritonAttention):
        name = "wrong_when_wide"

        def forward_mla(self, q_nope, q_rope, layer_id):
            out = super().forward_mla(q_nope, q_rope, layer_id)
            return out * 1.01 if q_nope.shape[0] >= 8 else out

    with pytest.raises(AssertionError, match=r"wrong_when_wide self-check: forward_mla \(DECODE, 16 requests\)"):
        self_check(WrongWhenWide(SMALL_ATTENTION, CPU), Phase.DECODE)


def test_the_probes_config_lookups_are_not_logged(caplog):
    """The probes' small expert shapes have no tuned configs; saying so would read as the model's shapes."""
    config_device.cache_clear()  # it logs once per shape
    router = RouterConfig(16, 4, "sigmoid", "noaux_tc", 4, 2, True)
    with caplog.at_level(logging.INFO):
        self_check(TritonMoE(MoESpec(dtype=torch.float16, router=router), CPU), Phase.DECODE)
    assert not [r for r in caplog.records if r.name.startswith("plugserve.plugins")]
    assert logging.getLogger("plugserve.plugins").level == logging.NOTSET  # restored
