"""ModelRunner: picks the backends through the registry (per phase and batch-size bucket), loads the
model, sizes the KV pool, warms up (JIT compiles, CUDA-graph capture) and runs one forward (plus
picking the rows to sample) for the scheduler.

Under tensor parallelism every rank has a ModelRunner holding its part of the model and a whole KV pool
of the same size. Rank 0's (the scheduler's) `forward` first sends the batch to the others, whose
`follow` runs the same forward; `warm_up` runs on every rank alike. Under DP attention rank 0's
`forward_groups` sends every DP group's batch, and each rank runs its own group's (its pool holds that
group's KV), an IDLE one when its group has none."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from tqdm import tqdm

from plugserve.core.block_table import DeviceBlockTable
from plugserve.core.dispatch import prepare_attention
from plugserve.core.distributed import SINGLE, ParallelGroup
from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode, Phase
from plugserve.core.graph_inputs import GraphInputs, capture_sizes
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import AttentionBackend, AttentionSpec, MoESpec
from plugserve.core.kv_cache import MLAKVPool, PageAllocator, pages_needed
from plugserve.core.layers.small_ops import EAGER, SmallOps
from plugserve.core.loader import load_model, read_config, resolve_dtype
from plugserve.core.models.deepseek import ModelBackends
from plugserve.registry import SelectionError, get_registry, load_selection_table
from plugserve.runtime.cuda_graph_runner import CudaGraphRunner, GraphForward, init_graph_attention
from plugserve.runtime.server_args import ServerArgs, flag
from plugserve.runtime.speculative import greedy_round_forward

logger = logging.getLogger(__name__)


def report_late_triton_compiles(on_compile: Callable[[], None] | None = None) -> None:
    """From now on (after the warm-up), log a warning for each Triton kernel compiled, naming it and its
    specialization (argument dtypes, 16-byte alignments, constexprs), and call `on_compile` (the engine's metrics
    counter): a compile inside a request stalls it for tens to hundreds of milliseconds, so each one names a shape
    or layout the warm-up should walk. Triton's hook is one per process: the last engine warmed up reports. A
    no-op without triton or on a release without `knobs.runtime.jit_post_compile_hook`."""
    try:
        from triton import knobs
    except ImportError:
        return
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return

    def warn(**details: Any) -> None:
        logger.warning("Triton compiled a kernel after the warm-up (the request waited for it): %s",
                       _describe_compile(details))
        if on_compile is not None:
            on_compile()

    runtime.jit_post_compile_hook = warn


def _describe_compile(details: dict[str, Any]) -> str:
    """`name(arg: type, ...) divisible by 16: [args] constexprs {...}` from the keywords triton's JIT passes its
    hooks (`compile`: signature, constants, configs; a pointer "divisible by 16" is 16-byte aligned), or its own
    `repr` where those differ."""
    try:
        compile_info = details["compile"]
        signature: dict[str, str] = compile_info["signature"]
        names = list(signature)
        divisible = sorted(names[index[0]] for attrs in compile_info["configs"] for index, values in attrs.items()
                           if any(value[0] == "tt.divisibility" for value in values))
        args = ", ".join(f"{name}: {kind}" for name, kind in signature.items() if kind != "constexpr")
        constants = {names[key[0]] if isinstance(key, tuple) else key: value
                     for key, value in compile_info["constants"].items()}
        return f"{details['fn'].name}({args}) divisible by 16: {divisible} constexprs {constants}"
    except (KeyError, TypeError, IndexError, AttributeError):
        return str(details.get("repr", details.get("key")))


KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "fp8_e4m3": torch.float8_e4m3fn}
# Without --max-total-tokens on the CPU: this much memory for the KV pool.
CPU_KV_BYTES = 512 << 20
DEFAULT_MEM_FRACTION_STATIC = 0.85
# Without --max-running-requests: SGLang's defaults (the CPU runs far fewer at once).
DEFAULT_MAX_RUNNING = {"cuda": 256, "cpu": 64}
# Warm-up prefill: the longest prompt chunk compiled before serving, and a short extension over it
# (absorbed-MLA extend over a cached prefix).
WARMUP_PREFILL_TOKENS = 8192
WARMUP_EXTEND_TOKENS = 16
CPU_WARMUP_TOKENS = 64  # nothing compiles on the CPU: the warm-up only walks the paths
# The warm-up prefills every power of two from here to the largest bucket: Triton's MoE and GEMM backends pick
# launch configurations by token count, and a prompt between two warmed sizes would otherwise compile its own on
# first use (2-4 s on an H100). Shorter prompts use what the decode buckets warm.
WARMUP_MIN_PREFILL_TOKENS = 16


@dataclass(frozen=True)
class ChosenBackend:
    """One selection, as /server_info and the log report it: for batches up to `max_batch_size`
    requests (decode) or tokens (prefill)."""

    kind: str
    phase: str
    name: str
    reason: str
    max_batch_size: int


class Part(NamedTuple):
    """One DP group's share of a forward: input_ids [T] int64 and sample_rows [S] int64 on the device, with its
    batch (without DP attention, the one group's: the whole forward)."""

    input_ids: torch.Tensor
    batch: ForwardBatch
    sample_rows: torch.Tensor


class _Header(NamedTuple):
    """A DP group's batch as rank 0 sends it (the lengths; the tensors follow in one payload)."""

    mode: ForwardMode
    seq_lens: list[int]
    extend_lens: list[int]
    width: int  # block-table columns
    num_sampled: int

    @property
    def sizes(self) -> list[int]:
        """Elements of its input ids, sample rows and block table in the payload."""
        return [sum(self.extend_lens), self.num_sampled, len(self.seq_lens) * self.width]


@dataclass(frozen=True)
class GraphPlan:
    """A forward captured in CUDA graphs: its mode and new tokens per request, and whether it is the NextN
    layer's (which reads hidden states [N, H] beside the token ids). Its outputs: logits [N, vocab] float32 when
    `logits`, then each row's greedy token [N] int64 (the logits' argmax over the sampled vocabulary) when
    `greedy`, then the final hidden states [N, H] in the model dtype when `hidden`. `round`: instead, a whole
    round of greedy chains (`speculative.greedy_round_forward`, whose docstring lists its outputs; it reads hidden
    states too)."""

    mode: ForwardMode
    tokens_per_request: int
    nextn: bool
    logits: bool
    hidden: bool
    greedy: bool = False
    round: bool = False

    @property
    def label(self) -> str:
        if self.round:
            return "greedy round"
        return f"draft {self.mode.name}" if self.nextn and self.mode is ForwardMode.DECODE else self.mode.name


@dataclass(frozen=True)
class Bucket:
    """An attention backend for batches up to `max_size` requests (decode) or tokens (prefill)."""

    max_size: int
    backend: AttentionBackend


def rank_device(args: ServerArgs, rank: int) -> torch.device:
    """The device of tensor-parallel rank `rank`: --device (auto: CUDA when there is one), on a GPU the
    node's GPU number rank mod ranks-per-node."""
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and args.tp_size > 1:
        return torch.device("cuda", rank % args.ranks_per_node)
    return torch.device(name)


class ModelRunner:
    def __init__(self, args: ServerArgs, group: ParallelGroup = SINGLE) -> None:
        """`group`: the tensor-parallel ranks, this process's rank among them (SINGLE: one process)."""
        if group.world_size != args.tp_size:
            raise ValueError(f"{flag('tp_size')} {args.tp_size} needs one ModelRunner per rank, in a world of that "
                             f"size (the Engine starts them), not one in a world of {group.world_size}")
        self.args, self.group = args, group
        # DP attention: rank r runs group r's attention (--dp-size is --tp-size); else one group of every rank.
        self.dp_size = args.dp_attention_size
        self.dp_rank = group.rank if self.dp_size > 1 else 0
        self.device = rank_device(args, group.rank)
        self.hardware = Hardware.detect(self.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.config, checkpoint_layers = read_config(args.model_dir, args.model_preset, args.quantization,
                                                     args.num_layers)
        self.context_length = min(args.context_length or self.config.max_position_embeddings,
                                  self.config.max_position_embeddings)
        self.max_running_requests = args.max_running_requests or DEFAULT_MAX_RUNNING[self.device.type]
        self.graph_max_bs = self._check_gpu_flags()
        for broken in get_registry().broken:
            logger.warning("plugin %s (package %s) failed to load and is skipped: %s", broken.plugin, broken.package,
                           broken.error)
        self.chosen: list[ChosenBackend] = []
        backends, self.page_size = self._create_backends()
        self.model = load_model(self.config, backends, model_path=args.model_dir,
                                checkpoint_layers=checkpoint_layers, load_format=args.load_format, dtype=self.dtype,
                                device=self.device, seed=args.seed, group=group, expert_parallel=args.ep_size > 1,
                                dp_attention=self.dp_size > 1, draft_model_path=args.speculative_draft_model_path,
                                dummy_nextn=args.speculative is not None)
        small_ops = SmallOps.compiled(args.torch_compile_max_bs) if args.enable_torch_compile else EAGER
        self.model.use_small_ops(small_ops.with_fused_kernels(self.device))
        if self.device.type == "cuda":
            self.model.overlap_shared_experts(not args.disable_shared_experts_overlap)
        elif args.disable_shared_experts_overlap:
            raise ValueError(f"{flag('disable_shared_experts_overlap')} needs a CUDA device: the CPU has no streams")
        # --seed: what unseeded requests sample from, this engine's own (nothing else in the process draws from it).
        self.sampling_generator = torch.Generator(device=self.device).manual_seed(args.seed)
        # Ids the tokenizer can turn into text (set by the engine): checkpoints pad their vocabulary, and the
        # embedded tokenizer is smaller than a dummy preset's. Nothing beyond it is ever sampled.
        self.sample_vocab = self.config.vocab_size
        # Rows for every running request and the one mid chunked prefill, long enough for the drafts a speculative
        # round writes past a request's length; allocated before the pool is sized.
        lookahead = args.speculative.lookahead if args.speculative is not None else 0
        self.block_table = DeviceBlockTable(self.max_running_requests + 1,
                                            pages_needed(self.context_length + 1 + lookahead, self.page_size),
                                            self.device)
        graph_bytes = self._graph_bytes(self.graph_max_bs) if self.graph_max_bs else 0
        self.max_total_tokens = self._kv_tokens(graph_bytes)
        num_pages = self.max_total_tokens // self.page_size
        # One page more than the allocator hands out: padding rows of CUDA graphs read and write only it.
        self.padding_page = num_pages
        self.pool = MLAKVPool(self.model.num_kv_layers, num_pages + 1, self.page_size, self.config.kv_lora_rank,
                              self.config.qk_rope_head_dim, self.kv_dtype, self.device)
        self.allocator = PageAllocator(num_pages)
        logger.info("KV pool: %d pages of %d tokens (%d tokens, %.2f GiB)", num_pages, self.page_size,
                    num_pages * self.page_size, self.pool_bytes / 2**30)
        # Captured graphs by mode: the target's (DECODE, or TARGET_VERIFY with speculative decoding) and the
        # NextN layer's (draft DECODE steps, DRAFT_EXTEND).
        self.target_graphs: dict[ForwardMode, CudaGraphRunner] = {}
        self.nextn_graphs: dict[ForwardMode, CudaGraphRunner] = {}
        # A whole round of greedy chains in one graph (TARGET_VERIFY-shaped), when the attention backends allow it.
        self.round_graph: CudaGraphRunner | None = None
        self.graph_status = ("disabled by --disable-cuda-graph" if args.disable_cuda_graph else
                             "no CUDA graphs on the CPU" if self.device.type != "cuda" else
                             "decode runs eagerly under --enable-dp-attention (no graphs for it yet)"
                             if self.dp_size > 1 else "not captured yet")

    # -- backends ------------------------------------------------------------------------------------

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.dtype if self.args.kv_cache_dtype == "auto" else KV_DTYPES[self.args.kv_cache_dtype]

    def _build(self, kind: str, phase: Phase, requested: str, flag_name: str, spec: Any, batch_size: int,
               fit_spec: Callable[[type, Any], Any] | None = None, built: dict[str, Any] | None = None) -> Any:
        """The registry's first candidate that passes its start-up self-check (reusing `built` instances),
        logged with why."""
        try:
            backend, selection = get_registry().build(kind, phase, batch_size, self.device, spec, requested,  # type: ignore[arg-type]
                                                      fit_spec, built)
        except SelectionError as exc:
            raise SelectionError(f"{flag_name}: {exc}") from None
        logger.info("%s %s backend up to %d: %s (%s)", kind, phase.value, batch_size, backend.name, selection.reason)
        self.chosen.append(ChosenBackend(kind, phase.value, backend.name, selection.reason, batch_size))
        if built is not None:
            built[backend.name] = backend
        return backend

    def _buckets(self, phase: Phase, requested: str, flag_name: str, spec: AttentionSpec, largest: int,
                 first: AttentionBackend, built: dict[str, Any]) -> list[Bucket]:
        """`first` (chosen for `largest`) plus, under `auto`, the backend ranked first at each smaller
        bucket bound of the measured table: one instance per backend, all on one KV pool."""
        buckets = [Bucket(largest, first)]
        loaded = load_selection_table(self.hardware)
        if requested != "auto" or loaded is None:
            return buckets
        bounds = loaded[0].bucket_bounds("attention", phase, largest)[:-1]
        buckets[:0] = [Bucket(b, self._build("attention", phase, requested, flag_name, spec, b, built=built))
                       for b in bounds]
        return buckets

    def _create_backends(self) -> tuple[ModelBackends, int]:
        args, config = self.args, self.config
        max_batch = self.max_running_requests
        decode_flag = flag("decode_attention_backend") if args.decode_attention_backend else flag("attention_backend")
        prefill_flag = (flag("prefill_attention_backend") if args.prefill_attention_backend
                        else flag("attention_backend"))

        def with_page_size(cls: type, spec: AttentionSpec) -> AttentionSpec:
            # --page-size, else the one the decode backend forces, else 1 (usability checked the flag).
            forced = cls.capabilities.forced_page_size()
            return dataclasses.replace(spec, page_size=args.page_size or forced or 1)

        # The backend of the largest decode batch fixes the page size; every other bucket must live with it.
        built: dict[str, Any] = {}
        decode = self._build("attention", Phase.DECODE, args.decode_attention, decode_flag,
                             config.attention_spec(self.dtype, args.page_size, self.kv_dtype,
                                                   self.group.world_size // self.dp_size),
                             max_batch,
                             with_page_size, built)
        spec = decode.spec
        self.decode_buckets = self._buckets(Phase.DECODE, args.decode_attention, decode_flag, spec, max_batch,
                                            decode, built)
        prefill_tokens = args.chunked_prefill_size if args.chunked_prefill_size > 0 else WARMUP_PREFILL_TOKENS
        prefill = self._build("attention", Phase.PREFILL, args.prefill_attention, prefill_flag, spec, prefill_tokens,
                              built=built)
        self.prefill_buckets = self._buckets(Phase.PREFILL, args.prefill_attention, prefill_flag, spec,
                                             prefill_tokens, prefill, built)
        moe = gemm = None
        if config.n_routed_experts:
            moe_spec = config.moe_spec(self.dtype, self.group.world_size, args.ep_size,
                                       self.group.rank if args.ep_size > 1 else 0)
            moe = self._build_packed("moe", args.moe_runner_backend, moe_spec, max_batch,
                                     prefill_tokens, self._fuse_shared_experts)
        if args.enable_shared_experts_fusion and not (moe is not None and moe.spec.num_shared_experts):
            why = (f"the moe backend {moe.name} does not fuse them (triton does: {flag('moe_runner_backend')} "
                   "triton)" if moe is not None and config.n_shared_experts else "the model has no shared experts")
            raise ValueError(f"{flag('enable_shared_experts_fusion')}: {why}")
        if config.fp8_block:
            gemm = self._build_packed("gemm", args.fp8_gemm_backend, config.gemm_spec(self.dtype), max_batch,
                                      prefill_tokens)
        backends = ModelBackends(attention_prefill=prefill, attention_decode=decode, moe=moe, gemm=gemm)
        return backends, spec.page_size

    def _fuse_shared_experts(self, cls: type, spec: MoESpec) -> MoESpec:
        """The MoE spec a candidate backend is built with: the shared experts fused into its GEMMs under
        --enable-shared-experts-fusion when it can."""
        shared = self.config.n_shared_experts
        if not shared or not self.args.enable_shared_experts_fusion or not cls.capabilities.shared_experts_fusion:
            return spec
        return dataclasses.replace(spec, num_shared_experts=shared)

    @property
    def shared_experts_mode(self) -> str:
        """How the MoE layers run their shared experts (for /server_info)."""
        moe = self.model.backends.moe if self.model.backends is not None else None
        if not self.config.n_shared_experts or moe is None:
            return "none"
        if moe.spec.num_shared_experts:
            return f"fused into the {moe.name} MoE backend's GEMMs"
        overlap = self.device.type == "cuda" and not self.args.disable_shared_experts_overlap
        stream = "on a second CUDA stream" if overlap else "on the main stream"
        return f"own MLP {stream}"

    def _build_packed(self, kind: str, requested: str, spec: Any, max_batch: int, prefill_tokens: int,
                      fit_spec: Callable[[type, Any], Any] | None = None) -> Any:
        """A MoE or GEMM backend: one for the model, since its packed weights exist once. The decode pick
        (most of serving's time) runs prefill too; when the table ranks another first for prefill, the
        choice says so."""
        name = flag("moe_runner_backend" if kind == "moe" else "fp8_gemm_backend")
        backend = self._build(kind, Phase.DECODE, requested, name, spec, max_batch, fit_spec)
        if requested == "auto":
            preferred = get_registry().select(kind, Phase.PREFILL, prefill_tokens, self.hardware, spec=spec)  # type: ignore[arg-type]
            if preferred.backend.name != backend.name:
                reason = (f"weights are packed once per model: the decode pick runs prefill too, though "
                          f"{preferred.backend.name} ranks first there ({preferred.reason})")
                logger.info("%s prefill backend: %s (%s)", kind, backend.name, reason)
                self.chosen.append(ChosenBackend(kind, Phase.PREFILL.value, backend.name, reason, prefill_tokens))
        return backend

    def attention_for(self, batch: ForwardBatch) -> AttentionBackend:
        """The attention backend of this batch's phase and size bucket: prefill by new tokens, every
        other mode by requests."""
        if batch.mode is ForwardMode.EXTEND:
            return _in_bucket(self.prefill_buckets, batch.num_tokens)
        return _in_bucket(self.decode_buckets, batch.batch_size)

    def _check_gpu_flags(self) -> int:
        """The largest CUDA-graph batch (0: no graphs); GPU-only flags on the CPU are errors."""
        args = self.args
        if self.device.type != "cuda":
            if args.cuda_graph_max_bs is not None:
                raise ValueError(f"{flag('cuda_graph_max_bs')} needs a CUDA device: there are no CUDA graphs on "
                                 f"{self.device.type}")
            return 0
        # DP attention's gathers are not captured yet.
        if args.disable_cuda_graph or self.dp_size > 1:
            return 0
        return min(args.cuda_graph_max_bs or self.max_running_requests, self.max_running_requests)

    # -- memory --------------------------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        width = self.config.kv_lora_rank + self.config.qk_rope_head_dim
        return self.model.num_kv_layers * width * torch.empty(0, dtype=self.kv_dtype).element_size()

    @property
    def pool_bytes(self) -> int:
        return self.pool.num_slots * self.bytes_per_token

    def _kv_tokens(self, reserved_bytes: int) -> int:
        """--max-total-tokens, else what --mem-fraction-static leaves on the GPU once `reserved_bytes`
        (the CUDA graphs' activations) are set aside, else CPU_KV_BYTES."""
        if self.args.max_total_tokens is not None:
            tokens = self.args.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            fraction = self.args.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
            budget = free - total * (1 - fraction) - reserved_bytes  # weights are loaded already
            tokens = int(budget // self.bytes_per_token) - self.page_size  # less the padding page
        else:
            tokens = CPU_KV_BYTES // self.bytes_per_token
        # Every rank's pool has the scheduler's page ids (under DP attention, its group's scheduler's): the smallest
        # rank's size, on all of them.
        tokens = int(self.group.all_reduce(torch.tensor([tokens], device=self.device), dist.ReduceOp.MIN).item())
        tokens = tokens // self.page_size * self.page_size
        if tokens < self.page_size * 2:
            raise ValueError(f"the KV pool would hold only {tokens} tokens: raise {flag('max_total_tokens')} or "
                             f"{flag('mem_fraction_static')}")
        return tokens

    @torch.inference_mode()
    def _graph_bytes(self, batch_size: int) -> int:
        """What the CUDA graphs' shared memory pool will hold: the peak of one eager forward of the target at
        `batch_size` requests (DECODE, or TARGET_VERIFY with speculative decoding, the widest forward: the
        graphs are captured largest first and later ones reuse its blocks), run on a one-page scratch pool,
        plus the outputs every graph keeps (its logits and hidden states, at every captured size)."""
        n = self.args.speculative.num_draft_tokens if self.args.speculative is not None else 1
        mode = ForwardMode.DECODE if n == 1 else ForwardMode.TARGET_VERIFY
        scratch = MLAKVPool(self.model.num_kv_layers, 1, self.page_size, self.config.kv_lora_rank,
                            self.config.qk_rope_head_dim, self.kv_dtype, self.device)
        # Every page of every row is the scratch page: n tokens fit any page size.
        inputs = GraphInputs(batch_size, n, pages_needed(n, self.page_size), scratch, padding_page=0)
        batch = inputs.batch(mode, batch_size)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._logits(inputs.input_ids, batch, self.attention_for(batch), plan=True)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        rows = sum(capture_sizes(batch_size))
        logits_row = self.config.vocab_size * 4  # float32
        hidden_row = self.config.hidden_size * torch.empty(0, dtype=self.dtype).element_size()
        per_size = sum(p.tokens_per_request * (logits_row * p.logits + hidden_row * p.hidden)
                       for p in self._graph_plans())
        kept = rows * per_size
        logger.info("%s activations at batch %d: %.1f MiB, graph outputs %.1f MiB (reserved for CUDA graphs)",
                    mode.name, batch_size, peak / 2**20, kept / 2**20)
        return peak + kept

    # -- warm-up -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def warm_up(self, on_late_compile: Callable[[], None] | None = None) -> None:
        """Before serving: every prefill bucket's backend on a prompt of its size and of each power of two below
        it down to WARMUP_MIN_PREFILL_TOKENS (and an extension of each over the cached prefix), every decode
        bucket's eagerly (with speculative decoding, the NextN layer after each prefill and a round's forwards
        at each decode batch size), then the CUDA graphs. JIT compiles, autotuning and FlashInfer plans happen
        here, not in a request. After it, each Triton kernel compiled is logged and `on_late_compile` called
        (`report_late_triton_compiles`)."""
        cap = WARMUP_PREFILL_TOKENS if self.device.type == "cuda" else CPU_WARMUP_TOKENS
        largest = min(self.prefill_buckets[-1].max_size, cap,
                      self.allocator.num_pages * self.page_size - WARMUP_EXTEND_TOKENS)
        ladder = itertools.takewhile(lambda n: n < largest,
                                     (WARMUP_MIN_PREFILL_TOKENS << i for i in itertools.count()))
        sizes = sorted({*ladder, *(min(b.max_size, largest) for b in self.prefill_buckets)})
        steps = [*(functools.partial(self._warm_up_prefill, n) for n in sizes),
                 *(functools.partial(self._warm_up_decode, min(b.max_size, self.allocator.num_pages))
                   for b in self.decode_buckets)]
        if self.args.speculative is not None:
            n = self.args.speculative.num_draft_tokens
            per_request = pages_needed(2 * n, self.page_size)
            steps += [functools.partial(self._warm_up_speculative, min(b.max_size, self.allocator.num_pages
                                                                       // per_request), n)
                      for b in self.decode_buckets]
        for step in tqdm(steps, desc="warm-up", disable=None):
            step()
        if self.graph_max_bs:
            self.capture_graphs()
        if self.device.type == "cuda":
            report_late_triton_compiles(on_late_compile)

    def _scratch_forward(self, mode: ForwardMode, seq_lens: list[int], extend_lens: list[int],
                         pages: list[list[int]], nextn: bool = False) -> None:
        """One forward over scratch pages (`pages[i]`: request i's, at least ceil(seq_len / page_size)) with
        token id 0 everywhere, through the batch's own backend: the model's, or with `nextn` its NextN layer's
        (on zero hidden states)."""
        width = max(len(p) for p in pages)
        table = torch.tensor([p + [p[-1]] * (width - len(p)) for p in pages], dtype=torch.int32)
        batch = self.prepare(ForwardBatch.build(mode, seq_lens, extend_lens, table.to(self.device), self.pool))
        if self.dp_size > 1:  # every rank runs the same batch
            batch.dp_tokens = [batch.num_tokens] * self.dp_size
        ids = torch.zeros(batch.num_tokens, dtype=torch.int64, device=self.device)
        if not nextn:
            self._logits(ids, batch, self.attention_for(batch), plan=True)
            return
        attention = self.attention_for(batch)
        attention.plan(batch)
        hidden = torch.zeros(batch.num_tokens, self.config.hidden_size, dtype=self.dtype, device=self.device)
        self.model.compute_logits(self.model.forward_nextn(ids, hidden, batch, attention))

    def _warm_up_prefill(self, num_tokens: int) -> None:
        total = num_tokens + WARMUP_EXTEND_TOKENS
        pages = self.allocator.alloc(pages_needed(total, self.page_size))
        try:
            for seq_len, new in ((num_tokens, num_tokens), (total, WARMUP_EXTEND_TOKENS)):
                self._scratch_forward(ForwardMode.EXTEND, [seq_len], [new], [pages])
                if self.args.speculative is not None:  # the NextN layer follows every prefill
                    self._scratch_forward(ForwardMode.EXTEND, [seq_len], [new], [pages], nextn=True)
        finally:
            self.allocator.free(pages)

    def _warm_up_decode(self, batch_size: int) -> None:
        pages = self.allocator.alloc(batch_size)
        try:
            self._scratch_forward(ForwardMode.DECODE, [1] * batch_size, [1] * batch_size, [[p] for p in pages])
        finally:
            self.allocator.free(pages)

    def _warm_up_speculative(self, batch_size: int, n: int) -> None:
        """A speculative round's forwards for `batch_size` requests of n draft tokens: the target's TARGET_VERIFY,
        the NextN layer's draft steps (DECODE) and its DRAFT_EXTEND (padded to n tokens per request)."""
        per_request = pages_needed(2 * n, self.page_size)
        pages = self.allocator.alloc(per_request * batch_size)
        try:
            rows = [pages[i * per_request : (i + 1) * per_request] for i in range(batch_size)]
            self._scratch_forward(ForwardMode.TARGET_VERIFY, [2 * n] * batch_size, [n] * batch_size, rows)
            for mode, new in ((ForwardMode.DECODE, 1), (ForwardMode.DRAFT_EXTEND, n)):
                self._scratch_forward(mode, [n + new] * batch_size, [new] * batch_size, rows, nextn=True)
        finally:
            self.allocator.free(pages)

    def _graph_plans(self) -> list[GraphPlan]:
        """The forwards the server runs with a fixed number of new tokens per request: the target's DECODE, or with
        speculative decoding its TARGET_VERIFY (logits to verify, hidden states for the draft extend), the
        NextN layer's draft DECODE steps (logits to draft from, hidden states for the next step) and its
        DRAFT_EXTEND padded to num_draft_tokens (hidden states: h', and the greedy tokens: the next round's first
        greedy draft), and for chains the greedy round, all of them in one graph. Draft trees verify and draft in
        tree form, eagerly (`graph_status` says so), and share DRAFT_EXTEND with chains."""
        spec = self.args.speculative
        if spec is None:
            return [GraphPlan(ForwardMode.DECODE, 1, nextn=False, logits=True, hidden=False)]
        n = spec.num_draft_tokens
        extend = GraphPlan(ForwardMode.DRAFT_EXTEND, n, nextn=True, logits=False, hidden=True, greedy=True)
        if spec.topk > 1:
            return [extend]
        return [GraphPlan(ForwardMode.TARGET_VERIFY, n, nextn=False, logits=True, hidden=True),
                GraphPlan(ForwardMode.DECODE, 1, nextn=True, logits=True, hidden=True), extend,
                GraphPlan(ForwardMode.TARGET_VERIFY, n, nextn=False, logits=True, hidden=True, round=True)]

    def _graph_forward(self, plan: GraphPlan) -> GraphForward:
        """What the graph of `plan` captures (see GraphPlan for its outputs)."""
        model, sample_vocab = self.model, self.sample_vocab
        if plan.round:
            assert self.args.speculative is not None
            return greedy_round_forward(model, self.args.speculative.num_steps, sample_vocab, plan_in_graph)

        def forward(input_ids: torch.Tensor, hidden: torch.Tensor | None, batch: ForwardBatch,
                    attention: AttentionBackend) -> tuple[torch.Tensor, ...]:
            out = (model.forward_nextn(input_ids, hidden, batch, attention) if plan.nextn  # type: ignore[arg-type]
                   else model(input_ids, batch, attention))
            logits = model.compute_logits(out) if plan.logits or plan.greedy else None
            return (*((logits,) if plan.logits else ()),
                    *((logits[:, :sample_vocab].argmax(dim=-1),) if plan.greedy else ()),  # type: ignore[index]
                    *((out,) if plan.hidden else ()))

        return forward

    def capture_graphs(self) -> None:
        """Capture every forward of `_graph_plans` at every size up to the largest graph batch, when every decode
        bucket's attention backend declares its mode in graph_modes and the MoE and GEMM backends declare
        cuda_graph. A forward that cannot be captured, or all of them when a capture fails, runs eagerly, and
        `graph_status` says which and why."""
        sizes = capture_sizes(self.graph_max_bs)
        plans, eager = [], []
        for plan in self._graph_plans():
            reason = self._round_blocker() if plan.round else self._graph_blocker(plan.mode)
            if reason:
                eager.append(f"{plan.label} {'is not one graph' if plan.round else 'runs eagerly'}: {reason}")
                logger.warning("CUDA graphs off for %s: %s", plan.label, reason)
            else:
                plans.append(plan)
        if self.args.speculative is not None and self.args.speculative.topk > 1:
            eager.append("draft trees verify and draft eagerly: no attention backend runs tree attention under "
                         "CUDA graphs")
        max_pages = min(self.block_table.max_pages, self.allocator.num_pages)
        runners = [CudaGraphRunner(p.mode, sizes, p.tokens_per_request, max_pages, self.pool, self.padding_page,
                                   functools.partial(_in_bucket, self.decode_buckets),
                                   (self.config.hidden_size, self.dtype) if p.nextn or p.round else None)
                   for p in plans]
        captured = ""
        if runners:
            bar = tqdm(total=len(sizes) * len(runners), desc="capturing CUDA graphs", disable=None)
            try:
                init_graph_attention(runners)
                pool_handle = torch.cuda.graph_pool_handle()  # one memory pool for every mode's graphs
                for plan, runner in zip(plans, runners, strict=True):
                    runner.capture(self._graph_forward(plan), pool_handle, progress=lambda _: bar.update())
                    if plan.round:
                        self.round_graph = runner
                    else:
                        (self.nextn_graphs if plan.nextn else self.target_graphs)[plan.mode] = runner
            except Exception as exc:
                self.target_graphs, self.nextn_graphs, self.round_graph = {}, {}, None
                eager = [f"{', '.join(p.label for p in plans)} run eagerly: capture failed: "
                         f"{type(exc).__name__}: {exc}", *eager]
                logger.exception("CUDA graph capture failed; the forwards run eagerly")
            else:
                captured = (f"{', '.join(p.label for p in plans)} captured at batch sizes {sizes} (larger "
                            "batches run eagerly)")
            finally:
                bar.close()
        self.graph_status = "; ".join(filter(None, [captured, *eager]))
        logger.info("CUDA graphs: %s", self.graph_status)

    def _round_blocker(self) -> str:
        """Why the greedy round cannot be one graph, or ''."""
        for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND):
            if reason := self._graph_blocker(mode):
                return reason
        for bucket in self.decode_buckets:
            if not bucket.backend.capabilities.graph_plan_on_device:
                return f"attention backend {bucket.backend.name} plans on the host before each replay"
        return ""

    def _graph_blocker(self, mode: ForwardMode) -> str:
        """Why `mode` cannot be captured, or ''."""
        for bucket in self.decode_buckets:
            caps = bucket.backend.capabilities
            if mode not in caps.graph_modes:
                return f"attention backend {bucket.backend.name} does not run {mode.name} under CUDA graphs"
        backends = self.model.backends
        for kind_backend in (backends.moe, backends.gemm) if backends else ():
            if kind_backend is not None and not kind_backend.capabilities.cuda_graph:
                return f"{kind_backend.kind} backend {kind_backend.name} cannot be captured in a CUDA graph"
        return ""

    # -- running -------------------------------------------------------------------------------------

    def prepare(self, batch: ForwardBatch) -> ForwardBatch:
        prefill = self.attention_for(batch) if batch.mode is ForwardMode.EXTEND else self.prefill_buckets[-1].backend
        return prepare_attention(
            batch,
            chunked_prefix_cache_threshold=self.args.chunked_prefix_cache_threshold,
            prefill_supports_mla=AttnForwardMethod.MLA in prefill.capabilities.methods,
        )

    def _logits(self, input_ids: torch.Tensor, batch: ForwardBatch, attention: AttentionBackend, plan: bool
                ) -> torch.Tensor:
        """input_ids [T] -> logits [T, vocab] float32 of every row (what a CUDA graph captures; under DP attention
        every rank's rows)."""
        if plan:
            attention.plan(batch)
        return self.model.compute_logits(self.model(input_ids, batch, attention), batch.dp_tokens)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, sample_rows: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> logits [len(sample_rows), sample_vocab] float32 at the token rows to sample.
        On rank 0 of several: the other ranks (in `follow`) run it too. Without DP attention."""
        return self.forward_groups([Part(input_ids, batch, sample_rows)])[0]

    @torch.inference_mode()
    def forward_groups(self, parts: list[Part | None]) -> list[torch.Tensor]:
        """Rank 0: one forward of each DP group's part (None: the group idles; one part without DP attention),
        each run by its group's ranks -> each group's logits [len(sample_rows), sample_vocab] float32 (no rows
        for an idle group)."""
        headers = [None if p is None else _Header(p.batch.mode, p.batch.seq_lens_cpu, p.batch.extend_lens_cpu,
                                                  p.batch.block_table.shape[1], p.sample_rows.numel())
                   for p in parts]
        if self.group.world_size > 1:
            self._send(headers, parts)
        mine, sampled = self._own_part(parts[self.dp_rank], headers)
        logits = self._forward(*mine, dp_sampled=sampled)
        return list(logits.split(sampled)) if sampled is not None else [logits]

    def _own_part(self, part: Part | None, headers: list[_Header | None]) -> tuple[Part, list[int] | None]:
        """This rank's part (an IDLE one for None) with every group's token counts set on its batch, and every
        group's sampled rows (None without DP attention)."""
        if part is None:
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            table = torch.zeros(0, 1, dtype=torch.int32, device=self.device)
            part = Part(empty, ForwardBatch.build(ForwardMode.IDLE, [], [], table, self.pool), empty)
        if self.dp_size == 1:
            return part, None
        part.batch.dp_tokens = [0 if h is None else h.sizes[0] for h in headers]
        return part, [0 if h is None else h.num_sampled for h in headers]

    def _forward(self, input_ids: torch.Tensor, batch: ForwardBatch, sample_rows: torch.Tensor,
                 dp_sampled: list[int] | None = None) -> torch.Tensor:
        """This rank's forward -> logits [len(sample_rows), sample_vocab] float32, or under DP attention every
        group's sampled rows, [sum(dp_sampled), sample_vocab] in group order."""
        graph = self.target_graphs.get(batch.mode)
        if graph is not None and graph.can_run(batch):
            return graph.replay(input_ids, batch)[0][sample_rows, : self.sample_vocab]
        attention = None
        if batch.mode is not ForwardMode.IDLE:
            attention = self.attention_for(batch)
            attention.plan(batch)
        hidden = self.model(input_ids, batch, attention)
        return self.model.compute_logits(hidden[sample_rows], dp_sampled)[:, : self.sample_vocab]

    # -- tensor-parallel ranks -----------------------------------------------------------------------

    def _send(self, headers: list[_Header | None], parts: list[Part | None]) -> None:
        """Rank 0: every group's batch to the other ranks. The lengths as an object, then one device tensor of
        each group's [input_ids | sample_rows | block table] (the ids may still be being sampled: stream-ordered)."""
        self.group.broadcast_object(headers)
        self.group.broadcast(torch.cat([t for p in parts if p is not None for t in
                                        (p.input_ids, p.sample_rows, p.batch.block_table.flatten().to(torch.int64))]))

    def _receive(self) -> tuple[Part, list[int] | None] | None:
        """Ranks 1..P-1: this rank's group's part of the next forward rank 0 sends (the batch prepared as rank 0
        prepared it) and every group's sampled rows (None without DP attention), or None when rank 0 releases
        them."""
        headers: list[_Header | None] | None = self.group.broadcast_object(None)
        if headers is None:
            return None
        sizes = [[0, 0, 0] if h is None else h.sizes for h in headers]
        payload = self.group.broadcast(torch.empty(sum(map(sum, sizes)), dtype=torch.int64, device=self.device))
        header, start = headers[self.dp_rank], sum(map(sum, sizes[: self.dp_rank]))
        if header is None:
            return self._own_part(None, headers)
        input_ids, sample_rows, table = payload[start : start + sum(sizes[self.dp_rank])].split(header.sizes)
        table = table.view(len(header.seq_lens), header.width).to(torch.int32)
        batch = ForwardBatch.build(header.mode, header.seq_lens, header.extend_lens, table, self.pool)
        return self._own_part(Part(input_ids, self.prepare(batch), sample_rows), headers)

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks 1..P-1, after `warm_up`: run each forward rank 0 runs (their group's part of it), until
        `release_followers`."""
        while (received := self._receive()) is not None:
            part, sampled = received
            self._forward(*part, dp_sampled=sampled)

    def release_followers(self) -> None:
        """Rank 0, once its forwards are over: end the other ranks' `follow`."""
        self.group.broadcast_object(None)


def plan_in_graph(attention: AttentionBackend, batch: ForwardBatch) -> None:
    """How a graph of several forwards plans each one's attention: recorded in the capture (`graph_plan_on_device`)."""
    attention.plan_capture(batch)


def _in_bucket(buckets: list[Bucket], size: int) -> AttentionBackend:
    """The backend of the first bucket holding `size` (a size beyond the last bucket uses it)."""
    return next((b.backend for b in buckets if size <= b.max_size), buckets[-1].backend)
