"""The Triton attention backend: every method (absorbed MLA, MHA, chunked-prefix MHA) in Triton kernels.

    forward_mla   split-KV absorbed MLA over the paged latent cache, one query token per row: serves
                  DECODE, TARGET_VERIFY, DRAFT_EXTEND and EXTEND with a cached prefix alike
    forward_mla_projected   the same, W_UV's product folded into the split reduce at decode sizes
    forward_mha   flash attention over packed (varlen) requests, returning the log-sum-exp
    merge_attn_states   one fused kernel

set_kv is the base class's (the pool write as it is): absorbed MLA then writes the pool in the model's
fused norm + rope + cache kernel (`core/layers/triton_small_ops.py`), one launch per layer for all three.

The kernels live in `mla_decode`, `mha_prefill` and `merge` (with the Gluon twins `gluon_mla` and `gluon_mha`,
which they launch on sm90 where the shapes fit), imported when the first backend is built, never at module
import: this module must import without triton, and `triton.jit` reads TRITON_INTERPRET when the
kernels are defined. On the CPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1),
which is slow and meant for tests; the torch reference keeps the higher priority there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING, ClassVar

import torch

from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import AttentionBackend, AttentionCapabilities, Availability
from plugserve.core.specs import AttentionSpec
from plugserve.plugins.triton_support import triton_availability
from plugserve.registry import hookimpl

if TYPE_CHECKING:
    from plugserve.core.kv_cache import MLAKVPool
    from plugserve.plugins.attention.mla_decode import MlaConfig


# (query token, head) rows from which fewer than 64 heads take the Gluon kernel's 64-head block (`_pads_heads`):
# 16 heads from 8 tokens, 32 from 4.
PADDED_MIN_ROWS = 128


def _tokens_per_request(batch: ForwardBatch) -> int:
    """The new tokens every request of a graph batch has (`GraphInputs`: the same for all)."""
    width = batch.extend_lens_cpu[0] if batch.extend_lens_cpu else 1
    if any(e != width for e in batch.extend_lens_cpu):
        raise ValueError(f"triton attention: graph batches have the same new tokens per request, got "
                         f"{batch.extend_lens_cpu}")
    return width


def _cumsum_with_zero(lens: torch.Tensor) -> torch.Tensor:
    """[B] lengths -> [B+1] int32 exclusive prefix sum, on the lengths' device (no host sync)."""
    cu = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = torch.cumsum(lens, 0)
    return cu


# Draft-tree nodes a request: each token's visible nodes are one int64 bit set.
MAX_TREE_NODES = 64
# forward_mla_projected: up to this many query tokens the split reduce also multiplies by W_UV (its programs grow with
# the tokens, each reading a slice of W_UV again); more tokens take forward_mla and a bmm.
FUSED_V_PROJ_MAX_TOKENS = 8


@dataclass(frozen=True)
class TritonPlan:
    """What `plan` / `plan_replay` derive from a batch for every layer of its forward.

    MLA: token_req [T] int32 (each token's block-table row), token_kv_len [T] int32 (keys the token sees), tree
    (a draft-tree batch's (tree_start [T] int32, tree_bits [T] int64), else None), num_splits (KV splits) and
    workspace (the split partials' buffers; None: forward_mla allocates them). MHA (eager plans only): max_q_len,
    and the causal call's key lengths and cu_causal_kv [B+1] int32."""

    token_req: torch.Tensor
    token_kv_len: torch.Tensor
    tree: tuple[torch.Tensor, torch.Tensor] | None
    num_splits: int
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None
    max_q_len: int = 0
    causal_kv_lens: list[int] | None = None
    cu_causal_kv: torch.Tensor | None = None


