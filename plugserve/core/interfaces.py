"""The four backend interfaces (attention, FP8 GEMM, MoE, and the all-reduces between tensor-parallel ranks) and
what each declares it supports; the problems a model asks them to solve (specs) are in `specs.py`.

A backend class declares `name`, `capabilities` and `priority`; `availability(hardware)` says whether
this machine can run it (importing optional packages there, never at module import). Whether it
fits a model is `capabilities.check(spec, phase)`. Both answer OK or a reason in words.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode, Phase
from plugserve.core.hardware import Hardware
from plugserve.core.moved import moved_names
from plugserve.core.specs import Kind

if TYPE_CHECKING:
    from plugserve.core.specs import AttentionSpec, CommSpec, GemmSpec, MoESpec



@dataclass(frozen=True)
class Availability:
    """OK, or why not, in words a user can act on ("flashinfer is not installed")."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def no(cls, reason: str) -> Availability:
        return cls(False, reason)


OK = Availability(True)


def _dtype_names(dtypes: frozenset[torch.dtype]) -> str:
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def _first_failure(*checks: Availability) -> Availability:
    return next((c for c in checks if not c), OK)


def _member(value: Any, allowed: frozenset | None, what: str) -> Availability:
    """OK when `allowed` is None (anything goes) or holds `value`."""
    if allowed is None or value in allowed:
        return OK
    if all(isinstance(a, torch.dtype) for a in allowed):
        return Availability.no(f"{what} {str(value).removeprefix('torch.')} is not supported "
                               f"(supports {_dtype_names(allowed)})")
    return Availability.no(f"{what} {value} is not supported (supports {', '.join(map(str, sorted(allowed)))})")


def check_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Backends' argument check: ValueError naming the tensor, the expected and the actual shape and dtype."""
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} of shape {shape}, got {t.dtype} of shape {tuple(t.shape)}")


# ----------------------------------------------------------------------------------------------------
# Capability records


@dataclass(frozen=True)
class Capabilities:
    """Hardware and dtypes a backend runs on. Capability bounds are inclusive; None is unbounded."""

    dtypes: frozenset[torch.dtype]
    devices: frozenset[str] = frozenset({"cuda"})
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    # Its calls can be captured in a CUDA graph and replayed: no device-to-host sync, no host-side
    # decision that depends on tensor contents. Attention backends declare it per forward mode instead
    # (`AttentionCapabilities.graph_modes`), since they also keep per-batch metadata.
    cuda_graph: bool = False
    # A row's output does not depend on the other rows of the call (split counts, tile configs and reduction
    # orders fixed whatever the batch), as deterministic inference needs; `batch_invariant_note`: why not.
    batch_invariant: bool = False
    batch_invariant_note: str = ""

    def phases(self) -> frozenset[Phase]:
        return frozenset(Phase)

    def check_hardware(self, hardware: Hardware) -> Availability:
        if hardware.device_type not in self.devices:
            return Availability.no(f"runs on {' or '.join(sorted(self.devices))}, not {hardware.device_type}")
        cap = hardware.capability
        if cap is not None and self.min_capability is not None and cap < self.min_capability:
            return Availability.no(f"needs sm{self.min_capability[0]}{self.min_capability[1]} or newer, "
                                   f"this GPU is {hardware.arch}")
        if cap is not None and self.max_capability is not None and cap > self.max_capability:
            return Availability.no(f"supports up to sm{self.max_capability[0]}{self.max_capability[1]}, "
                                   f"this GPU is {hardware.arch}")
        return OK

    def check_phase(self, phase: Phase) -> Availability:
        if phase in self.phases():
            return OK
        return Availability.no(f"does not run {phase.value}")

    def check(self, spec: Any, phase: Phase) -> Availability:
        """Does the backend fit this problem (a spec of its kind) in this phase? Kinds add checks."""
        return _first_failure(self.check_phase(phase), _member(spec.dtype, self.dtypes, "dtype"),
                              self.check_batch_invariant(spec))

    def check_batch_invariant(self, spec: Any) -> Availability:
        """OK unless the spec asks for batch invariance (--enable-deterministic-inference) and this is not."""
        if not getattr(spec, "batch_invariant", False) or self.batch_invariant:
            return OK
        why = f": {self.batch_invariant_note}" if self.batch_invariant_note else ""
        return Availability.no(f"not batch-invariant, which --enable-deterministic-inference needs{why}")


