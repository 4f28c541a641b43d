"""The model being trained: transformers' DeepseekV3ForCausalLM plus our multi-token-prediction (NextN) module,
DeepSeek-V3's training losses, and its auxiliary-loss-free load balancing.

The MTP module follows DeepSeek-V3 (arXiv 2412.19437, section 2.2) in the form its checkpoints publish and
SGLang, vLLM and plugserve serve it: for position i, the main model's final normed hidden state h_i and the
embedding of token i + 1 give eh_proj([enorm(emb); hnorm(h)]), which a full decoder layer (attention + MoE)
and shared_head.norm turn into logits for token i + 2 through the main model's lm head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3TopkRouter,
)

INIT_STD = 0.02


def model_config(vocab_size: int, seq_len: int = 512, **overrides) -> DeepseekV3Config:
    """DeepSeek-V3's structure at ~16 M parameters: MLA with q LoRA, YaRN (factor 4 over the training length),
    one dense layer then MoE layers of 8 routed experts (top 2 of 2 groups of 4, sigmoid scores, noaux_tc) and one
    shared expert, one MTP layer. Widths are multiples of 128 where two checkpoint tensors share one fused GEMM
    (q_a_proj ++ kv_a_proj_with_mqa, gate_proj ++ up_proj), so each keeps its own 128 x 128 FP8 blocks."""
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
        num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, num_nextn_predict_layers=1, max_position_embeddings=4 * seq_len,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=seq_len, beta_fast=32,
                          beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
        rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=INIT_STD, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1,
    )
    config = DeepseekV3Config(**(kwargs | overrides))
    config._attn_implementation = "sdpa"  # causal without a mask tensor, also in the MTP layer
    config._experts_implementation = "eager"  # plain per-expert linears: autocast-safe on every device
    return config


class SharedHead(nn.Module):
    """`shared_head` of DeepSeek's MTP layer: its own final norm; the head itself is the main model's lm_head."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MultiTokenPrediction(nn.Module):
    """One MTP module (depth 1). Parameter names are those of `model.layers.{num_hidden_layers}` in DeepSeek's
    checkpoints, with the decoder layer's under `layer.`."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # layer_idx past the dense layers: an MoE layer, as DeepSeek-V3's MTP layer is.
        self.layer = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.shared_head = SharedHead(config)

    def forward(self, hidden: torch.Tensor, next_embeddings: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        """hidden [B, T, H]: the main model's final normed states at positions 0..T-1; next_embeddings [B, T, H]:
        embeddings of tokens 1..T -> [B, T, H] normed states for the lm head, predicting tokens 2..T+1."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeddings), self.hnorm(hidden)], dim=-1))
        x = self.layer(x, attention_mask=mask, position_embeddings=position_embeddings)
        return self.shared_head.norm(x)


@dataclass
class Losses:
    """Scalar float32 tensors of one batch; `total` is what is minimized."""

    total: torch.Tensor
    main: torch.Tensor
    mtp: torch.Tensor
    balance: torch.Tensor
    mtp_agreement: torch.Tensor  # share of positions where the MTP's top-1 is the main model's greedy next-next


