"""The backends one ModelRunner runs, chosen through the registry: attention per phase and batch-size bucket (all
on one KV pool), the model's MoE and FP8 GEMM backends per row-count bucket (`row_buckets`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from plugserve.conformance.self_check import self_check
from plugserve.core.config import ModelConfig
from plugserve.core.distributed import ParallelGroup
from plugserve.core.forward_batch import ForwardBatch, ForwardMode, Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import AttentionBackend, Backend
from plugserve.core.models.deepseek import ModelBackends
from plugserve.core.specs import AttentionSpec, MoESpec
from plugserve.registry import SelectionError, SelectionTable, get_registry, load_selection_table
from plugserve.runtime.row_buckets import Bucket, GemmByRows, MoEByRows, in_bucket
from plugserve.runtime.server_args import ServerArgs, flag

logger = logging.getLogger(__name__)

# Prefill tokens the prefill backends are chosen for without chunked prefill (the warm-up's longest prompt).
WARMUP_PREFILL_TOKENS = 8192


@dataclass(frozen=True)
class ChosenBackend:
    """One selection, as /server_info and the log report it: for batches up to `max_batch_size` requests (decode
    attention), tokens (prefill attention) or rows (GEMM and MoE: a decode pick up to the largest batch, above it
    a prefill pick)."""

    kind: str
    phase: str
    name: str
    reason: str
    max_batch_size: int


def unchecked(backend: Any, phase: Phase) -> None:
    """The start-up check of a backend that is not checked."""


class RunnerBackends:
    """Every backend of one rank's model, built (and self-checked) at construction. `chosen` lists each
    selection with its reason; the decode backend of the largest batch fixes `page_size`."""

    def __init__(self, args: ServerArgs, config: ModelConfig, hardware: Hardware, device: torch.device,
                 dtype: torch.dtype, kv_dtype: torch.dtype, group: ParallelGroup, dp_size: int, max_batch: int,
                 self_check: bool = True) -> None:
        """`self_check`: False builds the first usable candidates unchecked (`precompile`'s replicas)."""
        self.args, self.config, self.hardware, self.device = args, config, hardware, device
        self.self_check = self_check
        for broken in get_registry().broken:
            logger.warning("plugin %s (package %s) failed to load and is skipped: %s", broken.plugin, broken.package,
                           broken.error)
        self.chosen: list[ChosenBackend] = []
        decode_flag = flag("decode_attention_backend") if args.decode_attention_backend else flag("attention_backend")
        prefill_flag = (flag("prefill_attention_backend") if args.prefill_attention_backend
                        else flag("attention_backend"))

        def with_page_size(cls: type, spec: AttentionSpec) -> AttentionSpec:
            # --page-size, else the one the decode backend forces, else 1 (usability checked the flag).
            forced = cls.capabilities.forced_page_size()
            return dataclasses.replace(spec, page_size=args.page_size or forced or 1)

        # The backend of the largest decode batch fixes the page size; every other bucket must live with it.
        built: dict[str, Any] = {}
        invariant = args.enable_deterministic_inference  # only batch-invariant backends fit such specs
        attention_spec = config.attention_spec(dtype, args.page_size, kv_dtype, group.world_size // dp_size)
        decode = self._build("attention", Phase.DECODE, args.decode_attention, decode_flag,
                             dataclasses.replace(attention_spec, batch_invariant=invariant), max_batch, with_page_size,
                             built)
        spec = decode.spec
        self.page_size: int = spec.page_size
        self.decode_buckets = self._buckets(Phase.DECODE, args.decode_attention, decode_flag, spec, max_batch,
                                            decode, built)
        prefill_tokens = args.prefill_token_budget or WARMUP_PREFILL_TOKENS
        prefill = self._build("attention", Phase.PREFILL, args.prefill_attention, prefill_flag, spec, prefill_tokens,
                              built=built)
        self.prefill_buckets = self._buckets(Phase.PREFILL, args.prefill_attention, prefill_flag, spec,
                                             prefill_tokens, prefill, built)
        moe = gemm = None
        for name, needed, has in (("moe_runner_backend", "routed experts", config.n_routed_experts),
                                  ("fp8_gemm_backend", f"block-FP8 weights (give {flag('quantization')} fp8 to "
                                   "quantize them on load)", config.fp8_block)):
            if getattr(args, name) != "auto" and not has:
                raise ValueError(f"{flag(name)} {getattr(args, name)}: the model has no {needed}")
        if config.n_routed_experts:
            moe_spec = dataclasses.replace(config.moe_spec(dtype, group.world_size, args.ep_size,
                                                           group.rank if args.ep_size > 1 else 0),
                                           batch_invariant=invariant)
            moe = self._build_packed("moe", args.moe_runner_backend, moe_spec, max_batch, prefill_tokens,
                                     self._fuse_shared_experts)
        if args.enable_shared_experts_fusion and not (moe is not None and moe.spec.num_shared_experts):
            why = (f"the moe backend {moe.name} does not fuse them (triton does: {flag('moe_runner_backend')} "
                   "triton)" if moe is not None and config.n_shared_experts else "the model has no shared experts")
            raise ValueError(f"{flag('enable_shared_experts_fusion')}: {why}")
        if config.fp8_block:
            gemm = self._build_packed("gemm", args.fp8_gemm_backend,
                                      dataclasses.replace(config.gemm_spec(dtype), batch_invariant=invariant),
                                      max_batch, prefill_tokens)
        self.model = ModelBackends(attention_prefill=prefill, attention_decode=decode, moe=moe, gemm=gemm)

    def attention(self, batch: ForwardBatch) -> AttentionBackend:
        """The attention backend of this batch's phase and size bucket: prefill by new tokens, every
        other mode by requests."""
        if batch.mode is ForwardMode.EXTEND:
            return in_bucket(self.prefill_buckets, batch.num_tokens)
        return in_bucket(self.decode_buckets, batch.batch_size)

    @property
    def by_rows(self) -> dict[str, str]:
        """The GEMM and MoE backends by row count, and the memory their packs take beyond the weights (for
        /server_info and the log after loading)."""
        out = {}
        for kind, backend in (("gemm", self.model.gemm), ("moe", self.model.moe)):
            if isinstance(backend, GemmByRows | MoEByRows):
                out[kind] = (f"{backend.rows.describe()}; their packs add {backend.rows.extra_bytes / 2**20:.1f} MiB "
                             "to the first's")
            elif backend is not None:
                out[kind] = f"{backend.name} at every row count"
        return out

    @property
    def shared_experts_mode(self) -> str:
        """How the MoE layers run their shared experts (for /server_info)."""
        moe = self.model.moe
        if not self.config.n_shared_experts or moe is None:
            return "none"
        if moe.spec.num_shared_experts:
            return f"fused into the {moe.name} MoE backend's GEMMs"
        overlap = self.device.type == "cuda" and not self.args.disable_shared_experts_overlap
        stream = "on a second CUDA stream" if overlap else "on the main stream"
        return f"own MLP {stream}"

    def _build(self, kind: str, phase: Phase, requested: str, flag_name: str, spec: Any, batch_size: int,
               fit_spec: Callable[[type, Any], Any] | None = None, built: dict[str, Any] | None = None) -> Any:
        """The registry's first candidate that passes its start-up self-check (reusing `built` instances),
        logged with why."""
        try:
            backend, selection = get_registry().build(kind, phase, batch_size, self.device, spec, requested,  # type: ignore[arg-type]
                                                      fit_spec, built,
                                                      check=self_check if self.self_check else unchecked)
        except SelectionError as exc:
            raise SelectionError(f"{flag_name}: {exc}") from None
        logger.info("%s %s backend up to %d: %s (%s)", kind, phase.value, batch_size, backend.name, selection.reason)
        self.chosen.append(ChosenBackend(kind, phase.value, backend.name, selection.reason, batch_size))
        if built is not None:
            built[backend.name] = backend
        return backend

    def _buckets(self, phase: Phase, requested: str, flag_name: str, spec: AttentionSpec, largest: int,
                 first: AttentionBackend, built: dict[str, Any]) -> list[Bucket[AttentionBackend]]:
        """`first` (chosen for `largest`) plus, under `auto`, the backend ranked first at each smaller
        bucket bound of the measured table: one instance per backend, all on one KV pool."""
        buckets = [Bucket(largest, first)]
        table = self._bucket_table(requested)
        if table is None:
            return buckets
        bounds = table.bucket_bounds("attention", phase, largest)[:-1]
        buckets[:0] = [Bucket(b, self._build("attention", phase, requested, flag_name, spec, b, built=built))
                       for b in bounds]
        return buckets

    def _bucket_table(self, requested: str) -> SelectionTable | None:
        """The measured table whose bucket bounds smaller sizes get their own backend at, or None: one backend at
        every size (a backend named, no table, or deterministic inference, where a row's bits would otherwise
        follow its batch's size)."""
        loaded = load_selection_table(self.hardware)
        if requested != "auto" or loaded is None or self.args.enable_deterministic_inference:
            return None
        return loaded[0]

    def _fuse_shared_experts(self, cls: type, spec: MoESpec) -> MoESpec:
        """The MoE spec a candidate backend is built with: the shared experts fused into its GEMMs under
        --enable-shared-experts-fusion when it can."""
        shared = self.config.n_shared_experts
        if not shared or not self.args.enable_shared_experts_fusion or not cls.capabilities.shared_experts_fusion:
            return spec
        return dataclasses.replace(spec, num_shared_experts=shared)

    def _build_packed(self, kind: str, requested: str, spec: Any, max_batch: int, prefill_tokens: int,
                      fit_spec: Callable[[type, Any], Any] | None = None) -> Any:
        """A MoE or GEMM backend for the model. Under `auto` with a measured table, the table's pick for each bucket
        of rows (tokens): the decode ranking up to `max_batch` rows, the prefill ranking above, as `backends
        --explain` lists them; a `GemmByRows` / `MoEByRows` when the picks differ."""
        name = flag("moe_runner_backend" if kind == "moe" else "fp8_gemm_backend")
        built: dict[str, Any] = {}
        primary = self._build(kind, Phase.DECODE, requested, name, spec, max_batch, fit_spec, built)
        table = self._bucket_table(requested)
        if table is None:
            return primary
        bounds = [(Phase.DECODE, b) for b in table.bucket_bounds(kind, Phase.DECODE, max_batch)[:-1]]  # type: ignore[arg-type]
        bounds += [(Phase.PREFILL, b) for b in table.bucket_bounds(kind, Phase.PREFILL, prefill_tokens)  # type: ignore[arg-type]
                   if b > max_batch]
        buckets: list[Bucket[Backend]] = []
        for phase, bound in sorted([*bounds, (Phase.DECODE, max_batch)], key=lambda pair: pair[1]):
            backend = primary if bound == max_batch else self._build(kind, phase, requested, name, spec, bound,
                                                                       fit_spec, built)
            if backend.spec != primary.spec:  # e.g. one fuses the shared experts: the model packs for one spec
                reason = f"{backend.name} ranks first but runs another spec than {primary.name} ({backend.spec})"
                logger.info("%s up to %d rows: %s: %s", kind, bound, primary.name, reason)
                self.chosen[-1] = ChosenBackend(kind, phase.value, primary.name, reason, bound)
                backend = primary
            buckets.append(Bucket(bound, backend))
        if len({id(b.backend) for b in buckets}) == 1:
            return primary
        return (MoEByRows if kind == "moe" else GemmByRows)(buckets)  # type: ignore[arg-type]
