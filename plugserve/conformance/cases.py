"""Shape grids of the conformance kit. "full" is DeepSeek-V3 at its real sizes (for the GPU); "small"
keeps V3's head dims and expert counts where they are cheap and scales the rest down for the CPU."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from plugserve.core.forward_batch import AttnForwardMethod, ForwardMode
from plugserve.core.specs import RouterConfig

DEFAULT_HEADS = 16  # attention cases' heads unless a grid says otherwise (or --plugserve-heads)
# The grids whose cases carry num_heads, which --plugserve-heads replaces.
ATTENTION_GRIDS = ("mla_case", "graph_case", "mha_case")


@dataclass(frozen=True)
class MLACase:
    """Absorbed MLA over the paged cache: per request, seq_len tokens after the forward, the last
    extend_len of them new. `fp8_kv_scale`: None keeps the cache in the activation dtype; a float stores it in
    float8_e4m3fn with that per-tensor scale (a power of two: x / scale is then exact, whoever divides)."""

    mode: ForwardMode
    seq_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    num_heads: int = DEFAULT_HEADS
    fp8_kv_scale: float | None = None

    def __str__(self) -> str:
        fp8 = "" if self.fp8_kv_scale is None else f"-fp8kv{self.fp8_kv_scale:g}"
        return f"{self.mode.name.lower()}-h{self.num_heads}-seq{'_'.join(map(str, self.seq_lens))}{fp8}"


@dataclass(frozen=True)
class MHACase:
    """Ragged MHA prefill; `method` MHA_CHUNKED_KV splits the prefix into chunks of `chunk_capacity`."""

    method: AttnForwardMethod
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    chunk_capacity: int = 1 << 30
    num_heads: int = DEFAULT_HEADS

    def __str__(self) -> str:
        return (f"{self.method.value}-h{self.num_heads}-prefix{'_'.join(map(str, self.prefix_lens))}"
                f"-new{'_'.join(map(str, self.extend_lens))}")


@dataclass(frozen=True)
class GraphCase:
    """Absorbed MLA captured in CUDA graphs for `batch_size` and batch_size // 2 requests of `per_request`
    new tokens, then replayed for each batch of `replays` (per-request seq_lens, at most batch_size
    requests) in the smallest graph that holds it, padded, on fresh pages."""

    mode: ForwardMode
    batch_size: int
    replays: tuple[tuple[int, ...], ...]
    per_request: int = 1
    num_heads: int = DEFAULT_HEADS

    def __str__(self) -> str:
        return f"graph-{self.mode.name.lower()}-bs{self.batch_size}-h{self.num_heads}"


@dataclass(frozen=True)
class GemmCase:
    m: int
    n: int
    k: int

    def __str__(self) -> str:
        return f"m{self.m}-n{self.n}-k{self.k}"


@dataclass(frozen=True)
class MoECase:
    num_tokens: int
    hidden_size: int
    intermediate_size: int
    router: RouterConfig = field(default_factory=RouterConfig)

    def __str__(self) -> str:
        r = self.router
        return (f"t{self.num_tokens}-e{r.num_experts}top{r.top_k}-{r.topk_method}-{r.scoring_func}"
                f"-h{self.hidden_size}-i{self.intermediate_size}")


AttentionCase = TypeVar("AttentionCase", MLACase, MHACase, GraphCase)


def at_heads(grid: Sequence[AttentionCase], heads: Sequence[int]) -> list[AttentionCase]:
    """Each case of an attention grid at each of `heads` instead of its own head count (duplicates dropped)."""
    return list(dict.fromkeys(replace(case, num_heads=h) for case in grid for h in heads))


def _decode(seq_lens: tuple[int, ...], heads: int) -> MLACase:
    return MLACase(ForwardMode.DECODE, seq_lens, (1,) * len(seq_lens), heads)


def mla_cases(profile: str) -> list[MLACase]:
    if profile == "full":
        return [
            _decode((1,), 128),
            _decode((4096,), 128),
            _decode((1, 513, 2048, 4096, 77, 1000, 3000, 8192), 128),
            _decode(tuple(range(64, 64 * 33, 64)), 128),
            _decode((1, 513, 2048, 4096, 77, 1000, 3000, 8192), 16),  # DeepSeek-V2-Lite, or V3 over eight ranks
            MLACase(ForwardMode.TARGET_VERIFY, (1024, 4100, 37), (4, 4, 4), 128),
            MLACase(ForwardMode.DRAFT_EXTEND, (2048, 70), (3, 2), 128),
            MLACase(ForwardMode.EXTEND, (4096 + 300, 700, 129), (300, 200, 128), 128),
            MLACase(ForwardMode.DECODE, (1, 513, 2048, 4096, 77, 1000, 3000, 8192), (1,) * 8, 128, fp8_kv_scale=1.0),
            MLACase(ForwardMode.EXTEND, (4096 + 300, 700, 129), (300, 200, 128), 128, fp8_kv_scale=0.5),
        ]
    return [
        _decode((1,), 16),
        _decode((1, 17, 64, 100, 129), 16),
        _decode((70,), 128),  # DeepSeek-V3's 128 heads over one 576-wide latent
        MLACase(ForwardMode.TARGET_VERIFY, (10, 33), (4, 4)),
        MLACase(ForwardMode.DRAFT_EXTEND, (12, 40), (3, 2)),
        MLACase(ForwardMode.EXTEND, (20, 50), (5, 13)),
        MLACase(ForwardMode.EXTEND, (300,), (7,)),  # long prefix, few new tokens
        MLACase(ForwardMode.DECODE, (1, 17, 100), (1, 1, 1), fp8_kv_scale=1.0),  # an e4m3 cache
        MLACase(ForwardMode.EXTEND, (50,), (13,), fp8_kv_scale=0.5),
    ]


def graph_cases(profile: str) -> list[GraphCase]:
    decode, verify = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY
    if profile == "full":
        return [
            GraphCase(decode, 1, ((4096,), (1,), (777,)), num_heads=128),
            GraphCase(decode, 32, ((1, 8192, 513), tuple(range(100, 3300, 100)), (700,)), num_heads=128),
            GraphCase(decode, 32, ((1, 8192, 513), tuple(range(100, 3300, 100)), (700,)), num_heads=16),
            GraphCase(verify, 8, ((1024, 4100, 37), (9, 2000, 64, 5, 6, 7, 8, 3000)), per_request=4, num_heads=128),
            GraphCase(ForwardMode.DRAFT_EXTEND, 4, ((2048, 70), (5, 6, 7, 900)), per_request=2, num_heads=128),
        ]
    return [
        GraphCase(decode, 4, ((5, 17, 64), (130, 1, 40, 9), (33,), (8, 2, 77))),
        GraphCase(verify, 2, ((10,), (33, 7), (12,)), per_request=3),
    ]


def mha_cases(profile: str) -> list[MHACase]:
    mha, chunked = AttnForwardMethod.MHA, AttnForwardMethod.MHA_CHUNKED_KV
    if profile == "full":
        return [
            MHACase(mha, (0,), (1,), num_heads=128),
            MHACase(mha, (0, 0, 0), (4096, 1, 3000), num_heads=128),
            MHACase(mha, (1000, 0), (2000, 777), num_heads=128),
            MHACase(chunked, (8192, 0, 5000), (1000, 512, 1), chunk_capacity=4096, num_heads=128),
        ]
    return [
        MHACase(mha, (0,), (1,)),
        MHACase(mha, (0, 0, 0), (1, 7, 33)),
        MHACase(mha, (0,), (20,), num_heads=128),
        MHACase(mha, (40, 0, 65), (10, 5, 1)),  # one shot over de-compressed prefix + new tokens
        MHACase(chunked, (300, 0, 129), (5, 9, 3), chunk_capacity=64),
    ]


def gemm_cases(profile: str) -> list[GemmCase]:
    if profile == "full":
        v3_shapes = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
        return [GemmCase(m, n, k) for m in (1, 8, 64, 256, 1024, 4096) for n, k in v3_shapes]
    return [
        GemmCase(1, 256, 512),
        GemmCase(7, 384, 7168),  # DeepSeek-V3's hidden size as K
        GemmCase(33, 200, 320),  # neither N nor K a multiple of the 128 block
        GemmCase(128, 128, 128),
    ]


V3_ROUTER = RouterConfig(256, 8, "sigmoid", "noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True)
V2_LITE_ROUTER = RouterConfig(64, 6, "softmax", "greedy", n_group=1, topk_group=1, norm_topk_prob=False)
V2_ROUTER = RouterConfig(160, 6, "softmax", "group_limited_greedy", n_group=8, topk_group=3, norm_topk_prob=False)


def moe_cases(profile: str) -> list[MoECase]:
    if profile == "full":
        # Expert sizes as one GPU of an 8-way tensor-parallel V3 holds them.
        return [MoECase(t, 7168, 256, V3_ROUTER) for t in (1, 64, 512)] + [
            MoECase(t, 2048, 1408, V2_LITE_ROUTER) for t in (1, 64, 512)
        ]
    small_v3 = RouterConfig(16, 4, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True)
    return [
        MoECase(1, 256, 128, small_v3),
        MoECase(37, 256, 192, small_v3),
        MoECase(9, 320, 96, RouterConfig(8, 2, "softmax", "greedy", 1, 1, False)),
        MoECase(5, 128, 128, RouterConfig(16, 3, "softmax", "group_limited_greedy", 4, 2, False)),
    ]


def router_cases(profile: str) -> list[MoECase]:
    """The router alone is cheap: V3's and V2's real expert counts in both profiles."""
    tokens = (1, 64, 4096) if profile == "full" else (1, 50)
    return [MoECase(t, 0, 0, r) for r in (V3_ROUTER, V2_ROUTER, V2_LITE_ROUTER) for t in tokens]