@dataclass(frozen=True)
class AttentionCapabilities(Capabilities):
    """`methods`: which of MHA / MHA_CHUNKED_KV / MLA it implements; `mla_modes`: the forward modes `forward_mla`
    accepts. A set of None accepts any value. `page_sizes` with one value forces the KV pool's page size when the
    backend decodes. `graph_modes`: the modes whose forward_mla (and set_kv) run inside CUDA graphs, with
    `init_cuda_graph` / `plan_capture` / `plan_replay`. `tree_verify`: forward_mla applies a TARGET_VERIFY batch's
    draft-tree mask (`ForwardBatch.tree`); speculative decoding with topk > 1 needs it. `graph_plan_on_device`: its
    `plan_replay` only runs device ops on the batch's static tensors (and host values fixed per mode and batch size), so
    the graph runner records it into the graph after the capture's plan and a replay needs no host call to it."""

    methods: frozenset[AttnForwardMethod] = frozenset(AttnForwardMethod)
    mla_modes: frozenset[ForwardMode] = frozenset(
        {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}
    )
    kv_lora_ranks: frozenset[int] | None = None
    qk_rope_head_dims: frozenset[int] | None = None
    mha_head_dims: frozenset[tuple[int, int]] | None = None  # (qk, v)
    page_sizes: frozenset[int] | None = None
    # KV cache dtypes it reads besides the activation dtype (which every backend reads); None: that one only.
    # `kv_cache_note`: why it reads no other (shown by `plugserve backends` and in the refusal).
    kv_cache_dtypes: frozenset[torch.dtype] | None = None
    kv_cache_note: str = ""
    graph_modes: frozenset[ForwardMode] = frozenset()
    tree_verify: bool = False
    graph_plan_on_device: bool = False

    def phases(self) -> frozenset[Phase]:
        phases = set()
        if AttnForwardMethod.MHA in self.methods:
            phases.add(Phase.PREFILL)
        if AttnForwardMethod.MLA in self.methods and ForwardMode.DECODE in self.mla_modes:
            phases.add(Phase.DECODE)
        return frozenset(phases)

    def check(self, spec: AttentionSpec, phase: Phase) -> Availability:
        checks = [
            super().check(spec, phase),
            self.check_kv_cache_dtype(spec),
            _member(spec.page_size, self.page_sizes, "page size") if spec.page_size else OK,
        ]
        if phase is Phase.DECODE:
            checks += [
                _member(spec.kv_lora_rank, self.kv_lora_ranks, "kv_lora_rank"),
                _member(spec.qk_rope_head_dim, self.qk_rope_head_dims, "rope head dim"),
            ]
        else:
            checks.append(_member((spec.qk_head_dim, spec.v_head_dim), self.mha_head_dims, "MHA head dims (qk, v)"))
        return _first_failure(*checks)

    def kv_cache_dtype_names(self) -> str:
        """The KV cache dtypes it reads, in words ("the activation dtype, float8_e4m3fn")."""
        if AttnForwardMethod.MLA not in self.methods:
            return "any (it reads no KV cache: the model hands it k / v read from the pool)"
        others = f", {_dtype_names(self.kv_cache_dtypes)}" if self.kv_cache_dtypes else " only"
        return f"the activation dtype{others}" + (f" ({self.kv_cache_note})" if self.kv_cache_note else "")

    def check_kv_cache_dtype(self, spec: AttentionSpec) -> Availability:
        """OK when the spec's KV cache dtype is its activation dtype or one of `kv_cache_dtypes`, or the backend runs
        no absorbed MLA (MHA gets k / v the model read from the pool in the activation dtype)."""
        kv = spec.kv_dtype
        if (AttnForwardMethod.MLA not in self.methods or kv == spec.dtype
                or (self.kv_cache_dtypes is not None and kv in self.kv_cache_dtypes)):
            return OK
        return Availability.no(f"kv cache dtype {str(kv).removeprefix('torch.')} with activations "
                               f"{str(spec.dtype).removeprefix('torch.')} is not supported (reads "
                               f"{self.kv_cache_dtype_names()})")

    def forced_page_size(self) -> int | None:
        return next(iter(self.page_sizes)) if self.page_sizes is not None and len(self.page_sizes) == 1 else None


