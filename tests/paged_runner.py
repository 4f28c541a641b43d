"""Runs a DeepseekForCausalLM request by request through the paged KV cache, the way the scheduler will."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from plugserve.core.config import ModelConfig
from plugserve.core.dispatch import prepare_attention
from plugserve.core.distributed import SINGLE, ParallelGroup, dp_groups, real_rows
from plugserve.core.forward_batch import ForwardBatch, ForwardMode
from plugserve.core.kv_cache import MLAKVPool, PageAllocator, pages_needed
from plugserve.core.loader import load_model, read_config
from plugserve.core.models.deepseek import DeepseekForCausalLM, ModelBackends
from plugserve.plugins.attention.torch_ref import TorchRefAttention
from plugserve.plugins.gemm.torch_ref import TorchRefFp8Gemm
from plugserve.plugins.moe.torch_ref import TorchRefMoE


@dataclass
class Request:
    tokens: list[int] = field(default_factory=list)  # every token whose KV is cached
    pages: list[int] = field(default_factory=list)


class PagedRunner:
    def __init__(self, model: DeepseekForCausalLM, page_size: int = 4, num_pages: int = 256) -> None:
        config = model.config
        dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
        self.model, self.page_size, self.device = model, page_size, device
        self.pool = MLAKVPool(model.num_kv_layers, num_pages, page_size, config.kv_lora_rank, config.qk_rope_head_dim,
                              dtype, device)
        self.allocator = PageAllocator(num_pages)
        # Scramble page order, so that requests' pages are neither contiguous nor increasing.
        self.allocator.alloc(num_pages)
        self.allocator.free(torch.randperm(num_pages, generator=torch.Generator().manual_seed(0)).tolist())

    @torch.no_grad()
    def step(self, mode: ForwardMode, requests: list[Request], new_tokens: list[list[int]],
             dp_tokens: list[int] | None = None, **dispatch) -> torch.Tensor:
        """Append `new_tokens[i]` to `requests[i]`, run one forward, return logits [sum(new), vocab] float32.
        Under DP attention `dp_tokens` has each rank's new-token count (an IDLE step runs no request), and the
        logits are every rank's, [sum(dp_tokens), vocab]."""
        for request, new in zip(requests, new_tokens, strict=True):
            total = len(request.tokens) + len(new)
            request.pages += self.allocator.alloc(pages_needed(total, self.page_size) - len(request.pages))
        max_pages = max((len(r.pages) for r in requests), default=1)
        block_table = torch.zeros(len(requests), max_pages, dtype=torch.int32)
        for row, request in enumerate(requests):
            block_table[row, : len(request.pages)] = torch.tensor(request.pages)
        seq_lens = [len(r.tokens) + len(n) for r, n in zip(requests, new_tokens, strict=True)]
        batch = ForwardBatch.build(mode, seq_lens, [len(n) for n in new_tokens], block_table.to(self.device), self.pool)
        batch.dp_tokens = dp_tokens
        if dp_tokens is not None:  # as the model runner: the gathers' padding rows kept out of the routed experts
            batch.dp_real_rows = real_rows(dp_tokens, max(dp_tokens)).to(self.device)
        if mode is not ForwardMode.IDLE:
            prepare_attention(batch, **dispatch)
        ids = torch.tensor([t for n in new_tokens for t in n], dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(self.model(ids, batch), dp_tokens)
        for request, new in zip(requests, new_tokens, strict=True):
            request.tokens += new
        self.last_batch = batch
        return logits


def reference_backends(config: ModelConfig, dtype: torch.dtype, device: str = "cpu", tp_size: int = 1,
                       ep_size: int = 1, ep_rank: int = 0, dp_size: int = 1) -> ModelBackends:
    """The torch reference backend of every kind, built for `config` split over `tp_size` ranks (the routed
    experts of rank `ep_rank` of `ep_size` under expert parallelism; under DP attention's `dp_size` groups the
    heads split over a group's tp_size / dp_size ranks)."""
    dev = torch.device(device)
    attention = config.attention_spec(dtype, tp_size=tp_size // dp_size)
    return ModelBackends(
        attention_prefill=TorchRefAttention(attention, dev),
        attention_decode=TorchRefAttention(attention, dev),
        moe=TorchRefMoE(config.moe_spec(dtype, tp_size, ep_size, ep_rank), dev) if config.n_routed_experts else None,
        gemm=TorchRefFp8Gemm(config.gemm_spec(dtype), dev) if config.fp8_block else None,
    )


def load_reference_model(model_dir, dtype: torch.dtype = torch.float32, load_format: str = "auto",
                         group: ParallelGroup = SINGLE, expert_parallel: bool = False, dp_size: int = 1,
                         draft_model_path: str | None = None, **read) -> DeepseekForCausalLM:
    """read_config(**read) + load_model from `model_dir` on the CPU with the reference backends: this rank's
    part of the model split over `group` (the routed experts whole when `expert_parallel`, the attention over a DP
    group's ranks under DP attention's `dp_size` groups: collective when a group has several), its NextN layer from
    `draft_model_path` when given."""
    config, checkpoint_layers = read_config(str(model_dir), None, **read)
    ep_size, ep_rank = (group.world_size, group.rank) if expert_parallel else (1, 0)
    backends = reference_backends(config, dtype, tp_size=group.world_size, ep_size=ep_size, ep_rank=ep_rank,
                                  dp_size=dp_size)
    return load_model(config, backends, model_path=str(model_dir), checkpoint_layers=checkpoint_layers,
                      load_format=load_format, dtype=dtype, device=torch.device("cpu"), group=group,
                      expert_parallel=expert_parallel, dp=dp_groups(group, dp_size) if dp_size > 1 else None,
                      draft_model_path=draft_model_path)
