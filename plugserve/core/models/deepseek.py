"""DeepSeek-V2 / V3: MLA attention in its three forms, DeepSeekMoE, and the NextN (MTP) layer.

Every attention, block-FP8 GEMM and MoE call goes through the backends the registry selected
(`ModelBackends`). Checkpoint tensors keep their Hugging Face names; `checkpoint_tensors()` says,
for each, its shape and where it goes (q_a_proj and kv_a_proj_with_mqa fill one fused GEMM;
gate_proj and up_proj one; experts are stacked for the MoE backend; kv_b_proj is also split into
W_UK / W_UV for the absorbed path at `finalize`).

Parallelism over a `ParallelGroup` of P ranks (P = 1: one process, no collectives; docs/parallelism.md):
- tensor parallelism: H / P attention heads over the whole latent (every rank caches the same latent KV), MLPs
  and experts split by intermediate width, the vocabulary split; one all-reduce after attention and one after
  each MLP or MoE block (routed and shared experts summed first); each rank reads only its slices;
- expert parallelism (`expert_parallel`): E / P whole routed experts per rank, the router on every rank over
  all E, the MoE block's all-reduce combining the ranks' terms;
- DP attention (`dp`, `DPGroups`): the attention on this rank's DP group's own requests, its heads split over the
  group's ranks (`DPGroups.attention`: all of them at one rank a group), the embedding whole; the hidden states
  all-gathered over the groups before each MLP / MoE block (`DPGroups.rows`, each group's rows once, padded to
  `ForwardBatch.dp_tokens`' largest count) and this rank's group's rows kept after it; the sampled rows gathered
  the same way before the LM head.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from plugserve.core.config import ModelConfig
from plugserve.core.distributed import SINGLE, DPGroups, ParallelGroup, unpad_rows
from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode
from plugserve.core.interfaces import AttentionBackend, Fp8GemmBackend, MoEBackend, MoEWeights
from plugserve.core.layers.linear import Linear, WeightLoadError
from plugserve.core.layers.norm import RMSNorm
from plugserve.core.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TensorSource,
    VocabParallelEmbedding,
)
from plugserve.core.layers.rotary import RotaryEmbedding
from plugserve.core.layers.small_ops import EAGER, SmallOps, absorb_q

CosSin = tuple[torch.Tensor, torch.Tensor]  # rope cos, sin [T, P/2] float32 of a forward's positions


@dataclass
class ModelBackends:
    """The selected backend instances of one model. `gemm` is None for unquantized models."""

    attention_prefill: AttentionBackend
    attention_decode: AttentionBackend
    moe: MoEBackend | None
    gemm: Fp8GemmBackend | None

    def attention_for(self, mode: ForwardMode) -> AttentionBackend:
        return self.attention_prefill if mode is ForwardMode.EXTEND else self.attention_decode


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor the checkpoint must hold: its (whole) shape and how to load it. `load(name, tensor,
    scale_inv)` gets the `{name}_scale_inv` tensor too when the checkpoint stores the weight as block-FP8.
    `lazy`: `load` takes a lazy safetensors slice as well as a tensor and reads only what this rank holds.
    `read` False: another rank's tensor (an expert this rank does not hold): the checkpoint must have it, but
    neither it nor its scales are read, and `load` is not called."""

    shape: tuple[int, ...]
    load: Callable[[str, TensorSource, torch.Tensor | None], None]
    lazy: bool = False
    read: bool = True


def _copy_into(param: torch.Tensor) -> Callable[[str, torch.Tensor, torch.Tensor | None], None]:
    def load(name: str, tensor: torch.Tensor, scale_inv: torch.Tensor | None) -> None:
        if scale_inv is not None or tensor.dtype == torch.float8_e4m3fn:
            raise WeightLoadError(f"{name}: expected an unquantized tensor, got {tensor.dtype}")
        if tuple(tensor.shape) != tuple(param.shape):
            raise WeightLoadError(f"{name}: shape {tuple(tensor.shape)} does not match the model's "
                                  f"{tuple(param.shape)}")
        param.data.copy_(tensor)

    return load