@dataclass(frozen=True)
class GemmCapabilities(Capabilities):
    block_shapes: frozenset[tuple[int, int]] = frozenset({(128, 128)})

    def check(self, spec: GemmSpec, phase: Phase) -> Availability:
        return _first_failure(
            super().check(spec, phase), _member(spec.block_shape, self.block_shapes, "weight block shape")
        )


@dataclass(frozen=True)
class MoECapabilities(Capabilities):
    """`weight_formats`: "unquantized" (experts in the activation dtype) and/or "fp8_block";
    `topk_methods` / `scoring_funcs`: router variants `route` implements."""

    weight_formats: frozenset[str] = frozenset({"unquantized", "fp8_block"})
    block_shapes: frozenset[tuple[int, int]] = frozenset({(128, 128)})
    topk_methods: frozenset[str] = frozenset({"greedy", "group_limited_greedy", "noaux_tc"})
    scoring_funcs: frozenset[str] = frozenset({"softmax", "sigmoid"})
    # It takes a layer's shared experts into its own GEMMs (`MoESpec.num_shared_experts`).
    shared_experts_fusion: bool = False
    # It holds and runs only one rank's slice of the experts (`MoESpec.ep_size` > 1).
    expert_parallel: bool = False

    def check(self, spec: MoESpec, phase: Phase) -> Availability:
        return _first_failure(
            super().check(spec, phase),
            _member(spec.weight_format, self.weight_formats, "expert weight format"),
            _member(spec.block_shape, self.block_shapes, "weight block shape") if spec.is_fp8 else OK,
            _member(spec.router.topk_method, self.topk_methods, "topk_method"),
            _member(spec.router.scoring_func, self.scoring_funcs, "scoring_func"),
            Availability.no("does not fuse shared experts")
            if spec.num_shared_experts and not self.shared_experts_fusion else OK,
            Availability.no("does not run a slice of the experts (expert parallelism)")
            if spec.ep_size > 1 and not self.expert_parallel else OK,
        )


@dataclass(frozen=True)
class CommCapabilities(Capabilities):
    """`max_bytes`: by world size, the largest message (bytes) it sums, the sizes where it was measured to pay; a
    world size absent: it does not run that world (None: any world, any size). `multi_node`: its ranks may sit on
    several hosts (a kernel over NVLink may not)."""

    max_bytes: Mapping[int, int] | None = None
    multi_node: bool = False

    def check(self, spec: CommSpec, phase: Phase) -> Availability:
        if self.max_bytes is not None and spec.world_size not in self.max_bytes:
            worlds = ", ".join(map(str, sorted(self.max_bytes)))
            return Availability.no(f"measured for worlds of {worlds} ranks only, not {spec.world_size}")
        if spec.nodes > 1 and not self.multi_node:
            return Availability.no(f"runs within one host, not over {spec.nodes} nodes")
        return super().check(spec, phase)

    def largest(self, world_size: int) -> int | None:
        """The largest message in bytes it takes in a world of `world_size` (None: any)."""
        return None if self.max_bytes is None else self.max_bytes.get(world_size, 0)


# ----------------------------------------------------------------------------------------------------
# Backends


# Where a backend was checked against the kit's oracle, as `plugserve backends` says it.
VERIFIED: dict[str, str] = {
    "gpu": "on a GPU it runs on, against the kit's oracle",
    "cpu": "on the CPU, against the kit's oracle",
    "stand-ins": "only against hand-written stand-ins of its library (never run on a GPU it runs on)",
    "undeclared": "its plugin does not say",
}