class TritonAttention(AttentionBackend):
    """MLA attention in Triton kernels: CUDA, or the CPU under TRITON_INTERPRET=1 (tests only).

    Activations fp16 / bf16 / fp32, the KV cache in the activation dtype or float8_e4m3fn (with the pool's
    per-tensor scale), any head count, head dims and page size. Accumulation is float32; fp32 dots are exact (no
    TF32), and slow: fp32 is for accuracy checks.
    forward_mla's launch parameters and KV split count are chosen on the host from the shape only
    (`mla_decode.mla_config`, `mla_num_splits`). Under CUDA graphs the split count of each captured
    size is fixed for the longest sequence a graph serves (splits past a shorter sequence's end are empty
    and cost one early exit), and the splits' partials go to one workspace allocated by init_cuda_graph.
    Batch-invariant under spec.batch_invariant (--enable-deterministic-inference, which runs every prefill as
    absorbed MLA): forward_mla splits each token's keys by its own length alone and always merges the splits in
    the reduce kernel's fixed chunks (`mla_decode.mla_fixed_num_splits`), never in the Gluon kernel, and
    forward_mla_projected is forward_mla then W_UV in fixed token tiles (`mla_project.mla_project`)."""

    name: ClassVar[str] = "triton"
    verified: ClassVar[str] = "gpu"
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        devices=frozenset({"cuda", "cpu"}),
        min_capability=(8, 0),  # bf16 tl.dot needs Ampere or newer
        # forward_mla upcasts an fp8 pool's tiles in registers (sm89+ convert fp8; the interpreter too), but for the
        # Gluon kernel's 8-bit wgmmas (`rounds_decode_to_e4m3`). The MHA paths get k / v the model dequantized.
        kv_cache_dtypes=frozenset({torch.float8_e4m3fn}),
        graph_modes=frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}),
        batch_invariant=True,  # under the spec's flag: KV splits by each token's length alone, fixed reduce chunks
        tree_verify=True,  # up to MAX_TREE_NODES nodes a request, masked per token by a 64-bit set
        graph_plan_on_device=True,  # plan_replay: token_req / token_kv_len from the static extend_lens / positions
    )
    priority: ClassVar[dict[str, int]] = {"cuda": 50, "cpu": -1}  # on the CPU (interpreter) the reference wins

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        from plugserve.plugins.attention import (  # lazily: see the module docstring
            merge,
            mha_prefill,
            mla_decode,
            mla_project,
        )

        self._mla_decode: ModuleType = mla_decode
        self._mla_project: ModuleType = mla_project
        self._mha_prefill: ModuleType = mha_prefill
        self._merge: ModuleType = merge
        hardware = Hardware.detect(device)
        self._multiprocessors = hardware.multiprocessors
        self._capability = hardware.capability
        page_size = spec.page_size or 1
        self._mla_config = self._mla_config_for(page_size)
        wide = mla_decode.mla_config(64, spec.dtype, self._capability, page_size, spec.kv_lora_rank,
                                     spec.qk_rope_head_dim, spec.kv_dtype)
        # Over an e4m3 pool, past 16 heads or on pages of whole key blocks: there the pointer kernel's upcast loop is
        # the slower from batch 8, while 16 heads on shorter pages lose with the padded launch (docs/kernels.md).
        fp8_padded = spec.num_heads > 16 or page_size % wide.block_n == 0
        padded = wide.gluon and spec.num_heads < 64 and (spec.kv_dtype in (None, spec.dtype) or fp8_padded)
        self._mla_padded_config: MlaConfig | None = wide if padded else None  # see `_pads_heads`
        # Batch-invariant launches never take the Gluon kernel (`mla_decode.mla_attention`).
        self.rounds_decode_to_e4m3 = (spec.kv_dtype == torch.float8_e4m3fn and (self._mla_config.gluon or padded)
                                      and not spec.batch_invariant)
        self.plan_state: TritonPlan | None = None
        # Under graphs every request has the same new tokens (w), so token i's request is i // w: token_req
        # [max_num_tokens] int32 by w, made once by plan_capture, read by every replay with nothing to compute.
        self._graph_token_req: dict[int, torch.Tensor] = {}
        self._graph_max_tokens = 0
        self._graph_token_kv_len: torch.Tensor | None = None  # [max_num_tokens] int32, set by init_cuda_graph
        self._graph_workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self._graph_max_kv_len = 0
        self._graph_splits: dict[int, int] = {}  # KV splits of each captured token count

    @classmethod
    def availability(cls, hardware: Hardware) -> Availability:
        available = super().availability(hardware)
        return triton_availability(hardware) if available else available

    @classmethod
    def kernels(cls, hardware: Hardware) -> str:
        """Triton kernels everywhere, but on GPUs where `common.gluon_runs_on` (sm90) MLA decode and MHA prefill run
        their Gluon twins for the shapes `mla_gluon_fits` / `mha_gluon_fits` take."""
        if not cls.availability(hardware):
            return ""
        if hardware.capability is None:
            return "MLA decode, MHA prefill, merge: Triton (interpreter)"
        from plugserve.plugins.attention.common import gluon_runs_on  # lazily: see the module docstring

        if not gluon_runs_on(hardware.capability):
            return f"MLA decode, MHA prefill, merge: Triton (no Gluon kernel for {hardware.arch})"
        return ("MLA decode: Gluon (gluon_mla) for 64-head blocks of latent 512 + rope 64 in bf16 / fp16 at any page "
                "size (over an e4m3 cache: 8-bit wgmmas, the query and probabilities rounded to e4m3; fewer "
                "heads padded to 64: over a bf16 / fp16 cache from 128 token-head rows, over e4m3 at every decode "
                "past 16 heads or on pages of 64), else Triton; "
                "MHA prefill: Gluon (gluon_mha) for bf16 / fp16 heads of qk 2^a + 2^b (192) and "
                "v <= 128, else Triton; merge: Triton")

    def plan(self, batch: ForwardBatch) -> None:
        """Per-token rows for forward_mla and the varlen offsets for forward_mha, shared by all layers.

        MLA: token_req [T] int32 (each token's block-table row), token_kv_len [T] int32 = position + 1
        (bottom-right causality: new token i of a request sees keys 0..prefix + i), and the KV split
        count. MHA: cu_q [B+1] int32 over extend_lens and, for the causal call, cu_kv [B+1] int32 over
        seq_lens (MHA, or a batch prepare_attention never saw) or extend_lens (MHA_CHUNKED_KV)."""
        super().plan(batch)
        device = batch.block_table.device
        num_tokens = batch.num_tokens
        token_req = torch.repeat_interleave(
            torch.arange(batch.batch_size, dtype=torch.int32, device=device), batch.extend_lens,
            output_size=num_tokens,
        )
        if batch.tree is None:
            token_kv_len, tree = (batch.positions + 1).to(torch.int32), None
        else:
            token_kv_len, tree = self._tree_rows(batch)
        num_splits = self._mla_splits(num_tokens, max(batch.seq_lens_cpu, default=0))
        if batch.attn_method is AttnForwardMethod.MHA_CHUNKED_KV:
            causal_kv_lens, cu_causal_kv = batch.extend_lens_cpu, batch.cu_extend_lens
        else:
            causal_kv_lens, cu_causal_kv = batch.seq_lens_cpu, _cumsum_with_zero(batch.seq_lens)
        # workspace None: forward_mla allocates its partials.
        self.plan_state = TritonPlan(token_req, token_kv_len, tree, num_splits, None,
                                     max(batch.extend_lens_cpu, default=0), causal_kv_lens, cu_causal_kv)

    @staticmethod
    def _tree_rows(batch: ForwardBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """A draft-tree batch's token_kv_len [T] int32 (every node's: its request's length, the keys from the
        tree's first on masked in the kernel) and per-token mask for forward_mla: (tree_start [T] int32, the
        position of the request's first node; tree_bits [T] int64, bit j set where the token sees node j). On the
        device, no sync."""
        tree = batch.tree
        assert tree is not None
        n = tree.num_nodes
        if n > MAX_TREE_NODES:
            raise ValueError(f"triton attention: draft trees of at most {MAX_TREE_NODES} nodes a request (one 64-bit "
                             f"mask per node), got {n}: lower --speculative-num-draft-tokens")
        kv_len = torch.repeat_interleave(batch.seq_lens.to(torch.int32), n, output_size=batch.num_tokens)
        start = torch.repeat_interleave((batch.seq_lens - n).to(torch.int32), n, output_size=batch.num_tokens)
        powers = torch.ones(n, dtype=torch.int64, device=start.device) << torch.arange(n, device=start.device)
        bits = (tree.mask.to(torch.int64) * powers).sum(-1)  # distinct powers of two: the sum is the bitwise or
        return kv_len, (start, bits.view(-1))

    def _mla_config_for(self, page_size: int) -> MlaConfig:
        spec = self.spec
        return self._mla_decode.mla_config(spec.num_heads, spec.dtype, self._capability, page_size, spec.kv_lora_rank,
                                           spec.qk_rope_head_dim, spec.kv_dtype)

    def _mla_splits(self, num_tokens: int, max_kv_len: int) -> int:
        """KV splits for num_tokens query rows times the config's head blocks (host-side, no sync); under
        spec.batch_invariant `mla_fixed_num_splits`, which does not follow num_tokens."""
        min_keys = self._mla_decode.mla_min_split_keys(self.spec.num_heads)
        if self.spec.batch_invariant:
            return self._mla_decode.mla_fixed_num_splits(max_kv_len, min_keys)
        head_blocks = -(-self.spec.num_heads // self._mla_config.block_h)
        return self._mla_decode.mla_num_splits(num_tokens * head_blocks, max_kv_len, self._multiprocessors, min_keys)

    def init_cuda_graph(self, max_batch_size: int, max_num_tokens: int, max_pages: int) -> None:
        """Fixed token_kv_len [max_num_tokens] int32; splits sized for max_pages full pages, and one workspace
        for the split partials of any token count up to max_num_tokens (two flat float32 buffers: [rows * R]
        outputs, [rows] log-sum-exps)."""
        self._graph_token_req, self._graph_max_tokens = {}, max_num_tokens
        self._graph_token_kv_len = torch.ones(max_num_tokens, dtype=torch.int32, device=self.device)
        self._graph_max_kv_len = max_pages * (self.spec.page_size or 1)
        size = self._mla_decode.mla_workspace_size
        rows = max(size(t, self.spec.num_heads, self._mla_splits(t, self._graph_max_kv_len), self.spec.batch_invariant)
                   for t in range(1, max_num_tokens + 1))
        self._graph_workspace = (
            torch.empty(rows * self.spec.kv_lora_rank, dtype=torch.float32, device=self.device),
            torch.empty(rows, dtype=torch.float32, device=self.device),
        )

    def plan_capture(self, batch: ForwardBatch) -> None:
        if self._graph_token_kv_len is None:
            raise RuntimeError("plan_capture before init_cuda_graph")
        self._graph_splits[batch.num_tokens] = self._mla_splits(batch.num_tokens, self._graph_max_kv_len)
        width = _tokens_per_request(batch)
        if width not in self._graph_token_req:
            self._graph_token_req[width] = torch.arange(self._graph_max_tokens, device=self.device).div(
                width, rounding_mode="floor").to(torch.int32)
        self.plan_replay(batch)

    def plan_replay(self, batch: ForwardBatch) -> None:
        """token_kv_len of this batch into the leading rows of its fixed buffer, on the device (one kernel); the
        token_req and split count captured for its layout."""
        if batch.tree is not None:
            raise ValueError("triton attention: a draft tree's mask changes every round; trees run without CUDA graphs")
        self.batch = batch
        num_tokens = batch.num_tokens
        token_kv_len = self._graph_token_kv_len[:num_tokens]  # type: ignore[index]
        self.plan_state = TritonPlan(self._graph_token_req[_tokens_per_request(batch)][:num_tokens], token_kv_len,
                                     None, self._graph_splits[num_tokens], self._graph_workspace)
        token_kv_len.copy_(batch.positions + 1)

    def _plan(self) -> TritonPlan:
        if self.plan_state is None:
            raise RuntimeError("triton attention: forward before plan")
        return self.plan_state

    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q_nope [T, H, R], q_rope [T, H, P] of the pool's dtype -> [T, H, R] in that dtype."""
        return self._mla(q_nope, q_rope, layer_id, None)

    def forward_mla_projected(self, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_id: int, w_vc: torch.Tensor
                              ) -> torch.Tensor:
        """`AttentionBackend.forward_mla_projected`; up to FUSED_V_PROJ_MAX_TOKENS tokens (decode) the split-KV
        reduce multiplies by W_UV itself, where forward_mla and a bmm take two launches. Under spec.batch_invariant
        forward_mla and `mla_project.mla_project` (fixed token tiles) at every token count."""
        if self.spec.batch_invariant:
            return self._mla_project.mla_project(self.forward_mla(q_nope, q_rope, layer_id), w_vc)
        if q_nope.shape[0] > FUSED_V_PROJ_MAX_TOKENS:
            return super().forward_mla_projected(q_nope, q_rope, layer_id, w_vc)
        return self._mla(q_nope, q_rope, layer_id, w_vc)

    def _mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_id: int, w_vc: torch.Tensor | None
             ) -> torch.Tensor:
        """`mla_decode.mla_attention` over the planned batch (with W_UV [H, R, v] folded in when given)."""
        batch, plan = self.batch, self._plan()
        pool = batch.kv_pool
        self.check_mla_inputs(q_nope, q_rope)
        # The spec's page size is the pool's when the model runner builds both; a pool of other pages (the kit's)
        # may not hold the config's TMA boxes.
        config = self._mla_config if pool.page_size == self.spec.page_size else self._mla_config_for(pool.page_size)
        if pool.dtype != q_nope.dtype and batch.mode is not ForwardMode.DECODE:  # `rounds_decode_to_e4m3`: DECODE only
            config = replace(config, gluon=False)
        if self._pads_heads(pool, plan, q_nope):
            config = self._mla_padded_config
        return self._mla_decode.mla_attention(
            q_nope, q_rope, pool.buffer(layer_id), batch.block_table, plan.token_req, plan.token_kv_len,
            pool.page_size, self.spec.softmax_scale, config, plan.num_splits, plan.workspace, plan.tree, w_vc,
            pool.scale, self.spec.batch_invariant,
        )

    def _pads_heads(self, pool: MLAKVPool, plan: TritonPlan, q_nope: torch.Tensor) -> bool:
        """Does this launch of fewer than 64 heads (V2-Lite's 16; V3's 128 over four or eight ranks) take the Gluon
        kernel's 64-head block, the heads past num_heads masked (`_mla_padded_config`, on sm90): its TMA loads and
        wgmmas at four or two times the rows outrun the 16- and 32-head blocks' mma.sync loop, which is bound by issuing
        instructions, not by memory. Over a pool of q's dtype from PADDED_MIN_ROWS (token, head) rows on (at a token or
        two the shorter launch wins: docs/kernels.md); over an e4m3 pool (past 16 heads or on pages of 64) every DECODE,
        so that the rounding to e4m3 that `rounds_decode_to_e4m3` declares holds at every batch size. Not for a draft
        tree or under batch invariance, which the Gluon kernel does not serve."""
        if (self._mla_padded_config is None or pool.page_size != self.spec.page_size or plan.tree is not None
                or self.spec.batch_invariant):
            return False
        if pool.dtype != q_nope.dtype:
            return self.batch.mode is ForwardMode.DECODE
        return self.spec.num_heads * q_nope.shape[0] >= PADDED_MIN_ROWS

    def forward_mha(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_chunk: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged MHA: q [T, H, Dqk]; k [Tk, H, Dqk], v [Tk, H, Dv] of q's dtype -> out [T, H, Dv] in
        q's dtype, lse [T, H] float32. Tk is sum(seq_lens) (MHA), sum(extend_lens) (MHA_CHUNKED_KV,
        causal part) or the chunk's total (prefix_chunk i, non-causal)."""
        batch, plan = self.batch, self._plan()
        if prefix_chunk is not None:
            if not 0 <= prefix_chunk < len(batch.prefix_chunks):
                raise ValueError(f"prefix_chunk {prefix_chunk} out of range: the batch has "
                                 f"{len(batch.prefix_chunks)} prefix chunks")
            chunk = batch.prefix_chunks[prefix_chunk]
            kv_lens, cu_kv, causal = chunk.lens_cpu, chunk.cu_lens, False
        elif batch.attn_method is AttnForwardMethod.MLA:
            raise ValueError("forward_mha called on a batch planned for absorbed MLA (batch.attn_method is MLA)")
        else:
            if plan.causal_kv_lens is None or plan.cu_causal_kv is None:
                raise ValueError("forward_mha called on a batch planned for CUDA graphs (absorbed MLA only)")
            kv_lens, cu_kv, causal = plan.causal_kv_lens, plan.cu_causal_kv, True
        heads = self.spec.num_heads
        if q.shape[:2] != (batch.num_tokens, heads):
            raise ValueError(f"forward_mha: q must be [T={batch.num_tokens}, H={heads}, Dqk], got {tuple(q.shape)}")
        total = sum(kv_lens)
        if k.shape[:2] != (total, heads) or v.shape[:2] != (total, heads) or k.shape[2] != q.shape[2]:
            raise ValueError(f"forward_mha: k must be [{total}, {heads}, {q.shape[2]}] and v [{total}, {heads}, Dv] "
                             f"(key lengths {kv_lens}), got k {tuple(k.shape)} and v {tuple(v.shape)}")
        return self._mha_prefill.mha_varlen(
            q, k, v, batch.cu_extend_lens, cu_kv, plan.max_q_len, self.spec.softmax_scale, causal
        )

    def merge_attn_states(
        self, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """out_* [T, H, D], lse_* [T, H] float32 -> merged (out [T, H, D] in out_a's dtype, lse [T, H])."""
        if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or lse_a.shape != out_a.shape[:2]:
            raise ValueError(f"cannot merge out {tuple(out_a.shape)} / lse {tuple(lse_a.shape)} with out "
                             f"{tuple(out_b.shape)} / lse {tuple(lse_b.shape)}")
        return self._merge.merge_attn_states(out_a, lse_a, out_b, lse_b)


@hookimpl
def plugserve_backends() -> list[type[AttentionBackend]]:
    return [TritonAttention]