class TrainingModel(nn.Module):
    """Main model + MTP module, with DeepSeek-V3's objective: next-token cross entropy, plus `mtp_weight` (lambda)
    times the MTP loss, plus `balance_alpha` times the sequence-wise balance loss summed over MoE layers."""

    def __init__(self, config: DeepseekV3Config, mtp_weight: float = 0.3, balance_alpha: float = 1e-4) -> None:
        super().__init__()
        self.config = config
        self.lm = DeepseekV3ForCausalLM(config)
        self.mtp = MultiTokenPrediction(config)
        self.mtp_weight, self.balance_alpha = mtp_weight, balance_alpha
        self.routers = [m for m in self.modules() if isinstance(m, DeepseekV3TopkRouter)]
        # (router logits [N, E] float32, chosen experts [N, k]) of each router in the last training forward
        self.routed: list[tuple[torch.Tensor, torch.Tensor]] = []
        for router in self.routers:
            router.register_forward_hook(self._record_routing)
        init_weights(self)

    def _record_routing(self, module: nn.Module, args: tuple, output: tuple[torch.Tensor, ...]) -> None:
        if module.training:
            self.routed.append((output[0], output[2]))

    def logits(self, inputs: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs [B, T] and next_tokens [B, T] (inputs shifted by one) int64 -> logits [B, T, vocab] float32 of
        the main model (for tokens 1..T) and of the MTP module (for tokens 2..T+1)."""
        base = self.lm.model
        hidden = base(input_ids=inputs).last_hidden_state
        positions = torch.arange(inputs.shape[1], device=inputs.device)[None]
        embeddings = base.embed_tokens(next_tokens)
        mask = create_causal_mask(config=self.config, inputs_embeds=embeddings, attention_mask=None,
                                  past_key_values=None, position_ids=positions)
        mtp_hidden = self.mtp(hidden, embeddings, base.rotary_emb(hidden, positions), mask)
        return self.lm.lm_head(hidden).float(), self.lm.lm_head(mtp_hidden).float()

    def forward(self, tokens: torch.Tensor) -> Losses:
        """tokens [B, T + 2] int64: inputs are tokens[:, :T]; the main model predicts tokens[:, 1:T+1], the MTP
        module tokens[:, 2:T+2]."""
        self.routed.clear()
        logits, mtp_logits = self.logits(tokens[:, :-2], tokens[:, 1:-1])
        main = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:-1].flatten())
        mtp = F.cross_entropy(mtp_logits.flatten(0, 1), tokens[:, 2:].flatten())
        # Position i's MTP guess for token i + 2 against the main model's greedy choice at i + 1.
        agreement = (mtp_logits[:, :-1].argmax(-1) == logits[:, 1:].argmax(-1)).float().mean()
        balance = sum((self._balance_loss(lg, ids, tokens.shape[0]) for lg, ids in self.routed),
                      start=torch.zeros((), device=tokens.device))
        total = main + self.mtp_weight * mtp + self.balance_alpha * balance
        return Losses(total, main.detach(), mtp.detach(), balance.detach(), agreement)

    def _balance_loss(self, router_logits: torch.Tensor, chosen: torch.Tensor, batch: int) -> torch.Tensor:
        """DeepSeek-V3's complementary sequence-wise balance loss of one MoE layer: per sequence, sum over experts
        of f_i * P_i, where f_i = E / (k T) * (tokens routed to i) and P_i the mean normalized affinity; averaged
        over sequences. router_logits [B*T, E] float32, chosen [B*T, k]."""
        experts, k = router_logits.shape[-1], chosen.shape[-1]
        scores = router_logits.sigmoid().view(batch, -1, experts)
        affinity = (scores / scores.sum(-1, keepdim=True)).mean(1)  # [B, E]
        counts = F.one_hot(chosen.view(batch, -1), experts).sum(1).float()  # [B, E]
        load = counts * experts / (k * scores.shape[1])
        return (load * affinity).sum(-1).mean()

    @torch.no_grad()
    def update_routing_bias(self, rate: float) -> torch.Tensor:
        """Auxiliary-loss-free balancing (DeepSeek-V3, section 2.1.2): after each step, each router's
        e_score_correction_bias goes down by `rate` for experts that got more than the mean load in the last
        forward and up for those that got less. Returns the max/mean load ratio of each router [layers]."""
        ratios = []
        for router, (_, chosen) in zip(self.routers, self.routed, strict=True):
            load = torch.bincount(chosen.flatten(), minlength=router.num_experts).float()
            router.e_score_correction_bias += rate * torch.sign(load.mean() - load)
            ratios.append(load.max() / load.mean())
        return torch.stack(ratios)


@torch.no_grad()
def init_weights(model: nn.Module, std: float = INIT_STD) -> None:
    """N(0, std) for every weight matrix (linears, stacked experts, routers, embeddings), ones for RMSNorms, zero
    correction biases: the same for the main model and the MTP module, whatever transformers initialized."""
    for module in model.modules():
        if isinstance(module, DeepseekV3RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, DeepseekV3TopkRouter):
            module.e_score_correction_bias.zero_()
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.normal_(0.0, std)
        elif "norm" not in name:
            raise ValueError(f"no initialization rule for {name} {tuple(param.shape)}")


def parameter_counts(model: TrainingModel) -> dict[str, int]:
    """Parameters of the main model (embeddings and head included), of the MTP module, and those one token
    activates in the main model (k routed experts of E)."""
    main = sum(p.numel() for p in model.lm.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    config = model.config
    inactive_share = 1 - config.num_experts_per_tok / config.n_routed_experts
    experts = sum(p.numel() for n, p in model.lm.named_parameters() if ".mlp.experts." in n)
    return {"main": main, "mtp": mtp, "total": main + mtp, "main_active": main - round(experts * inactive_share)}