class Backend(ABC):
    """Common to every kind. `priority` maps an arch ("sm90"), a device type ("cuda", "cpu") or
    "default" to a rank; `auto` takes the highest usable one when no measured table decides. `verified`: a key of
    `VERIFIED`, where the backend's kit run passed."""

    kind: ClassVar[Kind]
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    priority: ClassVar[Mapping[str, int]] = {}
    verified: ClassVar[str] = "undeclared"

    def __init__(self, spec: Any, device: torch.device) -> None:
        """`spec`: the AttentionSpec, GemmSpec or MoESpec of the kind; `device`: where tensors live."""
        self.spec = spec
        self.device = device

    @classmethod
    def availability(cls, hardware: Hardware) -> Availability:
        """Can this machine run the backend? Override to probe optional packages; call super() first."""
        return cls.capabilities.check_hardware(hardware)

    @classmethod
    def kernels(cls, hardware: Hardware) -> str:
        """Which kernels the backend runs on this machine, in a line for `plugserve backends --explain` and
        /server_info ("" says nothing more than its name). Override where that depends on the hardware, e.g. a
        backend that switches kernel families by compute capability."""
        return ""

    @classmethod
    def check_declaration(cls) -> None:
        """Raise TypeError when the class is not a complete backend of its kind."""
        if not isinstance(getattr(cls, "name", None), str) or not cls.name:
            raise TypeError(f"{cls.__qualname__} has no `name`")
        if not isinstance(getattr(cls, "capabilities", None), Capabilities):
            raise TypeError(f"{cls.__qualname__} has no `capabilities` record")
        if cls.verified not in VERIFIED:
            raise TypeError(f"{cls.__qualname__}.verified is {cls.verified!r}, not one of {sorted(VERIFIED)}")

    @classmethod
    def priority_on(cls, hardware: Hardware) -> int:
        for key in (hardware.arch, hardware.device_type, "default"):
            if key in cls.priority:
                return cls.priority[key]
        return 0


