"""The one import surface for plugin authors: every name a backend needs, from the modules that define them."""

from plugserve.core.device_match import DeviceMatch, closest_measured, measured_device_keys
from plugserve.core.forward_batch import AttnForwardMethod, DraftTree, ForwardBatch, ForwardMode, Phase, PrefixChunk
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import (
    OK,
    AttentionBackend,
    AttentionCapabilities,
    Availability,
    Backend,
    Capabilities,
    Fp8GemmBackend,
    GemmCapabilities,
    MoEBackend,
    MoECapabilities,
    MoEWeights,
    check_tensor,
)
from plugserve.core.kv_cache import MLAKVPool, pages_needed, sequence_slots, store_rows, token_slots
from plugserve.core.layers.quant import (
    FP8_DTYPE,
    FP8_MAX,
    SCALE_EPS,
    ceil_div,
    dequantize_block_fp8,
    per_token_group_quant_fp8,
    quantize_block_fp8,
    scale_grid,
)
from plugserve.core.specs import AttentionSpec, GemmSpec, MoESpec, RouterConfig
from plugserve.registry import hookimpl

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "OK",
    "SCALE_EPS",
    "AttentionBackend",
    "AttentionCapabilities",
    "AttentionSpec",
    "AttnForwardMethod",
    "Availability",
    "Backend",
    "Capabilities",
    "DeviceMatch",
    "DraftTree",
    "ForwardBatch",
    "ForwardMode",
    "Fp8GemmBackend",
    "GemmCapabilities",
    "GemmSpec",
    "Hardware",
    "MLAKVPool",
    "MoEBackend",
    "MoECapabilities",
    "MoESpec",
    "MoEWeights",
    "Phase",
    "PrefixChunk",
    "RouterConfig",
    "ceil_div",
    "check_tensor",
    "closest_measured",
    "dequantize_block_fp8",
    "hookimpl",
    "measured_device_keys",
    "pages_needed",
    "per_token_group_quant_fp8",
    "quantize_block_fp8",
    "scale_grid",
    "sequence_slots",
    "store_rows",
    "token_slots",
]
