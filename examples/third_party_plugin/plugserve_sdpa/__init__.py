"""A third-party attention backend for plugserve: absorbed-MLA decode, speculative verify and
short-prefix extend, computed by `torch.nn.functional.scaled_dot_product_attention`.

It runs only the absorbed-MLA method, like FlashMLA: `plugserve` pairs it, as the decode backend,
with another backend for MHA prefill. Check it with the conformance kit:

    pytest --pyargs plugserve.conformance --plugserve-backend attention:sdpa
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from plugserve.api import (
    AttentionBackend,
    AttentionCapabilities,
    AttnForwardMethod,
    ForwardBatch,
    hookimpl,
    sequence_slots,
)


class SdpaAttention(AttentionBackend):
    name = "sdpa"
    capabilities = AttentionCapabilities(
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        devices=frozenset({"cpu", "cuda"}),
        methods=frozenset({AttnForwardMethod.MLA}),
    )
    # Above the torch reference (10 on the CPU), below real GPU kernels.
    priority: ClassVar[dict[str, int]] = {"default": 20}

    def plan(self, batch: ForwardBatch) -> None:
        super().plan(batch)
        # Per request: the slots of all its cached tokens and the visibility mask of its new tokens.
        slots = sequence_slots(batch.block_table, batch.seq_lens_cpu, batch.kv_pool.page_size)
        self._slots = slots.split(batch.seq_lens_cpu)
        self._masks = []
        for seq_len, q_len in zip(batch.seq_lens_cpu, batch.extend_lens_cpu, strict=True):
            keys = torch.arange(seq_len, device=slots.device)
            queries = torch.arange(seq_len - q_len, seq_len, device=slots.device)
            self._masks.append(keys[None, :] <= queries[:, None])  # [q_len, seq_len]

    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q_nope [T, H, R], q_rope [T, H, P] -> [T, H, R]; MQA with 576-wide keys, 512-wide values."""
        r = self.spec.kv_lora_rank
        q = torch.cat([q_nope, q_rope], dim=-1)
        out = torch.empty_like(q_nope)
        starts = self.batch.cu_extend_lens.tolist()
        for row, (slots, mask) in enumerate(zip(self._slots, self._masks, strict=True)):
            begin, end = starts[row], starts[row + 1]
            kv = self.batch.kv_pool.gather(layer_id, slots).to(q.dtype)  # [S, R + P]
            heads = q.shape[1]
            keys = kv.unsqueeze(0).expand(heads, -1, -1)  # one latent shared by every head
            values = kv[:, :r].unsqueeze(0).expand(heads, -1, -1)
            out[begin:end] = F.scaled_dot_product_attention(
                q[begin:end].transpose(0, 1), keys, values, attn_mask=mask, scale=self.spec.softmax_scale
            ).transpose(0, 1)
        return out


@hookimpl
def plugserve_backends() -> list[type[AttentionBackend]]:
    return [SdpaAttention]
