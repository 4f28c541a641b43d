"""What one model forward computes: its mode, per-request lengths, positions and KV-cache slots."""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from plugserve.core.host_copy import to_device
from plugserve.core.kv_cache import MLAKVPool, token_slots

# int32 lengths per 16 bytes: `ForwardBatch.build` starts each of its length tensors at a multiple of it.
LENS_ALIGN = 4


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # new prompt tokens, with or without a cached prefix
    DECODE = "decode"  # one new token per request
    TARGET_VERIFY = "target_verify"  # speculative decoding: the target model scores draft tokens
    DRAFT_EXTEND = "draft_extend"  # speculative decoding: the draft model catches up on accepted tokens
    IDLE = "idle"  # no tokens on this rank (DP attention)

    @property
    def phase(self) -> Phase:
        """EXTEND runs on the prefill backends; every mode over the paged cache on the decode ones."""
        return Phase.PREFILL if self is ForwardMode.EXTEND else Phase.DECODE


class AttnForwardMethod(enum.Enum):
    MHA = "mha"  # causal MHA over the new tokens (and the whole de-compressed prefix, when there is one)
    MHA_CHUNKED_KV = "mha_chunked_kv"  # causal MHA over the new tokens + prefix chunks, merged by lse
    MLA = "mla"  # absorbed MQA over the paged latent cache


@dataclass(frozen=True)
class PrefixChunk:
    """One chunk of the cached prefixes, attended (non-causally) by every new token of its request.

    starts_cpu / lens_cpu: per request, the first prefix position in this chunk and how many follow.
    cu_lens [B+1] int32: exclusive prefix sum of lens, on the device.
    slots [sum(lens)] int64: pool slots of the chunk's tokens, request-major.
    """

    starts_cpu: list[int]
    lens_cpu: list[int]
    cu_lens: torch.Tensor
    slots: torch.Tensor


