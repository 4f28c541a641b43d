"""ModelRunner: picks the backends through the registry, loads the model, sizes the KV pool, and runs
one forward (plus picking the rows to sample) for the scheduler."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from plugserve.core.dispatch import AttnForwardMethod, prepare_attention
from plugserve.core.forward_batch import ForwardBatch, Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import AttentionSpec
from plugserve.core.kv_cache import MLAKVPool, PageAllocator
from plugserve.core.loader import load_model, read_config, resolve_dtype
from plugserve.core.models.deepseek import ModelBackends
from plugserve.core.server_args import ServerArgs, flag
from plugserve.registry import SelectionError, get_registry

logger = logging.getLogger(__name__)

KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "fp8_e4m3": torch.float8_e4m3fn}
# Without --max-total-tokens on the CPU: this much memory for the KV pool.
CPU_KV_BYTES = 512 << 20
DEFAULT_MEM_FRACTION_STATIC = 0.85


@dataclass(frozen=True)
class ChosenBackend:
    """One selection, as /server_info and the log report it."""

    kind: str
    phase: str
    name: str
    reason: str


class ModelRunner:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.device = torch.device(args.device if args.device != "auto" else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        self.hardware = Hardware.detect(self.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.config, checkpoint_layers = read_config(args.model_path, args.model_preset, args.quantization,
                                                     args.num_layers)
        self.context_length = min(args.context_length or self.config.max_position_embeddings,
                                  self.config.max_position_embeddings)
        self._warn_about_inert_flags()
        self.chosen: list[ChosenBackend] = []
        backends, self.page_size = self._create_backends()
        self.model = load_model(self.config, backends, model_path=args.model_path,
                                checkpoint_layers=checkpoint_layers, load_format=args.load_format, dtype=self.dtype,
                                device=self.device, seed=args.seed)
        # Ids the tokenizer can turn into text (set by the engine): checkpoints pad their vocabulary, and the
        # embedded tokenizer is smaller than a dummy preset's. Nothing beyond it is ever sampled.
        self.sample_vocab = self.config.vocab_size
        self.prefill_runs_mla = AttnForwardMethod.MLA in backends.attention_prefill.capabilities.methods
        self.max_total_tokens = self._kv_tokens()
        num_pages = self.max_total_tokens // self.page_size
        self.pool = MLAKVPool(self.model.num_kv_layers, num_pages, self.page_size, self.config.kv_lora_rank,
                              self.config.qk_rope_head_dim, self.kv_dtype, self.device)
        self.allocator = PageAllocator(num_pages)
        logger.info("KV pool: %d pages of %d tokens (%d tokens, %.2f GiB)", num_pages, self.page_size,
                    num_pages * self.page_size, self.pool_bytes / 2**30)

    # -- backends ------------------------------------------------------------------------------------

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.dtype if self.args.kv_cache_dtype == "auto" else KV_DTYPES[self.args.kv_cache_dtype]

    def _build(self, kind: str, phase: Phase, requested: str, flag_name: str, spec: Any, batch_size: int,
               fit_spec: Callable[[type, Any], Any] | None = None) -> Any:
        """The registry's first candidate that passes its start-up self-check, logged with why."""
        try:
            backend, selection = get_registry().build(kind, phase, batch_size, self.device, spec, requested,  # type: ignore[arg-type]
                                                      fit_spec)
        except SelectionError as exc:
            raise SelectionError(f"{flag_name}: {exc}") from None
        logger.info("%s %s backend: %s (%s)", kind, phase.value, backend.name, selection.reason)
        self.chosen.append(ChosenBackend(kind, phase.value, backend.name, selection.reason))
        return backend

    def _create_backends(self) -> tuple[ModelBackends, int]:
        args, config = self.args, self.config
        max_batch = args.max_running_requests or 1
        decode_flag = flag("decode_attention_backend") if args.decode_attention_backend else flag("attention_backend")
        prefill_flag = (flag("prefill_attention_backend") if args.prefill_attention_backend
                        else flag("attention_backend"))

        def with_page_size(cls: type, spec: AttentionSpec) -> AttentionSpec:
            # --page-size, else the one the decode backend forces, else 1 (usability checked the flag).
            forced = cls.capabilities.forced_page_size()
            return dataclasses.replace(spec, page_size=args.page_size or forced or 1)

        decode = self._build("attention", Phase.DECODE, args.decode_attention, decode_flag,
                             config.attention_spec(self.dtype, args.page_size, self.kv_dtype), max_batch,
                             with_page_size)
        spec = decode.spec
        prefill_tokens = args.chunked_prefill_size if args.chunked_prefill_size > 0 else 8192
        prefill = self._build("attention", Phase.PREFILL, args.prefill_attention, prefill_flag, spec, prefill_tokens)
        moe = gemm = None
        if config.n_routed_experts:
            moe = self._build("moe", Phase.DECODE, args.moe_runner_backend, flag("moe_runner_backend"),
                              config.moe_spec(self.dtype), max_batch)
        if config.fp8_block:
            gemm = self._build("gemm", Phase.DECODE, args.fp8_gemm_backend, flag("fp8_gemm_backend"),
                               config.gemm_spec(self.dtype), max_batch)
        backends = ModelBackends(attention_prefill=prefill, attention_decode=decode, moe=moe, gemm=gemm)
        return backends, spec.page_size

    def _warn_about_inert_flags(self) -> None:
        args = self.args
        if self.device.type == "cpu":
            if args.enable_torch_compile:
                logger.warning("%s does nothing on the CPU: the model runs eagerly", flag("enable_torch_compile"))
            if args.cuda_graph_max_bs is not None:
                logger.warning("%s does nothing on the CPU: there are no CUDA graphs", flag("cuda_graph_max_bs"))
        else:
            if not args.disable_cuda_graph or args.enable_torch_compile:
                logger.warning("CUDA graphs and torch.compile are not wired in yet: decode runs eagerly "
                               "(%s / %s are accepted for compatibility)", flag("disable_cuda_graph"),
                               flag("enable_torch_compile"))

    # -- memory --------------------------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        width = self.config.kv_lora_rank + self.config.qk_rope_head_dim
        return self.model.num_kv_layers * width * torch.empty(0, dtype=self.kv_dtype).element_size()

    @property
    def pool_bytes(self) -> int:
        return self.pool.num_slots * self.bytes_per_token

    def _kv_tokens(self) -> int:
        """--max-total-tokens, else what --mem-fraction-static leaves on the GPU, else CPU_KV_BYTES."""
        if self.args.max_total_tokens is not None:
            tokens = self.args.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            fraction = self.args.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
            budget = free - total * (1 - fraction)  # weights are loaded already: what is left of the fraction
            tokens = int(budget // self.bytes_per_token)
        else:
            tokens = CPU_KV_BYTES // self.bytes_per_token
        tokens = tokens // self.page_size * self.page_size
        if tokens < self.page_size * 2:
            raise ValueError(f"the KV pool would hold only {tokens} tokens: raise {flag('max_total_tokens')} or "
                             f"{flag('mem_fraction_static')}")
        return tokens

    # -- running -------------------------------------------------------------------------------------

    def prepare(self, batch: ForwardBatch) -> ForwardBatch:
        return prepare_attention(
            batch,
            chunked_prefix_cache_threshold=self.args.chunked_prefix_cache_threshold,
            prefill_supports_mla=self.prefill_runs_mla,
        )

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, sample_rows: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> logits [len(sample_rows), sample_vocab] float32 at the token rows to sample."""
        hidden = self.model(input_ids, batch)
        return self.model.compute_logits(hidden[sample_rows])[:, : self.sample_vocab]
