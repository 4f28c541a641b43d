"""ServerArgs: every launch flag, validated, named as SGLang names them where it has one.

The CLI (`plugserve serve`) and the Engine take the same object; an invalid value is a clear error
naming the flag (`--max-running-requests must be >= 1`). No flag is accepted that changes nothing: one
that cannot take effect with the others given is refused here, naming both; a GPU-only flag on the CPU, or a
value beyond the model's, is refused by the model runner; a value capped there is logged as a warning naming
the value used (`tests/server/test_flags.py` walks every flag). A --kv-cache-dtype that no
attention backend usable on this machine reads (with the --dtype activations) is refused here, naming those that do.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from plugserve.core.names import LOAD_FORMATS, PRESETS
from plugserve.core.tokenizer import EMBEDDED_MODEL_DIR

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8_e4m3")  # torch's: core/specs.KV_DTYPES
LOG_LEVELS = ("debug", "info", "warning", "error")
# fcfs: arrival order; lpm: the waiting request with the longest cached prefix first (SGLang's others are refused).
SCHEDULE_POLICIES = ("fcfs", "lpm")
# EAGLE is SGLang's name for the same drafting when the draft is a DeepSeek model's NextN layer.
SPECULATIVE_ALGORITHMS = ("NEXTN", "EAGLE")
# --torch-compile-max-bs under --enable-torch-compile without it (SGLang's default).
DEFAULT_TORCH_COMPILE_MAX_BS = 32
SPECULATIVE_FLAGS = ("speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
                     "speculative_num_draft_tokens")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding as launched: each round drafts `num_steps` levels (a chain when `topk` is 1, else an
    EAGLE-2 tree expanding `topk` nodes by `topk` children a level) and verifies `num_draft_tokens` in one
    forward."""

    algorithm: str
    num_steps: int
    topk: int
    num_draft_tokens: int

    @property
    def max_draft_tokens(self) -> int:
        """The most tokens a round verifies: the root and every node its draft steps grow, the root's topk
        children and, at each later step, the topk children of each of the topk expanded nodes (fewer than a
        full tree's 1 + topk + topk^2 + ... from the third step on: EAGLE-2 expands topk nodes a level)."""
        return 1 + self.topk + (self.num_steps - 1) * self.topk**2

    @property
    def lookahead(self) -> int:
        """Positions past a request's last token whose KV slots one round writes: the verified drafts, and a
        tree's draft steps (the NextN layer over the (num_steps - 1) * topk expanded nodes)."""
        return max(self.num_draft_tokens, (self.num_steps - 1) * self.topk) - 1


class ServerArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # model
    model_path: str | None = None
    model_preset: str | None = None
    tokenizer_path: str | None = None
    load_format: str = "auto"
    quantization: Literal["fp8"] | None = None
    num_layers: int | None = Field(None, ge=1)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    device: str = "auto"
    context_length: int | None = Field(None, ge=2)
    # HTTP
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)
    # Excluded from every dump (/server_info, benchmark JSON): a secret.
    api_key: str | None = Field(None, exclude=True, repr=False)
    api_key_file: str | None = None
    served_model_name: str | None = None
    graceful_shutdown_timeout: float = Field(20.0, ge=0)
    max_request_body_bytes: int = Field(32 << 20, ge=1)
    allowed_origins: str | None = None
    chat_template: str | None = None
    stream_interval: int = Field(1, ge=1)
    enable_cache_report: bool = False  # cached_tokens is always in usage: accepted, said so at start-up
    enable_metrics: bool = False  # /metrics is always served: accepted, said so at start-up
    trust_remote_code: bool = False  # plugserve runs its own model code: accepted, said so at start-up
    # prompts x n of one request: each is a sequence the scheduler holds (and aborts when its client leaves)
    max_sequences_per_request: int = Field(256, ge=1)
    # parallelism
    tp_size: int = Field(1, ge=1)
    ep_size: int = Field(1, ge=1)
    enable_dp_attention: bool = False
    dp_size: int = Field(1, ge=1)
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    dist_init_addr: str | None = None
    disable_custom_all_reduce: bool = False
    # backends
    attention_backend: str = "auto"
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    fp8_gemm_backend: str = "auto"
    moe_runner_backend: str = "auto"
    all_reduce_backend: str = "auto"
    # memory and scheduling
    page_size: int | None = Field(None, ge=1)
    kv_cache_dtype: str = "auto"
    chunked_prefill_size: int = Field(8192, ge=-1)
    chunked_prefix_cache_threshold: int = Field(8192, ge=0)
    max_prefill_tokens: int | None = Field(None, ge=1)
    schedule_policy: str = "fcfs"
    max_running_requests: int | None = Field(None, ge=1)
    max_total_tokens: int | None = Field(None, ge=1)
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    enable_mixed_chunk: bool = False
    enable_deterministic_inference: bool = False
    # GPU performance switches
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = Field(None, ge=1)
    enable_torch_compile: bool = False
    torch_compile_max_bs: int | None = Field(None, ge=1)
    disable_shared_experts_overlap: bool = False
    enable_shared_experts_fusion: bool = False
    # speculative decoding: a NextN (MTP) layer drafts, the target's own or a draft checkpoint's (None: each value's
    # default once enabled)
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = Field(None, ge=1)
    speculative_eagle_topk: int | None = Field(None, ge=1)
    speculative_num_draft_tokens: int | None = Field(None, ge=2)
    # structured output, tool calls and reasoning
    grammar_backend: Literal["xgrammar", "none"] = "xgrammar"
    tool_call_parser: Literal["deepseekv3"] | None = None
    reasoning_parser: Literal["deepseek-r1"] | None = None
    # start-up, logs, liveness
    skip_server_warmup: bool = False
    watchdog_timeout: float = Field(300.0, gt=0)
    log_requests: bool = False
    log_requests_level: int = Field(0, ge=0, le=2)
    decode_log_interval: int = Field(40, ge=1)
    # misc
    log_level: str = "info"
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check_choices(self) -> ServerArgs:
        for field, allowed in CHOICES.items():
            value = getattr(self, field)
            if value is not None and value not in allowed:
                raise ValueError(f"{flag(field)} {value!r} is not one of: {', '.join(allowed)}")
        self._check_parallelism()
        if self.chunked_prefill_size == 0:
            raise ValueError(f"{flag('chunked_prefill_size')} must be positive, or -1 to disable chunking")
        if self.model_path is not None and self.model_preset is not None:
            raise ValueError(f"give {flag('model_path')} or {flag('model_preset')}, not both")
        if self.load_format == "safetensors" and self.model_path is None:
            raise ValueError(f"{flag('load_format')} safetensors needs {flag('model_path')}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"{flag('device')} {self.device!r} is not one of: auto, cpu, cuda, cuda:N")
        self._check_speculative()
        self._check_dependent_flags()
        if self.chat_template is not None:
            self._check_chat_template()
        self._check_kv_cache_dtype()
        return self

    def _check_kv_cache_dtype(self) -> None:
        """--kv-cache-dtype other than auto: each phase's requested attention backend (under auto, any usable here)
        must read it next to the --dtype activations, or the server would fail only when it warms up."""
        if self.kv_cache_dtype == "auto" or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            return
        import torch  # here, not at import: `plugserve serve --help` stays light

        from plugserve.core.forward_batch import Phase
        from plugserve.core.hardware import Hardware
        from plugserve.core.loader import resolve_dtype
        from plugserve.core.specs import KV_DTYPES, AttentionSpec
        from plugserve.registry import get_registry

        device = torch.device(self.device if self.device != "auto" else
                              "cuda" if torch.cuda.is_available() else "cpu")
        hardware, activations = Hardware.detect(device), resolve_dtype(self.dtype, device)
        registry = get_registry()
        for phase, requested in ((Phase.DECODE, self.decode_attention), (Phase.PREFILL, self.prefill_attention)):
            entries = [e for name, e in sorted(registry.backends["attention"].items()) if requested in ("auto", name)]
            usable = [e for e in entries if registry.availability(e.cls, hardware)
                      and phase in e.cls.capabilities.phases()]
            if not usable:
                continue  # the backend selection says why, naming its flag

            def reads(name: str, usable: list = usable) -> bool:
                spec = AttentionSpec(dtype=activations, kv_cache_dtype=KV_DTYPES[name])
                return any(e.cls.capabilities.check_kv_cache_dtype(spec) for e in usable)

            if not reads(self.kv_cache_dtype):
                supported = ", ".join(["auto", *(name for name in KV_DTYPES if reads(name))])
                what = "; ".join(f"{e.name}: {e.cls.capabilities.kv_cache_dtype_names()}" for e in usable)
                raise ValueError(f"{flag('kv_cache_dtype')} {self.kv_cache_dtype}: no {phase.value} attention backend "
                                 f"usable here ({phase.value} backend {requested}) reads it with {activations} "
                                 f"activations ({what}); supported here: {supported}")

    def _check_dependent_flags(self) -> None:
        """Flags that take effect only with another flag, or not with it: refused rather than ignored."""
        if self.torch_compile_max_bs is not None and not self.enable_torch_compile:
            raise ValueError(f"{flag('torch_compile_max_bs')} needs {flag('enable_torch_compile')} (without it "
                             "nothing is compiled)")
        if self.cuda_graph_max_bs is not None and self.disable_cuda_graph:
            raise ValueError(f"{flag('cuda_graph_max_bs')} does not combine with {flag('disable_cuda_graph')}: "
                             "no graph is captured")
        if self.disable_shared_experts_overlap and self.enable_shared_experts_fusion:
            raise ValueError(f"{flag('disable_shared_experts_overlap')} does not combine with "
                             f"{flag('enable_shared_experts_fusion')}: fused, the shared experts run inside the MoE "
                             "backend's GEMMs, on no stream of their own")
        if self.schedule_policy == "lpm" and self.disable_radix_cache:
            raise ValueError(f"{flag('schedule_policy')} lpm needs the prefix cache (drop "
                             f"{flag('disable_radix_cache')}, or give {flag('schedule_policy')} fcfs): without it no "
                             "request has a cached prefix to order by")
        if self.enable_mixed_chunk and self.speculative_algorithm is not None:
            raise ValueError(f"{flag('enable_mixed_chunk')} does not combine with {flag('speculative_algorithm')}: "
                             "a speculative decode step is a verify forward of drafts, which no prefill batch holds")
        if self.enable_deterministic_inference and self.speculative_algorithm is not None:
            raise ValueError(f"{flag('enable_deterministic_inference')} does not combine with "
                             f"{flag('speculative_algorithm')} yet: the draft forwards are not batch-invariant")
        if self.log_requests_level and not self.log_requests:
            raise ValueError(f"{flag('log_requests_level')} {self.log_requests_level} needs {flag('log_requests')} "
                             "(the level says what each request's line holds)")
        if self.log_requests and LOG_LEVELS.index(self.log_level) > LOG_LEVELS.index("info"):
            raise ValueError(f"{flag('log_requests')} logs at info: with {flag('log_level')} {self.log_level} no line "
                             f"would show (give {flag('log_level')} info or debug)")

    @property
    def compile_max_bs(self) -> int:
        """--torch-compile-max-bs with its default filled in (read under --enable-torch-compile)."""
        return self.torch_compile_max_bs or DEFAULT_TORCH_COMPILE_MAX_BS

    def _check_chat_template(self) -> None:
        import jinja2  # transformers renders chat templates with it

        try:
            jinja2.Environment().parse(self.chat_template_text)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"{flag('chat_template')}: not a Jinja template ({exc.message}, line {exc.lineno})"
                             ) from None

    @property
    def chat_template_text(self) -> str | None:
        """--chat-template's Jinja text: the file it names, else the value itself (an inline template)."""
        if self.chat_template is None:
            return None
        path = Path(self.chat_template).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8")
        if "{{" not in self.chat_template and "{%" not in self.chat_template:
            raise ValueError(f"{flag('chat_template')} {self.chat_template!r}: no such file, nor an inline Jinja "
                             "template")
        return self.chat_template

    @property
    def prefill_token_budget(self) -> int | None:
        """Most tokens in one prefill batch: --max-prefill-tokens and --chunked-prefill-size, the smaller; a longer
        prompt is prefilled in chunks of it (None: no cap)."""
        caps = [c for c in (self.max_prefill_tokens, self.chunked_prefill_size) if c is not None and c > 0]
        return min(caps) if caps else None

    @property
    def origins(self) -> list[str]:
        """--allowed-origins as a list (empty: no CORS headers)."""
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]

    def notices(self) -> list[str]:
        """One line for each flag taken from SGLang's vocabulary that changes nothing here, saying why."""
        lines = []
        if self.trust_remote_code:
            lines.append(f"{flag('trust_remote_code')}: ignored: plugserve runs its own DeepSeek model code, never a "
                         "checkpoint's remote code")
        if self.enable_metrics:
            lines.append(f"{flag('enable_metrics')}: metrics are always served at /metrics")
        if self.enable_cache_report:
            lines.append(f"{flag('enable_cache_report')}: usage.prompt_tokens_details.cached_tokens is always "
                         "reported")
        return lines

    def _check_parallelism(self) -> None:
        if self.tp_size % self.nnodes:
            raise ValueError(f"{flag('tp_size')} {self.tp_size} does not split over {flag('nnodes')} {self.nnodes} "
                             "(each node runs the same number of ranks)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"{flag('node_rank')} {self.node_rank} must be below {flag('nnodes')} {self.nnodes}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError(f"{flag('nnodes')} {self.nnodes} needs {flag('dist_init_addr')} (host:port of node 0)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"{flag('dist_init_addr')} {self.dist_init_addr!r} is not host:port")
            if self.tp_size == 1:
                raise ValueError(f"{flag('dist_init_addr')} is for several ranks: give {flag('tp_size')} > 1")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"{flag('ep_size')} {self.ep_size} must be 1 or {flag('tp_size')} ({self.tp_size}): "
                             "expert parallelism runs within the tensor-parallel ranks")
        if self.ep_size > 1 and self.enable_shared_experts_fusion:
            raise ValueError(f"{flag('enable_shared_experts_fusion')} does not combine with {flag('ep_size')} "
                             f"{self.ep_size}: the shared experts are split by width, the routed ones by expert")
        self._check_dp_attention()
        for name in ("disable_custom_all_reduce", "all_reduce_backend"):
            if getattr(self, name) not in (False, "auto") and self.tp_size == 1:
                raise ValueError(f"{flag(name)} is for several ranks: give {flag('tp_size')} > 1")
        if self.disable_custom_all_reduce and self.all_reduce_backend not in ("auto", "torch_ref"):
            raise ValueError(f"{flag('disable_custom_all_reduce')} sums with torch_ref, not "
                             f"{flag('all_reduce_backend')} {self.all_reduce_backend}: give one of them")
        if self.tp_size > 1 and self.device.startswith("cuda:"):
            raise ValueError(f"{flag('device')} {self.device} names one GPU: with {flag('tp_size')} {self.tp_size} "
                             "rank r of a node takes cuda:r (give auto or cuda)")

    @model_validator(mode="before")
    @classmethod
    def _read_api_key_file(cls, values: Any) -> Any:
        """--api-key-file: the key is the file's first line (so that it stays out of `ps` and shell history)."""
        if not isinstance(values, dict) or values.get("api_key_file") is None:
            return values
        path = values["api_key_file"]
        if values.get("api_key") is not None:
            raise ValueError(f"give {flag('api_key')} or {flag('api_key_file')}, not both")
        try:
            key = Path(path).read_text(encoding="utf-8").splitlines()[0].strip()
        except (OSError, UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"{flag('api_key_file')} {path}: cannot read a key from it ({type(exc).__name__})"
                             ) from None
        if not key:
            raise ValueError(f"{flag('api_key_file')} {path}: its first line is empty")
        return values | {"api_key": key}

    def _check_dp_attention(self) -> None:
        if self.enable_dp_attention and self.dp_size == 1:
            raise ValueError(f"{flag('enable_dp_attention')} needs {flag('dp_size')} > 1 (the number of "
                             "data-parallel attention groups)")
        if not self.enable_dp_attention:
            if self.dp_size > 1:
                raise ValueError(f"{flag('dp_size')} {self.dp_size} needs {flag('enable_dp_attention')}: data "
                                 "parallelism runs as DP attention within one engine's --tp-size ranks")
            return
        if self.tp_size % self.dp_size:
            raise ValueError(f"{flag('dp_size')} {self.dp_size} must divide {flag('tp_size')} ({self.tp_size}): "
                             f"each DP attention group is {flag('tp_size')} / {flag('dp_size')} ranks, which split "
                             "the group's attention heads")
        if self.enable_deterministic_inference and self.tp_size // self.dp_size > 2:
            raise ValueError(f"{flag('enable_deterministic_inference')} takes DP attention groups of at most two "
                             f"ranks, not {self.tp_size // self.dp_size} ({flag('tp_size')} {self.tp_size} / "
                             f"{flag('dp_size')} {self.dp_size}): a group sums its heads over its own NCCL all-reduce, "
                             "whose order of summation follows the message's size beyond two ranks")

    @property
    def dp_attention_size(self) -> int:
        """DP attention groups: --dp-size under --enable-dp-attention, else 1 (attention split over every rank). Each
        group is --tp-size / --dp-size ranks."""
        return self.dp_size if self.enable_dp_attention else 1

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def _check_speculative(self) -> None:
        given = [name for name in SPECULATIVE_FLAGS if getattr(self, name) is not None]
        if self.speculative_algorithm is None:
            if given:
                raise ValueError(f"{flag(given[0])} needs {flag('speculative_algorithm')} "
                                 f"({' or '.join(SPECULATIVE_ALGORITHMS)})")
            return
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"{flag('speculative_algorithm')} {self.speculative_algorithm!r} is not one of: "
                             "NEXTN, EAGLE (NEXTN's alias for DeepSeek models)")
        draft = self.speculative_draft_model_path
        if draft is not None and not (Path(draft) / "config.json").is_file():
            raise ValueError(f"{flag('speculative_draft_model_path')} {draft}: not a checkpoint directory (no "
                             "config.json there)")
        spec = self.speculative
        assert spec is not None
        if spec.topk > 1:
            if spec.num_draft_tokens > spec.max_draft_tokens:
                raise ValueError(f"{flag('speculative_num_draft_tokens')} {spec.num_draft_tokens} is more than "
                                 f"{flag('speculative_num_steps')} {spec.num_steps} with "
                                 f"{flag('speculative_eagle_topk')} {spec.topk} draft: at most "
                                 f"{spec.max_draft_tokens} (the root, its {spec.topk} children, and "
                                 f"{spec.topk}^2 nodes a later step)")
        elif spec.num_draft_tokens != spec.num_steps + 1:
            raise ValueError(f"{flag('speculative_num_draft_tokens')} {spec.num_draft_tokens} must be "
                             f"{flag('speculative_num_steps')} + 1 = {spec.num_steps + 1} with "
                             f"{flag('speculative_eagle_topk')} 1: a chain verifies its drafts and the token "
                             "before them")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The speculative-decoding settings with their defaults filled in (None: off). With topk 1 the
        number of steps and of draft tokens determine each other."""
        if self.speculative_algorithm is None:
            return None
        topk = self.speculative_eagle_topk or 1
        steps = self.speculative_num_steps
        if steps is None:
            steps = self.speculative_num_draft_tokens - 1 if self.speculative_num_draft_tokens and topk == 1 else 3
        draft_tokens = self.speculative_num_draft_tokens or steps + 1
        return SpeculativeConfig(self.speculative_algorithm, steps, topk, draft_tokens)

    @property
    def model_dir(self) -> str | None:
        """The checkpoint to read: --model-path, else the embedded model (trained by training/, shipped in the
        package); None for a --model-preset's random weights."""
        if self.model_path is None and self.model_preset is None:
            return str(EMBEDDED_MODEL_DIR)
        return self.model_path

    @property
    def prefill_attention(self) -> str:
        return self.prefill_attention_backend or self.attention_backend

    @property
    def decode_attention(self) -> str:
        return self.decode_attention_backend or self.attention_backend


CHOICES: dict[str, Collection[str]] = {
    "model_preset": PRESETS.keys(),  # a live view: a preset added at run time (a test's) is a choice too
    "load_format": LOAD_FORMATS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "log_level": LOG_LEVELS,
    "schedule_policy": SCHEDULE_POLICIES,
}
"""The string flags with a fixed set of values (None, where allowed, is not among them)."""


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem, each naming the flag, from pydantic's error."""
    lines = []
    for e in error.errors():
        field = ".".join(str(part) for part in e["loc"])
        message = e["msg"].removeprefix("Value error, ")
        lines.append(f"{flag(field)}: {message}" if field else message)
    return "; ".join(lines)