class Phase(enum.Enum):
    """The two halves of serving that may run different backends (`--prefill-attention-backend`...)."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class DraftTree:
    """The new tokens of every request of a batch as the nodes of a draft tree (EAGLE-2), n per request.

    Node order is KV-slot order: node i of a request sits in the slot of position prefix_len + i, while its
    position (for rope) is prefix_len + depth. A node sees its request's prefix, its ancestors and itself only.
      parents [B, n] int64  the parent's node index, -1 for a root (node 0 in TARGET_VERIFY: the last accepted
                            token; the NextN layer's draft steps have several); a parent precedes its children
      depths  [B, n] int64  0 for a root
      mask    [B, n, n] bool  mask[b, i, j]: node j is node i or one of its ancestors
    """

    parents: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def of(cls, parents: torch.Tensor) -> DraftTree:
        """The tree of `parents` [B, n] int64 (see the class), on its device."""
        b, n = parents.shape
        device = parents.device
        if n and bool((parents >= torch.arange(n, device=device)).any()):
            raise ValueError("every node's parent must precede it (or be -1 for a root)")
        mask = torch.eye(n, dtype=torch.bool, device=device).repeat(b, 1, 1)
        depths = torch.zeros(b, n, dtype=torch.int64, device=device)
        rows = torch.arange(b, device=device)
        for i in range(1, n):
            parent = parents[:, i]
            has_parent = parent >= 0
            # A node sees what its parent sees, and itself.
            mask[:, i] |= mask[rows, parent.clamp_min(0)] & has_parent[:, None]
            depths[:, i] = torch.where(has_parent, depths[rows, parent.clamp_min(0)] + 1, 0)
        return cls(parents, depths, mask)

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[1]


@dataclass
class ForwardBatch:
    """One forward over `batch_size` requests and `num_tokens` new tokens.

    Tokens are laid out request-major: request 0's new tokens, then request 1's, ...
    Device tensors:
      seq_lens      [B] int32  tokens per request after this forward (cached prefix + new)
      extend_lens   [B] int32  new tokens per request (1 for every request in DECODE)
      cu_extend_lens [B+1] int32  exclusive prefix sum of extend_lens
      positions     [T] int64  position of each new token in its request
      block_table   [B, max_pages] int32  page ids of each request's KV, in position order
      out_cache_loc [T] int64  KV-pool slot of each new token
    A TARGET_VERIFY batch may carry a `tree` (`with_tree`): its new tokens are then draft-tree nodes, not a chain.
    """

    mode: ForwardMode
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    cu_extend_lens: torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor
    out_cache_loc: torch.Tensor
    kv_pool: MLAKVPool
    attn_method: AttnForwardMethod | None = None
    prefix_chunks: list[PrefixChunk] = field(default_factory=list)
    # One-shot MHA over a cached prefix: pool slots of every position of every request [sum(seq_lens)]
    sequence_slots: torch.Tensor | None = None
    tree: DraftTree | None = None
    # DP attention: every DP group's new-token count in this forward, in group order (this batch is one group's)
    dp_tokens: list[int] | None = None
    # DP attention: [dp_size * max(dp_tokens)] bool on the device, which rows of the MLP's gathered tokens are real
    # (False: an idle group's or a padded graph row's, kept out of the routed experts); None: all of them
    dp_real_rows: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        seq_lens: Sequence[int],
        extend_lens: Sequence[int],
        block_table: torch.Tensor,
        kv_pool: MLAKVPool,
    ) -> ForwardBatch:
        """Derive positions, slots and device tensors from per-request lengths and the block table (on CUDA in one
        Triton launch, `triton_forward_batch.token_layout`; elsewhere with torch ops)."""
        seq_lens_cpu, extend_lens_cpu = list(seq_lens), list(extend_lens)
        if len(seq_lens_cpu) != len(extend_lens_cpu) or len(seq_lens_cpu) != block_table.shape[0]:
            raise ValueError("seq_lens, extend_lens and block_table must describe the same requests")
        if any(e < 0 or e > s for s, e in zip(seq_lens_cpu, extend_lens_cpu, strict=True)):
            raise ValueError(f"every extend length must lie in [0, seq_len]: {extend_lens_cpu} vs {seq_lens_cpu}")
        if mode is ForwardMode.DECODE and any(e != 1 for e in extend_lens_cpu):
            raise ValueError("DECODE takes exactly one new token per request")
        device, batch, num_tokens = block_table.device, len(seq_lens_cpu), sum(extend_lens_cpu)
        # One upload of [seq_lens | extend_lens | cu_extend_lens]; positions and slots follow on the device. Each
        # part starts 16-byte aligned whatever the batch size: Triton compiles a kernel once per alignment of its
        # pointer arguments, and the warm-up's batch sizes must not leave the other alignment to a request.
        cu = [0]
        for n in extend_lens_cpu:
            cu.append(cu[-1] + n)
        stride = -(-batch // LENS_ALIGN) * LENS_ALIGN
        padding = [0] * (stride - batch)
        lens = to_device(torch.tensor(seq_lens_cpu + padding + extend_lens_cpu + padding + cu, dtype=torch.int32),
                         device)
        seq_lens, extend_lens = lens[:batch], lens[stride : stride + batch]
        cu_extend_lens = lens[2 * stride :]
        layout = _triton_token_layout() if device.type == "cuda" and block_table.stride(-1) == 1 else None
        if layout is not None:
            positions, out_cache_loc = layout(seq_lens, extend_lens, cu_extend_lens, block_table, kv_pool.page_size,
                                              num_tokens, max(extend_lens_cpu, default=0))
        else:
            positions, out_cache_loc = _token_layout(seq_lens, extend_lens, cu_extend_lens, extend_lens_cpu,
                                                     block_table, kv_pool.page_size)
        return cls(
            mode=mode,
            seq_lens_cpu=seq_lens_cpu,
            extend_lens_cpu=extend_lens_cpu,
            seq_lens=seq_lens,
            extend_lens=extend_lens,
            cu_extend_lens=cu_extend_lens,
            positions=positions,
            block_table=block_table,
            out_cache_loc=out_cache_loc,
            kv_pool=kv_pool,
        )

    def with_tree(self, tree: DraftTree) -> ForwardBatch:
        """This TARGET_VERIFY batch with each request's new tokens the nodes of `tree` (one node per new token):
        the same slots, positions prefix_len + depth."""
        if self.mode is not ForwardMode.TARGET_VERIFY:
            raise ValueError(f"draft trees are verified in TARGET_VERIFY batches, not {self.mode.name}")
        if tree.parents.shape[0] != self.batch_size or any(e != tree.num_nodes for e in self.extend_lens_cpu):
            raise ValueError(f"a tree of {tuple(tree.parents.shape)} nodes does not match extend_lens "
                             f"{self.extend_lens_cpu}")
        prefix = (self.seq_lens - self.extend_lens).to(torch.int64)
        positions = (prefix[:, None] + tree.depths).view(-1)
        return dataclasses.replace(self, positions=positions, tree=tree)

    def token_as_decode(self, j: int) -> ForwardBatch:
        """New token j of every request, as a DECODE batch seeing its request's prefix and new tokens 0 .. j: what
        `build` gives for seq_lens prefix + j + 1, from this batch's device tensors (views and a few small kernels,
        no upload, no slot lookup). Every request must have more than j new tokens laid out as a chain, as in a
        TARGET_VERIFY batch of chains (a speculative round's draft steps sit at its positions)."""
        if self.tree is not None or any(e <= j for e in self.extend_lens_cpu) or j < 0:
            raise ValueError(f"token {j} of a batch of chains of {self.extend_lens_cpu} new tokens")
        b, device = self.batch_size, self.seq_lens.device
        first = self.cu_extend_lens[:-1].to(torch.int64) + j  # row of token j of each request
        seq_lens = (self.seq_lens - self.extend_lens + (j + 1)).to(torch.int32)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            seq_lens_cpu=[s - e + j + 1 for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu, strict=True)],
            extend_lens_cpu=[1] * b,
            seq_lens=seq_lens,
            extend_lens=torch.ones(b, dtype=torch.int32, device=device),
            cu_extend_lens=torch.arange(b + 1, dtype=torch.int32, device=device),
            positions=self.positions[first],
            block_table=self.block_table,
            out_cache_loc=self.out_cache_loc[first],
            kv_pool=self.kv_pool,
        )

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens_cpu)

    @property
    def prefix_lens_cpu(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu, strict=True)]


