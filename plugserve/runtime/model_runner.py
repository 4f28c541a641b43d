"""ModelRunner: one rank's model, its backends (`runtime/backends.py`), its KV pool and CUDA graphs; warms up
and runs one forward (plus picking the rows to sample) for the scheduler.

Under tensor parallelism every rank has a ModelRunner holding its part of the model and a whole KV pool of the
same size. Rank 0's (the scheduler's) `forward_groups` first sends the batch to the others
(`runtime/rank_protocol.py`), whose `follow` runs the same forward; `warm_up` runs on every rank alike. Under DP
attention (--dp-size D groups of A = --tp-size / D ranks, group g the ranks [g A, (g + 1) A)) each rank runs its
own DP group's part (its pool holds that group's KV, as the pools of the group's other ranks do), an IDLE one when
its group has none."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from plugserve.core.batch_invariant import batch_invariant
from plugserve.core.block_table import DeviceBlockTable
from plugserve.core.dispatch import prepare_attention
from plugserve.core.distributed import SINGLE, DPGroups, ParallelGroup, dp_groups, real_rows
from plugserve.core.forward_batch import AttnForwardMethod, ForwardBatch, ForwardMode
from plugserve.core.graph_inputs import GraphInputs, capture_sizes
from plugserve.core.hardware import Hardware
from plugserve.core.host_copy import to_device
from plugserve.core.interfaces import AttentionBackend
from plugserve.core.kv_cache import MLAKVPool, PageAllocator, pages_needed
from plugserve.core.layers.small_ops import EAGER, SmallOps
from plugserve.core.loader import load_model, read_config, resolve_dtype
from plugserve.core.moved import moved_names
from plugserve.core.specs import KV_DTYPES
from plugserve.runtime import rank_protocol
from plugserve.runtime.backends import RunnerBackends
from plugserve.runtime.comm import build_comm
from plugserve.runtime.cuda_graph_runner import (
    CudaGraphs,
    GraphPlans,
    decode_graph_plans,
    dp_graph_size,
    output_bytes,
)
from plugserve.runtime.server_args import ServerArgs, flag

logger = logging.getLogger(__name__)

# Without --max-total-tokens on the CPU: this much memory for the KV pool.
CPU_KV_BYTES = 512 << 20
DEFAULT_MEM_FRACTION_STATIC = 0.85
# Without --max-running-requests: SGLang's defaults (the CPU runs far fewer at once).
DEFAULT_MAX_RUNNING = {"cuda": 256, "cpu": 64}


def rank_device(args: ServerArgs, rank: int) -> torch.device:
    """The device of tensor-parallel rank `rank`: --device (auto: CUDA when there is one), on a GPU the
    node's GPU number rank mod ranks-per-node."""
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{flag('device')} {args.device}: torch sees no CUDA device here (give cpu or auto)")
    if name == "cuda" and args.tp_size > 1:
        return torch.device("cuda", rank % args.ranks_per_node)
    return torch.device(name)


def context_length(args: ServerArgs, model_max: int) -> int:
    """--context-length, else the model's `model_max` (max_position_embeddings); more than the model's is refused,
    as SGLang does: its rope and attention were trained up to that length."""
    if args.context_length is None:
        return model_max
    if args.context_length > model_max:
        raise ValueError(f"{flag('context_length')} {args.context_length} is above the model's maximum, "
                         f"max_position_embeddings {model_max}: give at most {model_max}")
    return args.context_length


def graph_max_bs(args: ServerArgs, device: torch.device, max_running: int) -> int:
    """The largest CUDA-graph batch (0: no graphs). The graph flags on another device are refused, as it has no
    graphs to capture or turn off; --cuda-graph-max-bs above the `max_running` requests is capped to it, with a
    warning naming the size used."""
    if device.type != "cuda":
        given = [name for name in ("cuda_graph_max_bs", "disable_cuda_graph") if getattr(args, name)]
        if given:
            raise ValueError(f"{flag(given[0])} needs a CUDA device: there are no CUDA graphs on {device.type}")
        return 0
    if args.disable_cuda_graph:
        return 0
    if args.cuda_graph_max_bs is not None and args.cuda_graph_max_bs > max_running:
        logger.warning("%s %d is above %s (%d): graphs are captured up to %d", flag("cuda_graph_max_bs"),
                       args.cuda_graph_max_bs, flag("max_running_requests"), max_running, max_running)
    return min(args.cuda_graph_max_bs or max_running, max_running)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of `device`: a GPU's, or on the CPU the machine's (available, total)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    import psutil  # only here: a GPU launch never needs it

    memory = psutil.virtual_memory()
    return memory.available, memory.total