def _linear_tensors(prefix: str, linear: Linear, names: list[str]) -> dict[str, CheckpointTensor]:
    """Checkpoint names of the shards of `linear`, in order."""
    lazy = isinstance(linear, ColumnParallelLinear | RowParallelLinear)
    return {
        f"{prefix}.{name}.weight": CheckpointTensor(
            linear.checkpoint_shape(shard),
            lambda n, t, s, shard=shard: linear.load_shard(shard, n, t, s),
            lazy,
        )
        for shard, (name, _) in enumerate(zip(names, linear.output_sizes, strict=True))
    }


class Parameters:
    """Creates the model's tensors on one device and dtype: replicated, or split over the ranks of `group`.
    `expert_parallel`: the routed experts are split over the ranks whole, not each by its width."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 group: ParallelGroup, expert_parallel: bool = False) -> None:
        self.config, self.dtype, self.device, self.group = config, dtype, torch.device(device), group
        self.expert_parallel = expert_parallel

    def over(self, group: ParallelGroup) -> Parameters:
        """The same, split over `group` instead: SINGLE holds every tensor whole (one rank's experts under expert
        parallelism); DP attention's attention splits over its DP group's ranks."""
        return Parameters(self.config, self.dtype, self.device, group)

    def linear(self, in_features: int, *output_sizes: int) -> Linear:
        """Every rank holds the whole layer."""
        return Linear(in_features, output_sizes, self.dtype, self.device, self.config.fp8_block)

    def column(self, name: str, in_features: int, *output_sizes: int, replicated: tuple[int, ...] = ()
               ) -> ColumnParallelLinear:
        """Output rows split over the ranks (the shards in `replicated` held whole); `name` for errors."""
        return ColumnParallelLinear(in_features, output_sizes, self.dtype, self.device, self.config.fp8_block,
                                    group=self.group, name=name, replicated=replicated)

    def row(self, name: str, in_features: int, out_features: int, reduce_output: bool = True) -> RowParallelLinear:
        """Input columns split over the ranks, outputs all-reduced unless `reduce_output` is False."""
        return RowParallelLinear(in_features, [out_features], self.dtype, self.device, self.config.fp8_block,
                                 group=self.group, name=name, reduce_output=reduce_output)

    def norm(self, size: int, eps: float | None = None) -> RMSNorm:
        return RMSNorm(size, self.config.rms_norm_eps if eps is None else eps, self.dtype, self.device)


class DenseMLP(nn.Module):
    """silu(x W_gate^T) * (x W_up^T), then W_down; gate and up run as one GEMM. Each rank holds a slice of
    the intermediate width; `reduce_output` False leaves the all-reduce of W_down's partial sums to the
    caller (an MoE block reduces its routed and shared experts at once)."""

    def __init__(self, p: Parameters, intermediate_size: int, name: str, reduce_output: bool = True) -> None:
        super().__init__()
        hidden = p.config.hidden_size
        self.gate_up_proj = p.column(f"{name}.gate_up_proj", hidden, intermediate_size, intermediate_size)
        self.down_proj = p.row(f"{name}.down_proj", intermediate_size, hidden, reduce_output)
        self.ops: SmallOps = EAGER

    def checkpoint_tensors(self, prefix: str) -> dict[str, CheckpointTensor]:
        return {
            **_linear_tensors(prefix, self.gate_up_proj, ["gate_proj", "up_proj"]),
            **_linear_tensors(prefix, self.down_proj, ["down_proj"]),
        }

    def finalize(self, gemm: Fp8GemmBackend | None) -> None:
        self.gate_up_proj.finalize(gemm)
        self.down_proj.finalize(gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DeepseekMoE(nn.Module):
    """Router + routed experts (through the MoE backend) + shared experts: their own MLP (on a second
    CUDA stream when `shared_stream` is set), or extra experts inside the backend's GEMMs when its spec has
    `num_shared_experts`."""

    def __init__(self, p: Parameters, name: str) -> None:
        super().__init__()
        c = p.config
        experts, hidden, inter = c.n_routed_experts or 0, c.hidden_size, c.moe_intermediate_size
        self.group = p.group
        self.routed_scaling_factor = c.routed_scaling_factor
        self.gate = nn.Parameter(torch.empty(experts, hidden, dtype=p.dtype, device=p.device), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(experts, dtype=torch.float32, device=p.device), requires_grad=False)
            if c.topk_method == "noaux_tc" else None
        )
        # Loaded per expert, then stacked for the backend at finalize: P ranks, all E experts split by width
        # (w13 [E, 2I/P, H] / w2 [E, H, I/P]), or under expert parallelism the E/P experts
        # [first_expert, first_expert + E/P) whole (w13 [E/P, 2I, H] / w2 [E/P, H, I]); the backend's spec
        # (`ModelConfig.moe_spec`) says the same.
        ranks = p.group.world_size
        if p.expert_parallel and experts % ranks:
            raise ValueError(f"{name}: {experts} routed experts do not split over {ranks} expert-parallel ranks")
        self.num_experts = experts
        held = experts // ranks if p.expert_parallel else experts
        self.first_expert = p.group.rank * held if p.expert_parallel else 0
        self.experts = nn.ModuleList(
            DenseMLP(p.over(SINGLE) if p.expert_parallel else p, inter, f"{name}.experts.{e}", reduce_output=False)
            for e in range(self.first_expert, self.first_expert + held)
        )
        self.shared_experts = (DenseMLP(p, inter * c.n_shared_experts, f"{name}.shared_experts", reduce_output=False)
                               if c.n_shared_experts else None)
        self._moe: MoEBackend | None = None
        self._packed: object = None
        self.shared_stream: torch.cuda.Stream | None = None  # set by DeepseekForCausalLM.overlap_shared_experts

    def checkpoint_tensors(self, prefix: str) -> dict[str, CheckpointTensor]:
        tensors = {f"{prefix}.gate.weight": CheckpointTensor(tuple(self.gate.shape), _copy_into(self.gate))}
        if self.e_score_correction_bias is not None:
            bias = self.e_score_correction_bias
            tensors[f"{prefix}.gate.e_score_correction_bias"] = CheckpointTensor(tuple(bias.shape), _copy_into(bias))
        for e in range(self.num_experts):
            if self.first_expert <= e < self.first_expert + len(self.experts):
                tensors |= self.experts[e - self.first_expert].checkpoint_tensors(f"{prefix}.experts.{e}")
            else:  # another rank's: named like one of ours
                tensors |= {name: CheckpointTensor(t.shape, lambda n, t, s: None, read=False)
                            for name, t in self.experts[0].checkpoint_tensors(f"{prefix}.experts.{e}").items()}
        if self.shared_experts is not None:
            tensors |= self.shared_experts.checkpoint_tensors(f"{prefix}.shared_experts")
        return tensors

    def finalize(self, moe: MoEBackend, gemm: Fp8GemmBackend | None) -> None:
        """Stack the experts into the MoE backend's packed form and drop the per-expert copies."""
        for expert in self.experts:
            expert.finalize(gemm=None)
        gate_up = [e.gate_up_proj for e in self.experts]
        down = [e.down_proj for e in self.experts]
        w13, w2 = torch.stack([g.weight.data for g in gate_up]), torch.stack([d.weight.data for d in down])
        scales = (None, None)
        if gate_up[0].fp8_block is not None:
            scales = (torch.stack([g.weight_scale_inv.data for g in gate_up]),
                      torch.stack([d.weight_scale_inv.data for d in down]))
        self._moe = moe
        self._packed = moe.prepare(MoEWeights(w13, w2, *scales,
                                              **self._fused_shared_experts(moe.spec.num_shared_experts)))
        if not (self.gate.is_cuda and self.gate.dtype in (torch.bfloat16, torch.float16)):
            self.gate.data = self.gate.data.float()  # the router runs in float32: convert once, not per call
        self.experts = nn.ModuleList()
        if moe.spec.num_shared_experts:
            self.shared_experts = None  # inside the routed experts' GEMMs now
        elif self.shared_experts is not None:
            self.shared_experts.finalize(gemm)

    def _fused_shared_experts(self, num_shared: int) -> dict[str, torch.Tensor]:
        """The shared MLP as `MoEWeights`' shared_* fields when the backend fuses `num_shared`
        of them (its spec says so), else nothing."""
        if not num_shared or self.shared_experts is None:  # prepare refuses a spec the layer does not match
            return {}
        mlp = self.shared_experts
        mlp.finalize(gemm=None)  # quantizes shards staged in float, packs nothing
        fused = {"shared_w13": mlp.gate_up_proj.weight.data, "shared_w2": mlp.down_proj.weight.data}
        if mlp.gate_up_proj.fp8_block is not None:
            fused |= {"shared_w13_scale_inv": mlp.gate_up_proj.weight_scale_inv.data,
                      "shared_w2_scale_inv": mlp.down_proj.weight_scale_inv.data}
        return fused

    def forward(self, x: torch.Tensor, real_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: this rank's partial sums of the routed and shared experts, then one
        all-reduce for both. real_rows [T] bool (DP attention's padding rows False): the routed experts skip the
        others, whose output rows are dropped (only their shared experts' share is computed)."""
        return self.group.all_reduce(self._partial(x, real_rows))

    def _partial(self, x: torch.Tensor, real_rows: torch.Tensor | None) -> torch.Tensor:
        if self._moe is None:
            raise RuntimeError("DeepseekMoE used before finalize()")
        if self.shared_experts is None:
            return self._routed(x, real_rows)
        if self.shared_stream is None:
            return self._routed(x, real_rows) + self.shared_experts(x)
        # The shared experts' GEMMs on a second stream, beside the router and the routed experts (both
        # read x; at decode neither fills the GPU). Captured into CUDA graphs as a fork and a join.
        main = torch.cuda.current_stream(x.device)
        self.shared_stream.wait_stream(main)
        with torch.cuda.stream(self.shared_stream):
            shared = self.shared_experts(x)
        routed = self._routed(x, real_rows)
        main.wait_stream(self.shared_stream)
        return routed + shared

    def _routed(self, x: torch.Tensor, real_rows: torch.Tensor | None) -> torch.Tensor:
        # The gate (16-bit on a GPU with a 16-bit model, else float32: `interfaces.router_logits`) and the
        # selection, through the backend: one kernel at decode sizes where it fuses them.
        weights, ids = self._moe.route_hidden(x, self.gate, self.e_score_correction_bias)  # type: ignore[union-attr]
        if real_rows is not None:  # expert -1, which no rank holds: a padding row reads no expert's weights
            ids = ids.masked_fill(~real_rows[:, None], -1)
        return self._moe.forward(x, self._packed, ids, weights, self.routed_scaling_factor)  # type: ignore[union-attr]


class MLAAttention(nn.Module):
    """Multi-head latent attention. Per token: q (through the q LoRA when q_lora_rank is set), a
    compressed latent c_kv [R] and a shared rope key [P]; only latent + rope key are cached.

    MHA (prefill): K/V de-compressed from latents by kv_b_proj, ragged causal attention.
    MHA_CHUNKED_KV: the cached prefix de-compressed chunk by chunk, merged by log-sum-exp.
    MLA (decode, verify, short-prefix extend): W_UK absorbed into q, MQA over the latent cache,
    W_UV applied to the latent-space output.

    Under tensor parallelism H below is this rank's heads (num_attention_heads / P); the latent, the rope
    key and so the KV cache are every head's, the same on every rank. Under DP attention `p` is over the DP
    group's ranks (`DPGroups.attention`): the group's heads split over them, on the group's own requests.
    """

    def __init__(self, p: Parameters, layer_id: int) -> None:
        super().__init__()
        c = p.config
        name, heads = f"model.layers.{layer_id}.self_attn", c.num_attention_heads
        if heads % p.group.world_size:
            raise ValueError(f"{name}: {heads} attention heads do not split over {p.group.world_size} ranks")
        self.layer_id, self.num_heads = layer_id, heads // p.group.world_size
        self.kv_lora_rank, self.rope_dim = c.kv_lora_rank, c.qk_rope_head_dim
        self.nope_dim, self.v_dim, self.q_lora_rank = c.qk_nope_head_dim, c.v_head_dim, c.q_lora_rank
        q_out, kv_a_out = heads * c.qk_head_dim, c.kv_lora_rank + c.qk_rope_head_dim
        # The projections of the input (q_a_proj or q_proj, and kv_a_proj_with_mqa) read the same x: one GEMM.
        if c.q_lora_rank is not None:
            self.q_in_width = c.q_lora_rank
            self.fused_qkv_a_proj: Linear = p.linear(c.hidden_size, c.q_lora_rank, kv_a_out)
            self.q_a_layernorm = p.norm(c.q_lora_rank, eps=1e-6)
            self.q_b_proj = p.column(f"{name}.q_b_proj", c.q_lora_rank, q_out)
        else:  # q_proj split by heads beside the whole kv_a_proj_with_mqa
            self.fused_qkv_a_proj = p.column(f"{name}.q_proj", c.hidden_size, q_out, kv_a_out, replicated=(1,))
            self.q_in_width = self.fused_qkv_a_proj.output_sizes[0]
        self.kv_a_layernorm = p.norm(c.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = p.column(f"{name}.kv_b_proj", c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim))
        self.o_proj = p.row(f"{name}.o_proj", heads * c.v_head_dim, c.hidden_size)
        self.w_kc: torch.Tensor  # [H, nope, R], set at finalize
        self.w_vc: torch.Tensor  # [H, R, v]
        self.ops: SmallOps = EAGER

    def checkpoint_tensors(self, prefix: str) -> dict[str, CheckpointTensor]:
        if self.q_lora_rank is not None:
            tensors = _linear_tensors(prefix, self.fused_qkv_a_proj, ["q_a_proj", "kv_a_proj_with_mqa"])
            tensors |= _linear_tensors(prefix, self.q_b_proj, ["q_b_proj"])
            w = self.q_a_layernorm.weight
            tensors[f"{prefix}.q_a_layernorm.weight"] = CheckpointTensor(tuple(w.shape), _copy_into(w))
        else:
            tensors = _linear_tensors(prefix, self.fused_qkv_a_proj, ["q_proj", "kv_a_proj_with_mqa"])
        w = self.kv_a_layernorm.weight
        tensors[f"{prefix}.kv_a_layernorm.weight"] = CheckpointTensor(tuple(w.shape), _copy_into(w))
        tensors |= _linear_tensors(prefix, self.kv_b_proj, ["kv_b_proj"])
        tensors |= _linear_tensors(prefix, self.o_proj, ["o_proj"])
        return tensors

    def finalize(self, gemm: Fp8GemmBackend | None) -> None:
        for layer in self.children():
            if isinstance(layer, Linear):
                layer.finalize(gemm)
        w_kv = self.kv_b_proj.dequantized_weight().view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_kc = w_kv[:, : self.nope_dim].contiguous()
        self.w_vc = w_kv[:, self.nope_dim :].transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, batch: ForwardBatch,
                attn: AttentionBackend) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        t, h = x.shape[0], self.num_heads
        q, kv_a = self.fused_qkv_a_proj(x).split([self.q_in_width, self.kv_lora_rank + self.rope_dim], -1)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_rope = q.view(t, h, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        method = batch.attn_method or AttnForwardMethod.MLA
        if method is AttnForwardMethod.MLA and type(attn).set_kv is AttentionBackend.set_kv:
            # The backend stores pool rows as they are: norm, rope, the pool write and W_UK's absorption as one op
            # (one kernel on CUDA). The MHA paths need the normed latent and rotated rope key as tensors, and a
            # backend's own set_kv may store them otherwise.
            norm = self.kv_a_layernorm
            q_absorbed, q_rope = self.ops.mla_prepare(kv_a, q_nope, q_rope, self.w_kc, norm.weight, norm.eps,
                                                      *cos_sin, batch.kv_pool.buffer(self.layer_id),
                                                      batch.out_cache_loc, batch.kv_pool.scale)
        else:
            latent, k_rope = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            latent = self.kv_a_layernorm(latent)
            q_rope, k_rope = rope(q_rope, k_rope, cos_sin)
            attn.set_kv(self.layer_id, batch.out_cache_loc, latent, k_rope)
            if method is AttnForwardMethod.MLA:
                q_absorbed = absorb_q(q_nope, self.w_kc)  # [T, H, R]

        if method is AttnForwardMethod.MLA:
            out = attn.forward_mla_projected(q_absorbed, q_rope, self.layer_id, self.w_vc)  # [T, H, v]
        else:
            out = self._mha(torch.cat([q_nope, q_rope], dim=-1), latent, k_rope, batch, attn)
        return self.o_proj(out.reshape(t, h * self.v_dim))

    def _mha(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, batch: ForwardBatch,
             attn: AttentionBackend) -> torch.Tensor:
        pool = batch.kv_pool
        if batch.sequence_slots is not None:  # one shot over prefix + new tokens, read back from the pool
            rows = pool.read(self.layer_id, batch.sequence_slots, q.dtype)
            latent, k_rope = rows[:, : self.kv_lora_rank], rows[:, self.kv_lora_rank :]
        out, lse = attn.forward_mha(q, *self._decompress(latent, k_rope))
        for i, chunk in enumerate(batch.prefix_chunks):
            rows = pool.read(self.layer_id, chunk.slots, q.dtype)
            k, v = self._decompress(rows[:, : self.kv_lora_rank], rows[:, self.kv_lora_rank :])
            chunk_out, chunk_lse = attn.forward_mha(q, k, v, prefix_chunk=i)
            out, lse = attn.merge_attn_states(out, lse, chunk_out, chunk_lse)
        return out

    def _decompress(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [n, R], k_rope [n, P] -> k [n, H, nope + P], v [n, H, v] through kv_b_proj."""
        n, h = latent.shape[0], self.num_heads
        k_nope, v = self.kv_b_proj(latent).view(n, h, -1).split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None, :].expand(n, h, self.rope_dim)], dim=-1)
        return k, v


class DecoderLayer(nn.Module):
    """Attention then MLP / MoE. `dp`: the attention over this rank's DP group's ranks on the group's tokens, the
    MLP over every group's (module docstring)."""

    def __init__(self, p: Parameters, layer_id: int, dp: DPGroups | None = None) -> None:
        super().__init__()
        self.rows = dp.rows if dp is not None else p.group  # the ranks `dp_tokens` counts the rows of
        self.input_layernorm = p.norm(p.config.hidden_size)
        self.self_attn = MLAAttention(p.over(dp.attention) if dp is not None else p, layer_id)
        self.post_attention_layernorm = p.norm(p.config.hidden_size)
        name = f"model.layers.{layer_id}.mlp"
        self.mlp: DenseMLP | DeepseekMoE = (
            DeepseekMoE(p, name) if p.config.is_moe_layer(layer_id) else DenseMLP(p, p.config.intermediate_size, name)
        )

    def checkpoint_tensors(self, prefix: str) -> dict[str, CheckpointTensor]:
        tensors = self.self_attn.checkpoint_tensors(f"{prefix}.self_attn")
        tensors |= self.mlp.checkpoint_tensors(f"{prefix}.mlp")
        for name in ("input_layernorm", "post_attention_layernorm"):
            w = getattr(self, name).weight
            tensors[f"{prefix}.{name}.weight"] = CheckpointTensor(tuple(w.shape), _copy_into(w))
        return tensors

    def finalize(self, backends: ModelBackends) -> None:
        self.self_attn.finalize(backends.gemm)
        if isinstance(self.mlp, DeepseekMoE):
            if backends.moe is None:
                raise ValueError("a DeepSeekMoE layer needs an MoE backend")
            self.mlp.finalize(backends.moe, backends.gemm)
        else:
            self.mlp.finalize(backends.gemm)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RotaryEmbedding, cos_sin: CosSin,
                batch: ForwardBatch, attn: AttentionBackend | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden], the previous block's output, and the residual stream before it (None in the first
        layer) -> this block's output and the residual stream before it: the residual adds are fused into
        the next norm. `attn` None: an IDLE batch (T = 0), which only joins the MLP's collectives."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        if attn is not None:
            h = self.self_attn(h, rope, cos_sin, batch, attn)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        counts = batch.dp_tokens
        if counts is None:
            return self.mlp(h), residual
        # DP attention: the MLP is split over every rank, so it runs on every group's tokens.
        gathered = self.rows.gather_rows(h, counts)
        out = self.mlp(gathered, batch.dp_real_rows) if isinstance(self.mlp, DeepseekMoE) else self.mlp(gathered)
        return self.rows.own_rows(out, counts), residual


class NextNLayer(nn.Module):
    """DeepSeek-V3's multi-token-prediction layer: from the main model's last hidden state at position
    i and the embedding of token i + 1, a full decoder layer predicts token i + 2. Checkpoint prefix:
    `model.layers.{num_hidden_layers}`. The embedding and head are the main model's (the checkpoint
    repeats them; the copies are checked for shape and dropped). `eh_proj` is replicated (one small GEMM).
    `dp`: its decoder layer's attention on this rank's DP group's tokens, as the model's."""

    # The checkpoint's copies of the main model's embedding and head, under the layer's prefix.
    SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")

    def __init__(self, p: Parameters, layer_id: int, dp: DPGroups | None = None) -> None:
        super().__init__()
        hidden = p.config.hidden_size
        self.enorm, self.hnorm = p.norm(hidden), p.norm(hidden)
        self.eh_proj = p.linear(2 * hidden, hidden)
        self.layer = DecoderLayer(p, layer_id, dp)
        self.final_norm = p.norm(hidden)

    def checkpoint_tensors(self, prefix: str, vocab_size: int) -> dict[str, CheckpointTensor]:
        tensors = self.layer.checkpoint_tensors(prefix) | _linear_tensors(prefix, self.eh_proj, ["eh_proj"])
        for name, norm in (("enorm", self.enorm), ("hnorm", self.hnorm), ("shared_head.norm", self.final_norm)):
            tensors[f"{prefix}.{name}.weight"] = CheckpointTensor(tuple(norm.weight.shape), _copy_into(norm.weight))
        shared = (vocab_size, self.enorm.weight.shape[0])
        for name in self.SHARED_COPIES:
            tensors[f"{prefix}.{name}"] = CheckpointTensor(shared, lambda n, t, s: None, lazy=True)  # never read
        return tensors

    def forward(self, embeddings: torch.Tensor, hidden: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin,
                batch: ForwardBatch, attn: AttentionBackend | None) -> torch.Tensor:
        """embeddings [T, hidden] of the next tokens, hidden [T, hidden] of the main model -> [T, hidden],
        normed for the shared lm head. `attn` None: an IDLE batch (`DecoderLayer.forward`)."""
        x = self.eh_proj(torch.cat([self.enorm(embeddings), self.hnorm(hidden)], dim=-1))
        out, residual = self.layer(x, None, rope, cos_sin, batch, attn)
        return self.final_norm.add_forward(out, residual)[0]


class DeepseekForCausalLM(nn.Module):
    """The decoder stack plus lm head. KV-pool layer ids: decoder layers 0..L-1, then the NextN layer.
    `group`: the ranks this model is split over (module docstring); every rank runs every forward on the
    same inputs, or under DP attention (`dp`) on its own DP group's inputs. `expert_parallel`: the routed experts
    split over `group` whole (module docstring)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 with_nextn: bool = False, group: ParallelGroup = SINGLE, expert_parallel: bool = False,
                 dp: DPGroups | None = None) -> None:
        super().__init__()
        p = Parameters(config, dtype, device, group, expert_parallel)
        self.config, self.group = config, group
        self.rows = dp.rows if dp is not None else group  # the ranks `compute_logits`' `dp_rows` counts the rows of
        vocab = (config.vocab_size, config.hidden_size, dtype, device)
        # Under DP attention each rank embeds its own tokens: the whole table.
        self.embed_tokens = VocabParallelEmbedding(*vocab, group=SINGLE if dp is not None else group,
                                                   name="model.embed_tokens")
        self.layers = nn.ModuleList(DecoderLayer(p, i, dp) for i in range(config.num_hidden_layers))
        self.norm = p.norm(config.hidden_size)
        self.lm_head = ParallelLMHead(*vocab, group=group, name="lm_head")
        self.nextn = NextNLayer(p, config.num_hidden_layers, dp) if with_nextn else None
        # One rope for every layer: the rope dims and scaling are the model's.
        self.rotary = RotaryEmbedding(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling, device)
        self.backends: ModelBackends | None = None

    @property
    def num_kv_layers(self) -> int:
        return len(self.layers) + (self.nextn is not None)

    def checkpoint_tensors(self, checkpoint_layers: int | None = None, nextn: bool = True
                           ) -> dict[str, CheckpointTensor]:
        """Every tensor the checkpoint must provide, by its Hugging Face name. `checkpoint_layers`: the
        checkpoint's decoder-layer count (its NextN layer follows them), when the model keeps fewer; `nextn`
        False: without the NextN layer's (a draft checkpoint gives them)."""
        vocab = (self.config.vocab_size, self.config.hidden_size)
        tensors = {
            "model.embed_tokens.weight": CheckpointTensor(vocab, self.embed_tokens.load, lazy=True),
            "model.norm.weight": CheckpointTensor(tuple(self.norm.weight.shape), _copy_into(self.norm.weight)),
        }
        if not self.config.tie_word_embeddings:
            tensors["lm_head.weight"] = CheckpointTensor(vocab, self.lm_head.load, lazy=True)
        for i, layer in enumerate(self.layers):
            tensors |= layer.checkpoint_tensors(f"model.layers.{i}")
        if self.nextn is not None and nextn:
            mtp_index = checkpoint_layers if checkpoint_layers is not None else self.config.num_hidden_layers
            tensors |= self.nextn.checkpoint_tensors(f"model.layers.{mtp_index}", self.config.vocab_size)
        return tensors

    def finalize(self, backends: ModelBackends) -> None:
        """After loading: pack weights for the backends (FP8 GEMM layouts, stacked experts, W_UK / W_UV)."""
        if self.config.tie_word_embeddings:
            head, table = self.lm_head, self.embed_tokens
            if table.group.world_size == head.group.world_size:
                head.weight = table.weight  # the same vocabulary rows on every rank
            else:  # DP attention: the embedding is whole, the head this rank's rows of it
                rows = slice(head.vocab_start, head.vocab_start + head.num_local)
                head.weight.data[: head.num_local].copy_(table.weight[rows])
        for layer in self.layers:
            layer.finalize(backends)
        if self.nextn is not None:
            self.nextn.layer.finalize(backends)
            self.nextn.eh_proj.finalize(backends.gemm)
        self.backends = backends

    def use_small_ops(self, ops: SmallOps) -> None:
        """Run the element-wise ops (norms, rope, SiLU-and-mul, absorbed MLA's norm + rope + KV pool write) through
        `ops` (eager, compiled, with fused kernels)."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def overlap_shared_experts(self, enable: bool) -> None:
        """Run every MoE layer's shared experts on one second CUDA stream (or, `enable` False, inline)."""
        stream = torch.cuda.Stream(self.embed_tokens.weight.device) if enable else None
        for module in self.modules():
            if isinstance(module, DeepseekMoE):
                module.shared_stream = stream

    def _attention(self, batch: ForwardBatch, attention: AttentionBackend | None) -> AttentionBackend:
        """`attention` as given (planned by the caller), else the mode's backend, planned here."""
        if attention is not None:
            return attention
        if self.backends is None:
            raise RuntimeError("model used before finalize()")
        attn = self.backends.attention_for(batch.mode)
        attn.plan(batch)
        return attn

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                attention: AttentionBackend | None = None) -> torch.Tensor:
        """input_ids [T] int64 (the batch's new tokens) -> final hidden states [T, hidden], normed.
        `attention`: a backend already planned for `batch` (a CUDA graph's, or a batch-size bucket's);
        None plans the mode's backend. An IDLE batch (DP attention) attends over nothing."""
        attn = None if batch.mode is ForwardMode.IDLE else self._attention(batch, attention)
        cos_sin = self.rotary.cos_sin(batch.positions)
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, self.rotary, cos_sin, batch, attn)
        return self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]

    def forward_nextn(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                      attention: AttentionBackend | None = None) -> torch.Tensor:
        """The MTP layer: next_ids [T] (token i + 1 for each position i of `batch`), hidden [T, hidden]
        from `forward` -> [T, hidden] for `compute_logits` (predicting token i + 2). An IDLE batch (DP attention)
        attends over nothing."""
        if self.nextn is None:
            raise RuntimeError("the model was built without its NextN layer")
        attn = None if batch.mode is ForwardMode.IDLE else self._attention(batch, attention)
        cos_sin = self.rotary.cos_sin(batch.positions)
        return self.nextn(self.embed_tokens(next_ids), hidden, self.rotary, cos_sin, batch, attn)

    def compute_logits(self, hidden: torch.Tensor, dp_rows: Sequence[int] | None = None) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] float32, the whole vocabulary on every rank (each rank's
        [n, vocab / P] all-gathered: callers pass only the rows they sample). Under DP attention `dp_rows`
        gives each DP group's n: every group's rows are gathered first, and the logits are [sum(dp_rows), vocab],
        group 0's rows first."""
        if dp_rows is None:
            return self.lm_head(hidden)
        return unpad_rows(self.lm_head(self.rows.gather_rows(hidden, dp_rows)), dp_rows)