def _token_layout(seq_lens: torch.Tensor, extend_lens: torch.Tensor, cu_extend_lens: torch.Tensor,
                  extend_lens_cpu: list[int], block_table: torch.Tensor, page_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' positions and pool slots [sum(extend_lens)] int64 with torch ops (seq_lens, extend_lens [B],
    cu_extend_lens [B + 1] int32 on the block table's device)."""
    device, batch, num_tokens = block_table.device, len(extend_lens_cpu), sum(extend_lens_cpu)
    per_request = extend_lens_cpu[0] if batch else 0
    if num_tokens == batch and all(n == 1 for n in extend_lens_cpu):  # decode: one token per request
        request_of_token = torch.arange(batch, device=device)
        positions = seq_lens.to(torch.int64) - 1
    elif per_request and num_tokens == batch * per_request and all(n == per_request for n in extend_lens_cpu):
        # Chains of one length (a speculative round's verify and draft extend): no repeat_interleave and its scan.
        offsets = torch.arange(per_request, device=device)
        request_of_token = torch.arange(batch, device=device)[:, None].expand(batch, per_request).reshape(-1)
        positions = ((seq_lens.to(torch.int64) - per_request)[:, None] + offsets).view(-1)
    else:
        request_of_token = torch.repeat_interleave(  # output_size: no read-back of the lengths
            torch.arange(batch, device=device), extend_lens, output_size=num_tokens)
        first = (seq_lens - extend_lens - cu_extend_lens[:-1]).to(torch.int64)  # position of token 0 less its index
        positions = first[request_of_token] + torch.arange(num_tokens, device=device)
    return positions, token_slots(block_table, request_of_token, positions, page_size)


@functools.cache
def _triton_token_layout() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """`triton_forward_batch.token_layout` (one launch where torch takes about ten), or None without triton."""
    try:
        from plugserve.core import triton_forward_batch  # imports triton: only on CUDA, never at import
    except ImportError:
        return None
    return triton_forward_batch.token_layout