class ModelRunner:
    def __init__(self, args: ServerArgs, group: ParallelGroup = SINGLE, graph_plans: GraphPlans | None = None,
                 self_check: bool = True, before_sizing: Callable[[], None] | None = None) -> None:
        """`group`: the tensor-parallel ranks, this process's rank among them (SINGLE: one process).
        `graph_plans`: the forwards to capture in CUDA graphs (default: the target's DECODE). `self_check`: False
        only in `precompile`'s replicas, whose backends are the server's, checked there. `before_sizing`: called
        once the weights are loaded, before the device's memory is measured (the engine waits there for
        `precompile`'s processes, which hold some of it)."""
        if group.world_size != args.tp_size:
            raise ValueError(f"{flag('tp_size')} {args.tp_size} needs one ModelRunner per rank, in a world of that "
                             f"size (the Engine starts them), not one in a world of {group.world_size}")
        self.args = args
        # DP attention: rank r runs group r // A's attention (A = --tp-size / --dp-size ranks a group, splitting its
        # heads); else one group of every rank.
        self.dp_size = args.dp_attention_size
        self.dp_rank = group.rank // (group.world_size // self.dp_size)
        self.device = rank_device(args, group.rank)
        self.hardware = Hardware.detect(self.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.group = group = self._with_comm(group)
        self.dp: DPGroups | None = dp_groups(group, self.dp_size) if self.dp_size > 1 else None  # collective
        self.kv_dtype = self.dtype if args.kv_cache_dtype == "auto" else KV_DTYPES[args.kv_cache_dtype]
        self.config, checkpoint_layers = read_config(args.model_dir, args.model_preset, args.quantization,
                                                     args.num_layers)
        self.context_length = context_length(args, self.config.max_position_embeddings)
        self.max_running_requests = args.max_running_requests or DEFAULT_MAX_RUNNING[self.device.type]
        self.graph_max_bs = graph_max_bs(args, self.device, self.max_running_requests)
        if args.disable_shared_experts_overlap:
            if not (self.config.n_routed_experts and self.config.n_shared_experts):
                raise ValueError(f"{flag('disable_shared_experts_overlap')}: the model has no shared experts")
            if self.device.type != "cuda":
                raise ValueError(f"{flag('disable_shared_experts_overlap')} needs a CUDA device: the CPU has no "
                                 "streams")
        self.backends = RunnerBackends(args, self.config, self.hardware, self.device, self.dtype, self.kv_dtype, group,
                                       self.dp_size, self.max_running_requests, self_check)
        self.page_size = self.backends.page_size
        self.model = load_model(self.config, self.backends.model, model_path=args.model_dir,
                                checkpoint_layers=checkpoint_layers, load_format=args.load_format, dtype=self.dtype,
                                device=self.device, seed=args.seed, group=group, expert_parallel=args.ep_size > 1,
                                dp=self.dp, draft_model_path=args.speculative_draft_model_path,
                                dummy_nextn=args.speculative is not None)
        for kind, rows in self.backends.by_rows.items():
            logger.info("%s backends by rows: %s", kind, rows)
        small_ops = SmallOps.compiled(args.compile_max_bs) if args.enable_torch_compile else EAGER
        self.model.use_small_ops(small_ops.with_fused_kernels(self.device))
        if self.device.type == "cuda":
            self.model.overlap_shared_experts(not args.disable_shared_experts_overlap)
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
        self.graph_plans = graph_plans or decode_graph_plans()
        if before_sizing is not None:
            before_sizing()
        graph_bytes = self._graph_bytes(self.graph_max_bs) if self.graph_max_bs and self.graph_plans.plans else 0
        self.max_total_tokens = self._kv_tokens(graph_bytes)
        num_pages = self.max_total_tokens // self.page_size
        # One page more than the allocator hands out: padding rows of CUDA graphs read and write only it.
        self.padding_page = num_pages
        self.pool = MLAKVPool(self.model.num_kv_layers, num_pages + 1, self.page_size, self.config.kv_lora_rank,
                              self.config.qk_rope_head_dim, self.kv_dtype, self.device)
        self.allocator = PageAllocator(num_pages)
        logger.info("KV pool: %d pages of %d tokens (%d tokens, %.2f GiB)", num_pages, self.page_size,
                    num_pages * self.page_size, self.pool_bytes / 2**30)
        self.graphs = CudaGraphs("disabled by --disable-cuda-graph" if args.disable_cuda_graph else
                                 "no CUDA graphs on the CPU" if self.device.type != "cuda" else "not captured yet")

    def _with_comm(self, group: ParallelGroup) -> ParallelGroup:
        """`group`, its sums through the comm backends every rank agreed on (`runtime/comm.py`)."""
        if self.device.type != "cuda" and self.args.disable_custom_all_reduce:
            raise ValueError(f"{flag('disable_custom_all_reduce')} needs CUDA devices: the CPU's ranks use gloo "
                             "for every all-reduce")
        comm, self.all_reduce_status = build_comm(self.args, group, self.device, self.dtype)
        if group.world_size > 1:
            logger.info("all-reduce: %s", self.all_reduce_status)
        return group.with_comm(comm)

    # -- memory --------------------------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over every layer: an fp8 cache holds twice a 16-bit one's tokens in its memory."""
        width = self.config.kv_lora_rank + self.config.qk_rope_head_dim
        return self.model.num_kv_layers * width * torch.empty(0, dtype=self.kv_dtype).element_size()

    @property
    def pool_bytes(self) -> int:
        return self.pool.num_slots * self.bytes_per_token

    def _kv_tokens(self, reserved_bytes: int) -> int:
        """--max-total-tokens, else what --mem-fraction-static leaves of the device's memory (on the CPU: the
        machine's) once `reserved_bytes` (the CUDA graphs' activations) are set aside, else (on the CPU without
        it) CPU_KV_BYTES."""
        args = self.args
        if args.max_total_tokens is not None:
            tokens = args.max_total_tokens
            if args.mem_fraction_static is not None:
                logger.warning("%s %g is not used: %s %d sizes the KV pool", flag("mem_fraction_static"),
                               args.mem_fraction_static, flag("max_total_tokens"), tokens)
        elif self.device.type == "cuda" or args.mem_fraction_static is not None:
            free, total = device_memory(self.device)
            fraction = args.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
            budget = free - total * (1 - fraction) - reserved_bytes  # weights are loaded already
            if self.device.type != "cuda":  # the node's ranks share the machine's memory
                budget /= args.ranks_per_node
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
        if self.dp_size > 1:  # the MLP over every group's rows, as captured
            batch.dp_tokens = [batch.num_tokens] * self.dp_size
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.logits(inputs.input_ids, batch, self.backends.attention(batch), plan=True)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        kept = sum(capture_sizes(batch_size)) * output_bytes(self.graph_plans.plans, self.config.vocab_size,
                                                             self.config.hidden_size, self.dtype, self.dp_size)
        logger.info("%s activations at batch %d: %.1f MiB, graph outputs %.1f MiB (reserved for CUDA graphs)",
                    mode.name, batch_size, peak / 2**20, kept / 2**20)
        return peak + kept

    # -- graphs --------------------------------------------------------------------------------------

    def capture_graphs(self, part: tuple[int, int] | None = None) -> None:
        """Capture `graph_plans` at every size up to the largest graph batch (`CudaGraphs.capture`); `part` (k, n):
        at every n-th size from the k-th only."""
        sizes = capture_sizes(self.graph_max_bs)
        with batch_invariant(self.args.enable_deterministic_inference):
            self.graphs.capture(self.graph_plans, sizes if part is None else sizes[part[0]::part[1]], self.backends,
                                self.model, self.sample_vocab, (self.config.hidden_size, self.dtype), self.pool,
                                self.padding_page, min(self.block_table.max_pages, self.allocator.num_pages),
                                self.dp_size)

    # -- running -------------------------------------------------------------------------------------

    def prepare(self, batch: ForwardBatch) -> ForwardBatch:
        """Fill the batch's attention method (and prefix chunks) for the prefill backend that runs it."""
        extend = batch.mode is ForwardMode.EXTEND
        prefill = self.backends.attention(batch) if extend else self.backends.prefill_buckets[-1].backend
        return prepare_attention(
            batch,
            chunked_prefix_cache_threshold=self.args.chunked_prefix_cache_threshold,
            prefill_supports_mla=AttnForwardMethod.MLA in prefill.capabilities.methods,
            deterministic=self.args.enable_deterministic_inference,
        )

    def logits(self, input_ids: torch.Tensor, batch: ForwardBatch, attention: AttentionBackend, plan: bool
                ) -> torch.Tensor:
        """input_ids [T] -> logits [T, vocab] float32 of every row (what a CUDA graph captures; under DP attention
        every rank's rows)."""
        if plan:
            attention.plan(batch)
        with batch_invariant(self.args.enable_deterministic_inference):
            return self.model.compute_logits(self.model(input_ids, batch, attention), batch.dp_tokens)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, sample_rows: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> logits [len(sample_rows), sample_vocab] float32 at the token rows to sample.
        On rank 0 of several: the other ranks (in `follow`) run it too; under DP attention the batch is DP group
        0's and the other groups idle."""
        parts = [rank_protocol.Part(input_ids, batch, sample_rows), *[None] * (self.dp_size - 1)]
        return self.forward_groups(parts)[0]

    @torch.inference_mode()
    def forward_groups(self, parts: list[rank_protocol.Part | None]) -> list[torch.Tensor]:
        """Rank 0: one forward of each DP group's part (None: the group idles; one part without DP attention),
        each run by its group's ranks -> each group's logits [len(sample_rows), sample_vocab] float32 (no rows
        for an idle group)."""
        headers = [rank_protocol.Header.of(p) for p in parts]
        if self.group.world_size > 1:
            rank_protocol.send(self.group, headers, parts)
        return self._forward_own(parts[self.dp_rank], headers)

    def announce(self, headers: list[rank_protocol.Header | None], parts: list[rank_protocol.Part | None]) -> None:
        """Rank 0 of several, before a speculative step: every DP group's batch and inputs (None: the group idles
        through the step; one group without DP attention) to the other ranks, whose `follow` hands them to their
        speculative worker."""
        if self.group.world_size > 1:
            rank_protocol.send(self.group, headers, parts)

    @torch.inference_mode()
    def follow(self, speculative: Callable[[rank_protocol.Part | None, list[rank_protocol.Header | None]], None]
               | None = None) -> None:
        """Ranks 1..P-1, after `warm_up`: run each forward rank 0 runs (their group's part of it), and each
        speculative step with `speculative` (every group's header has its kind; this rank's part is None when its
        group idles through it), until rank 0 releases them (`release_followers`)."""
        while (received := rank_protocol.receive(self.group, self.dp_rank, self.pool, self.prepare)) is not None:
            part, headers = received
            step = next((h.step for h in headers if h is not None), rank_protocol.Step.FORWARD)
            if step is not rank_protocol.Step.FORWARD:
                assert speculative is not None, "speculative steps come with speculation on"
                speculative(part, headers)
            else:
                self._forward_own(part, headers)

    def release_followers(self) -> None:
        """Rank 0, once its forwards are over: end the other ranks' `follow`."""
        rank_protocol.release(self.group)

    def _forward_own(self, part: rank_protocol.Part | None, headers: list[rank_protocol.Header | None]
                     ) -> list[torch.Tensor]:
        """This rank's part of a forward (an IDLE one for None) -> each group's logits (one group's without DP
        attention, where every rank samples the same rows)."""
        if part is None:
            part = rank_protocol.idle_part(self.pool)
        if self.dp_size == 1:
            return [self._forward(part.input_ids, part.batch, part.sample_rows)]
        sampled = [0 if h is None else h.num_sampled for h in headers]
        graph = self.graphs.runners.get(ForwardMode.DECODE.name)
        tokens = [0 if h is None else h.sizes[0] for h in headers]
        if graph is not None and (size := dp_graph_size(graph, headers)) is not None:  # alike on every rank
            logits = graph.replay_dp(part.input_ids, part.batch, size, tokens)[0]
            return [logits[g * size : g * size + n, : self.sample_vocab] for g, n in enumerate(sampled)]
        part.batch.dp_tokens = tokens
        if min(tokens) < max(tokens):  # the gathers pad the groups with fewer tokens
            part.batch.dp_real_rows = to_device(real_rows(tokens, max(tokens)), self.device)
        return list(self._forward(part.input_ids, part.batch, part.sample_rows, dp_sampled=sampled).split(sampled))

    def _forward(self, input_ids: torch.Tensor, batch: ForwardBatch, sample_rows: torch.Tensor,
                 dp_sampled: list[int] | None = None) -> torch.Tensor:
        """This rank's forward -> logits [len(sample_rows), sample_vocab] float32, or under DP attention every
        group's sampled rows, [sum(dp_sampled), sample_vocab] in group order."""
        graph = self.graphs.get(batch.mode.name, batch) if dp_sampled is None else None  # DP's: `_forward_own`
        if graph is not None:
            return graph.replay(input_ids, batch)[0][sample_rows, : self.sample_vocab]
        attention = None
        if batch.mode is not ForwardMode.IDLE:
            attention = self.backends.attention(batch)
            attention.plan(batch)
        with batch_invariant(self.args.enable_deterministic_inference):
            hidden = self.model(input_ids, batch, attention)
            return self.model.compute_logits(hidden[sample_rows], dp_sampled)[:, : self.sample_vocab]


__getattr__ = moved_names(__name__)