class AttentionBackend(Backend):
    """MLA attention for one model (all its layers), over the KV pool of the planned batch.

    Per forward: `plan(batch)` once, then per layer `set_kv` and `forward_mla` or `forward_mha`.
    Heads H = spec.num_heads; R = kv_lora_rank; P = qk_rope_head_dim; T = batch.num_tokens.
    Outputs have the dtype of q; log-sum-exps are float32, natural log, -inf where no key is visible.
    Causality is bottom-right aligned: new token i of a request with q_len new tokens and kv_len
    visible keys sees keys [0, kv_len - q_len + i].

    A backend implements the methods its `capabilities.methods` declare (MLA: forward_mla; MHA: forward_mha;
    MHA_CHUNKED_KV: forward_mha with prefix chunks and merge_attn_states); the registry refuses a class that declares
    one it does not implement. The others raise.

    Under the default `set_kv` (pool rows stored as they are) the model's absorbed MLA path does not call it: it
    writes the pool in one fused op with the latent's norm, the rope and W_UK's absorption (`SmallOps.mla_prepare`).
    A backend that overrides `set_kv` (its own cache layout) is called with the normed latent and rotated key.
    """

    kind: ClassVar[Kind] = "attention"
    capabilities: ClassVar[AttentionCapabilities]
    # Set per instance: its DECODE over an e4m3 cache rounds each head's query to e4m3 (scale max|q| / 448) and its
    # probabilities too (8-bit MMAs); the kit's oracle rounds the query alike and admits the probabilities' rounding.
    rounds_decode_to_e4m3: bool = False
    spec: AttentionSpec
    batch: ForwardBatch


    @classmethod
    def check_declaration(cls) -> None:
        super().check_declaration()
        required = {
            AttnForwardMethod.MLA: "forward_mla",
            AttnForwardMethod.MHA: "forward_mha",
            AttnForwardMethod.MHA_CHUNKED_KV: "merge_attn_states",
        }
        for method, function in required.items():
            if method in cls.capabilities.methods and getattr(cls, function) is getattr(AttentionBackend, function):
                raise TypeError(f"{cls.__qualname__} declares {method.name} but does not implement {function}")
        graph_methods = ("init_cuda_graph", "plan_capture", "plan_replay")
        if cls.capabilities.graph_modes and any(getattr(cls, f) is getattr(AttentionBackend, f) for f in graph_methods):
            raise TypeError(f"{cls.__qualname__} declares graph_modes but does not implement "
                            f"{' / '.join(graph_methods)}")
        if not cls.capabilities.graph_modes <= cls.capabilities.mla_modes:
            raise TypeError(f"{cls.__qualname__} declares graph_modes outside its mla_modes")
        if cls.capabilities.graph_plan_on_device and not cls.capabilities.graph_modes:
            raise TypeError(f"{cls.__qualname__} declares graph_plan_on_device without graph_modes")

    def plan(self, batch: ForwardBatch) -> None:
        """Build what every layer of this forward shares (index arrays, kernel plans). Overrides call
        super().plan(batch) first."""
        self.batch = batch

    # -- CUDA graphs (backends declaring `capabilities.graph_modes`) -----------------------------------
    # core/cuda_graph_runner.py owns the batch's device tensors: one static buffer each for positions,
    # seq_lens, extend_lens, cu_extend_lens, block_table and out_cache_loc, of which every captured
    # batch size sees the leading rows. The backend owns what it derives from them. Rows past the real
    # requests are padding: seq_len = extend_len (1 in DECODE), every page the pool's padding page.

    def init_cuda_graph(self, max_batch_size: int, max_num_tokens: int, max_pages: int) -> None:
        """Once, before any capture: allocate the fixed buffers for graphs of up to `max_batch_size`
        requests, `max_num_tokens` new tokens and `max_pages` pages per request (block_table's width)."""
        raise NotImplementedError(f"{self.name} does not run under CUDA graphs")

    def plan_capture(self, batch: ForwardBatch) -> None:
        """Instead of `plan`, before capturing `batch` (its device tensors are the runner's static
        buffers). What forward_mla reads must stay at fixed addresses for as long as the graph lives."""
        raise NotImplementedError(f"{self.name} does not run under CUDA graphs")

    def plan_replay(self, batch: ForwardBatch) -> None:
        """Before each replay of the graph captured for `batch.batch_size` requests in `batch.mode`: the
        static buffers hold this batch now, its host-side lengths are in seq_lens_cpu / extend_lens_cpu.
        Refresh the fixed buffers in place, with no device-to-host sync. Under `capabilities.graph_plan_on_device`
        it is called once inside the capture instead, and its device ops replay with the graph."""
        raise NotImplementedError(f"{self.name} does not run under CUDA graphs")

    def set_kv(self, layer_id: int, slots: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Write new tokens' latent [n, R] and rope key [n, P] at pool slots [n] int64, cast to the pool's dtype.
        Override for another cache layout (the class docstring says what the model then calls)."""
        self.batch.kv_pool.write(layer_id, slots, latent, k_rope)

    def check_mla_inputs(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> None:
        """ValueError unless q_nope is [T, H, R] and q_rope [T, H, P] for the planned batch, both in the activation
        dtype (spec.dtype), over a pool of the spec's KV cache dtype (what kernels reading the cache need)."""
        pool = self.batch.kv_pool
        expected = (self.batch.num_tokens, self.spec.num_heads)
        if q_nope.shape != (*expected, pool.kv_lora_rank) or q_rope.shape != (*expected, pool.qk_rope_head_dim):
            raise ValueError(
                f"forward_mla expects q_nope [T={expected[0]}, H={expected[1]}, R={pool.kv_lora_rank}] and "
                f"q_rope [T, H, P={pool.qk_rope_head_dim}], got {tuple(q_nope.shape)} and {tuple(q_rope.shape)}"
            )
        if q_nope.dtype != self.spec.dtype or q_rope.dtype != self.spec.dtype:
            raise ValueError(f"forward_mla needs q in the activation dtype {self.spec.dtype}, got {q_nope.dtype} and "
                             f"{q_rope.dtype}")
        if pool.dtype != self.spec.kv_dtype:
            raise ValueError(f"forward_mla: the KV pool is {pool.dtype}, the spec's KV cache dtype "
                             f"{self.spec.kv_dtype}")

    def forward_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Absorbed MLA: q_nope [T, H, R] (already multiplied by W_UK), q_rope [T, H, P] attend, as MQA,
        to each request's cached tokens (latent ++ rope as keys, latent as values) including the
        new ones written by `set_kv`, causally. With `batch.tree` (backends declaring tree_verify) new token i
        of a request sees its prefix and the new tokens j where tree.mask[b, i, j]. Returns [T, H, R]."""
        raise NotImplementedError(f"{self.name} does not run absorbed MLA")

    def forward_mla_projected(self, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_id: int, w_vc: torch.Tensor
                              ) -> torch.Tensor:
        """`forward_mla`'s output through W_UV, per head: w_vc [H, R, v] of q's dtype -> [T, H, v] in that dtype
        (the latent output rounded to it first, as two steps would). The model's absorbed path calls this; a
        backend may fold the product into its own last kernel. This default: forward_mla, then a bmm."""
        out = self.forward_mla(q_nope, q_rope, layer_id)
        return torch.bmm(out.transpose(0, 1), w_vc).transpose(0, 1)

    def forward_mha(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_chunk: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged MHA: q [T, H, Dqk] of the new tokens; k [Tk, H, Dqk], v [Tk, H, Dv].

        prefix_chunk None: causal; k/v hold, per request, the new tokens (batch.attn_method MHA_CHUNKED_KV)
        or the whole sequence, prefix included (MHA, or None: a batch `prepare_attention` never saw).
        prefix_chunk i: non-causal over `batch.prefix_chunks[i]`.
        Returns out [T, H, Dv] and lse [T, H] float32."""
        raise NotImplementedError(f"{self.name} does not run MHA")

    def merge_attn_states(
        self, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Combine attention over two disjoint key sets: out [T, H, D], lse [T, H] float32 each."""
        raise NotImplementedError(f"{self.name} does not merge attention states")


class Fp8GemmBackend(Backend):
    """Block-FP8 linear layers: y = x @ dequant(W).T with W [N, K] e4m3 in 128x128 blocks."""

    kind: ClassVar[Kind] = "gemm"
    capabilities: ClassVar[GemmCapabilities]
    spec: GemmSpec


    def check_weight(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> None:
        """ValueError unless weight is a 2-D float8_e4m3fn [N, K] and weight_scale_inv float32 of its block grid."""
        if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"weight must be a 2-D float8_e4m3fn tensor [N, K], got shape {tuple(weight.shape)} "
                             f"of dtype {weight.dtype}")
        bn, bk = self.spec.block_shape
        expected = (math.ceil(weight.shape[0] / bn), math.ceil(weight.shape[1] / bk))
        if tuple(weight_scale_inv.shape) != expected or weight_scale_inv.dtype != torch.float32:
            raise ValueError(f"weight_scale_inv of a {tuple(weight.shape)} weight in {self.spec.block_shape} blocks "
                             f"must be float32 of shape {expected}, got {weight_scale_inv.dtype} of shape "
                             f"{tuple(weight_scale_inv.shape)}")

    @abstractmethod
    def prepare(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> Any:
        """Once at load: weight [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/bn), ceil(K/bk)] float32
        (dequantized W = weight * scale of its block). Returns the backend's own packed form."""

    @abstractmethod
    def apply(self, x: torch.Tensor, packed: Any) -> torch.Tensor:
        """x [M, K] of spec.dtype, quantized per 1 x bk token group inside. Returns [M, N] spec.dtype."""

    @abstractmethod
    def quantize_activation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token-group quantization: x [M, K] -> (x_q [M, K] float8_e4m3fn, scales [M, ceil(K/bk)]
        float32) with scale = amax(group) / 448 and x ~= x_q * scale."""


def router_logits(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, H], gate [E, H] -> DeepSeek's float32 gate logits [T, E]. A 16-bit gate of x's dtype stays 16-bit:
    products of 16-bit values are exact in float32, so one GEMM with a float32 output gives the float32 gate's
    logits (up to summation order) without a cast of x and a float32 GEMV (three kernels, 7 us per layer at batch 1
    on an H100). Elsewhere (the CPU has no such GEMM) both in float32."""
    if gate.dtype == x.dtype != torch.float32 and x.is_cuda:
        return torch.mm(x, gate.t(), out_dtype=torch.float32)
    return torch.nn.functional.linear(x.float(), gate.float())


@dataclass(frozen=True)
class MoEWeights:
    """This rank's experts by name, which `MoEBackend.prepare` packs once at load (E_l, H, I as there; (bn, bk) =
    spec.block_shape; expert j is global expert spec.first_expert + j). w13 [E_l, 2I, H] (rows [0, I) gate, [I, 2I)
    up) and w2 [E_l, H, I] of spec.dtype, or float8_e4m3fn with w13_scale_inv [E_l, ceil(2I/bn), ceil(H/bk)] and
    w2_scale_inv [E_l, ceil(H/bn), ceil(I/bk)] float32. With spec.num_shared_experts S > 0, and only then, the
    shared MLP in the same format: shared_w13 [2SI, H] (gate rows, then up rows) and shared_w2 [H, SI], FP8 with
    scales [ceil(2SI/bn), ceil(H/bk)] and [ceil(H/bn), ceil(SI/bk)]."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale_inv: torch.Tensor | None = None
    w2_scale_inv: torch.Tensor | None = None
    shared_w13: torch.Tensor | None = None
    shared_w2: torch.Tensor | None = None
    shared_w13_scale_inv: torch.Tensor | None = None
    shared_w2_scale_inv: torch.Tensor | None = None


class MoEBackend(Backend):
    """Routed experts of DeepSeekMoE. E = num_experts, k = top_k, H = hidden, I = intermediate; E_l =
    spec.num_local_experts, the experts this rank holds (E but under expert parallelism: see `MoESpec`)."""

    kind: ClassVar[Kind] = "moe"
    capabilities: ClassVar[MoECapabilities]
    spec: MoESpec


    @abstractmethod
    def route(
        self, router_logits: torch.Tensor, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] float32 (and e_score_correction_bias [E] for noaux_tc) ->
        (topk_weights [T, k] float32, topk_ids [T, k] int32), following `spec.router`.
        The weights do not include routed_scaling_factor: `forward` applies it. With fused shared
        experts, [T, spec.routed_width]: see `MoESpec`."""

    def route_hidden(
        self, x: torch.Tensor, gate: torch.Tensor, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`route` from the hidden states: x [T, H] in the model dtype, gate [E, H] (the model dtype, or float32)
        -> `route(router_logits(x, gate), correction_bias)`. A backend may override it to compute the gate's
        logits and the selection together (one kernel at decode sizes instead of a GEMM and a top-k)."""
        return self.route(router_logits(x, gate), correction_bias)

    @abstractmethod
    def prepare(self, weights: MoEWeights) -> Any:
        """Once at load: this rank's experts (see `MoEWeights`) -> the packed form `forward` takes. ValueError
        when a tensor does not fit the spec."""

    def check_forward_inputs(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """ValueError unless x is [T, H] of spec.dtype and topk_ids / topk_weights are both
        [T, spec.routed_width]."""
        spec = self.spec
        if x.dim() != 2 or x.shape[1] != spec.hidden_size or x.dtype != spec.dtype:
            raise ValueError(f"x must be [T, {spec.hidden_size}] of dtype {spec.dtype}, "
                             f"got shape {tuple(x.shape)} of dtype {x.dtype}")
        expected = (x.shape[0], spec.routed_width)
        if tuple(topk_ids.shape) != expected or tuple(topk_weights.shape) != expected:
            raise ValueError(f"topk_ids and topk_weights must both be [{x.shape[0]}, {spec.routed_width}], "
                             f"got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")

    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,
        packed: Any,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        routed_scaling_factor: float,
    ) -> torch.Tensor:
        """x [T, H] of spec.dtype -> sum_j topk_weights[t, j] * routed_scaling_factor *
        expert_{topk_ids[t, j]}(x[t]), with expert(x) = W2 (silu(W_gate x) * (W_up x)). Returns [T, H].
        topk_ids / topk_weights are `route`'s [T, spec.routed_width] (fused shared experts included), global
        ids: under expert parallelism the sum runs over the slots whose expert this rank holds. A slot of expert -1
        adds nothing and reads no expert (DP attention's padding rows are marked so; a row of only such slots is 0).
        Block-FP8 experts are w8a8: x, and the SiLU-and-mul output before W2, are quantized per 1 x block_k
        token group (e4m3, float32 scale amax / 448) as the GEMM contract's activations are."""


class CommBackend(Backend):
    """Sums of a tensor over the ranks of a tensor-parallel group (the all-reduces after row-parallel layers and
    the MoE). Building one is collective: every rank of `spec.group` builds the same backends in the same order.
    The runtime chains a group's backends: each all-reduce goes to the first that `takes` it."""

    kind: ClassVar[Kind] = "comm"
    capabilities: ClassVar[CommCapabilities]
    spec: CommSpec

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `all_reduce` sums x: on this backend's device type, of the spec's dtype, no larger than
        `capabilities.largest(world_size)` bytes."""
        largest = self.capabilities.largest(self.spec.world_size)
        return (x.device.type == self.device.type and x.dtype == self.spec.dtype
                and (largest is None or x.numel() * x.element_size() <= largest))

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x [...] (one shape on every rank, `takes(x)`) -> the sum of every rank's x, of x's shape and dtype: x
        itself reduced in place, or a new tensor (x left as it was or not: the caller no longer reads it)."""


BACKEND_BASES: dict[Kind, type[Backend]] = {
    "attention": AttentionBackend,
    "gemm": Fp8GemmBackend,
    "moe": MoEBackend,
    "comm": CommBackend,
}


__getattr__ = moved_names(__name__)
