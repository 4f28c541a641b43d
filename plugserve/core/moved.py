"""Old import paths of modules and names that moved, kept working for plugins and scripts written against
them: each import through one warns (DeprecationWarning) and names the new path. `install()` (run by
`plugserve/__init__.py`) puts the finder of moved modules first on `sys.meta_path`; a module that still exists
but lost names sets `__getattr__ = moved_names(__name__)`."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import ModuleType

_RUNTIME = ("model_runner", "cuda_graph_runner", "scheduler", "dp_scheduler", "engine", "speculative", "sampling",
            "request", "radix_cache", "metrics", "ranks", "server_args")

# Whole modules: old dotted path -> new one (a package maps its submodules too).
MOVED_MODULES: dict[str, str] = {
    **{f"plugserve.core.{name}": f"plugserve.runtime.{name}" for name in _RUNTIME},
    "plugserve.testing": "plugserve.conformance",
}

# Names that left a module: old module -> {name: new module}. An old module that no longer exists (split
# in several) is made of these names alone.
MOVED_NAMES: dict[str, dict[str, str]] = {
    "plugserve.core.interfaces": {name: "plugserve.core.specs" for name in ("AttentionSpec", "GemmSpec", "RouterConfig",
                                                                             "MoESpec", "SPEC_TYPES", "KINDS")},
    "plugserve.core.dispatch": {"AttnForwardMethod": "plugserve.core.forward_batch",
                                "PrefixChunk": "plugserve.core.forward_batch"},
    "plugserve.runtime.scheduler": {"SchedulerGauges": "plugserve.runtime.metrics"},
    "plugserve.runtime.cuda_graph_runner": {name: "plugserve.core.graph_inputs"
                                            for name in ("GraphInputs", "capture_sizes", "padded_size")},
    # One kernel family per file.
    "plugserve.plugins.attention.triton_kernels": {
        **{name: "plugserve.plugins.attention.common" for name in ("LOG2E", "MIN_DOT")},
        **{name: "plugserve.plugins.attention.mla_decode"
           for name in ("MLA_SPLIT_KEYS_PER_HEAD", "MLA_MIN_SPLIT_KEYS", "MLA_MAX_SPLITS", "MLA_MIN_FILL",
                        "MLA_MAX_WAVES", "MLA_REDUCE_SPLITS", "MLA_REDUCE_BLOCK_V", "MlaConfig", "mla_block_h",
                        "mla_config", "mla_tma_fits", "mla_gluon_fits", "mla_min_split_keys", "mla_num_splits",
                        "mla_workspace_size", "mla_attention")},
        **{name: "plugserve.plugins.attention.mha_prefill"
           for name in ("MhaConfig", "GLUON_MHA", "mha_gluon_fits", "mha_configs", "mha_varlen")},
        "merge_attn_states": "plugserve.plugins.attention.merge",
    },
    "plugserve.runtime.model_runner": {
        "ChosenBackend": "plugserve.runtime.backends", "Bucket": "plugserve.runtime.backends",
        "WARMUP_PREFILL_TOKENS": "plugserve.runtime.backends", "Part": "plugserve.runtime.rank_protocol",
        "GraphPlan": "plugserve.runtime.cuda_graph_runner", "plan_in_graph": "plugserve.runtime.speculative_graphs",
        "report_late_triton_compiles": "plugserve.runtime.metrics",
        **{name: "plugserve.runtime.warmup"
           for name in ("WARMUP_EXTEND_TOKENS", "CPU_WARMUP_TOKENS", "WARMUP_MIN_PREFILL_TOKENS")},
    },
    "plugserve.runtime.speculative": {
        **{name: "plugserve.runtime.acceptance" for name in ("verify_drafts", "verify_tree")},
        **{name: "plugserve.runtime.speculative_graphs" for name in ("greedy_round_forward", "plan_in_graph")},
    },
    "plugserve.plugins.moe.triton_kernels": {
        **{name: "plugserve.plugins.moe.router"
           for name in ("grouped_topk", "fused_router", "FUSED_ROUTER_MAX_TOKENS", "ROUTER_PROGRAMS", "NO_GROUPS",
                        "GROUP_BY_MAX", "GROUP_BY_TOP2_SUM")},
        **{name: "plugserve.plugins.moe.align"
           for name in ("BlockAlignment", "pair_blocks", "align_pairs", "moe_align_block_size")},
        "per_token_group_quant": "plugserve.plugins.moe.quant",
        **{name: "plugserve.plugins.moe.grouped_gemm" for name in ("grouped_gemm", "MIN_BLOCK_N", "COLUMN_MAX_K")},
        "fused_experts": "plugserve.plugins.moe.experts",
    },
    # Split-K's helpers, shared with the core's batch-invariant matmul.
    "plugserve.plugins.triton_shared": {name: "plugserve.core.triton_tiles" for name in ("split_k_arrive",
                                                                                          "split_k_sum")},
    "plugserve.plugins.triton_support": {"split_k_arrivals": "plugserve.core.triton_tiles"},
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}: import it from there", DeprecationWarning, stacklevel=3)


def new_module_path(old: str) -> str | None:
    """The module that replaced `old` (itself or a package above it moved), or None."""
    for prefix, target in MOVED_MODULES.items():
        if old == prefix or old.startswith(prefix + "."):
            return target + old[len(prefix):]
    return None


def moved_names(module: str) -> Callable[[str], object]:
    """A module `__getattr__` that hands out the names `module` lost (warning), and raises AttributeError
    for any other."""

    def getattr_(name: str) -> object:
        target = MOVED_NAMES.get(module, {}).get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        _warn(f"{module}.{name}", f"{target}.{name}")
        return getattr(importlib.import_module(target), name)

    return getattr_


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module path to the module that replaced it (the same module object), or to a module of
    the names it lost when it no longer exists."""

    def find_spec(self, fullname: str, path: object = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        new = new_module_path(fullname)
        if new is not None:
            # Where the new module lies, so that tools that read files (pytest --pyargs) find them.
            found = importlib.util.find_spec(new)
            spec = importlib.machinery.ModuleSpec(fullname, self, origin=found.origin if found else None,
                                                  is_package=bool(found and found.submodule_search_locations))
            if found is not None and found.submodule_search_locations is not None:
                spec.submodule_search_locations = list(found.submodule_search_locations)
            return spec
        if fullname in MOVED_NAMES and _gone(fullname):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = new_module_path(spec.name)
        if new is not None:
            _warn(spec.name, new)
            return importlib.import_module(new)
        module = ModuleType(spec.name, f"Moved: {', '.join(sorted(set(MOVED_NAMES[spec.name].values())))}")
        module.__getattr__ = moved_names(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module is whole already."""


def _gone(fullname: str) -> bool:
    """Whether no file of the package provides `fullname` any more."""
    parent = fullname.rpartition(".")[0]
    package = sys.modules.get(parent)
    search = getattr(package, "__path__", None)
    return search is not None and importlib.machinery.PathFinder.find_spec(fullname, search) is None


def install() -> None:
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
