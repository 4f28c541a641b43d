import dataclasses
import json

import pytest
import torch

from plugserve.conformance.self_check import self_check
from plugserve.core.forward_batch import AttnForwardMethod, Phase
from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import OK, AttentionCapabilities, Availability
from plugserve.core.specs import AttentionSpec
from plugserve.plugins.attention.torch_ref import TorchRefAttention
from plugserve.registry import (
    TABLES_ENV,
    Registry,
    RegistryError,
    SelectionError,
    SelectionTable,
    comm_order_line,
    hookimpl,
)

CPU = Hardware.detect("cpu")
H100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 * 2**30, 132)
B200 = Hardware("cuda", "NVIDIA B200", (10, 0), 180 * 2**30, 148)


def _backend(name: str, priority: dict[str, int] | None = None, **caps) -> type[TorchRefAttention]:
    """A reference-backed attention backend with its own name, priority and capabilities."""
    capabilities = AttentionCapabilities(
        dtypes=frozenset({torch.bfloat16, torch.float32}), devices=frozenset({"cuda", "cpu"}), **caps
    )
    return type(name, (TorchRefAttention,), {"name": name, "capabilities": capabilities,
                                             "priority": priority or {}})


class _Plugin:
    def __init__(self, *backends):
        self.backends = list(backends)

    @hookimpl
    def plugserve_backends(self):
        return self.backends


def _registry(*backends) -> Registry:
    registry = Registry(builtin=(), entry_points=False)
    registry.register(_Plugin(*backends), "test-plugin", "test-package")
    return registry


def test_builtin_reference_backends_are_registered_and_usable_on_cpu():
    registry = Registry(entry_points=False)
    for kind in ("attention", "gemm", "moe"):
        entry = registry.get(kind, "torch_ref")
        assert entry.package == "plugserve"
        assert registry.availability(entry.cls, CPU)
    assert registry.broken == []


def test_entry_point_plugins_load_and_broken_ones_are_recorded(make_plugin):
    make_plugin("good-kernels", "good_kernels_plugin", """
        from plugserve.plugins.attention.torch_ref import TorchRefAttention
        from plugserve.registry import hookimpl

        class Fast(TorchRefAttention):
            name = "fast"

        @hookimpl
        def plugserve_backends():
            return [Fast]
    """)
    make_plugin("bad-kernels", "bad_kernels_plugin", "raise RuntimeError('no CUDA toolkit found')\n")
    registry = Registry()
    assert registry.get("attention", "fast").package == "good-kernels"
    [broken] = [b for b in registry.broken if b.package == "bad-kernels"]
    assert "RuntimeError: no CUDA toolkit found" in broken.error


def test_a_plugin_whose_hook_raises_or_returns_junk_is_broken_not_fatal():
    class Raises:
        @hookimpl
        def plugserve_backends(self):
            raise ImportError("flashinfer is not installed")

    class Junk:
        @hookimpl
        def plugserve_backends(self):
            return [object]

    registry = Registry(builtin=(), entry_points=False)
    registry.register(Raises(), "raises", "pkg-a")
    registry.register(Junk(), "junk", "pkg-b")
    errors = {b.plugin: b.error for b in registry.broken}
    assert "flashinfer is not installed" in errors["raises"]
    assert "not a Backend subclass" in errors["junk"]


def test_a_backend_declaring_a_method_it_lacks_is_refused():
    from plugserve.core.interfaces import AttentionBackend

    class DecodeOnly(AttentionBackend):
        name = "decode_only"
        capabilities = AttentionCapabilities(dtypes=frozenset({torch.float32}))  # declares MHA too

        def forward_mla(self, q_nope, q_rope, layer_id):
            return q_nope

    registry = _registry(DecodeOnly)
    assert "declares MHA but does not implement forward_mha" in registry.broken[0].error


def test_a_backend_planning_in_graphs_it_never_runs_under_is_refused():
    from plugserve.core.interfaces import AttentionBackend

    class NoGraphs(AttentionBackend):
        name = "no_graphs"
        capabilities = AttentionCapabilities(dtypes=frozenset({torch.float32}), methods=frozenset(
            {AttnForwardMethod.MLA}), graph_plan_on_device=True)

        def forward_mla(self, q_nope, q_rope, layer_id):
            return q_nope

    registry = _registry(NoGraphs)
    assert "declares graph_plan_on_device without graph_modes" in registry.broken[0].error


def test_two_backends_with_one_name_is_an_error_naming_both_packages():
    registry = _registry(_backend("same"))
    with pytest.raises(RegistryError, match=r"'test-package'.*'other-package'"):
        registry.register(_Plugin(_backend("same")), "other-plugin", "other-package")


def test_requested_backend_is_used_or_refused_with_the_usable_list():
    sm100_only = _backend("blackwell", min_capability=(10, 0))
    registry = _registry(_backend("portable"), sm100_only)
    assert registry.select("attention", Phase.DECODE, 8, B200, "blackwell").backend is sm100_only
    with pytest.raises(SelectionError) as err:
        registry.select("attention", Phase.DECODE, 8, H100, "blackwell")
    assert "needs sm100 or newer, this GPU is sm90" in str(err.value)
    assert "Usable: portable" in str(err.value)
    with pytest.raises(SelectionError, match="unknown attention backend 'nope'; registered: blackwell, portable"):
        registry.select("attention", Phase.DECODE, 8, H100, "nope")


def test_spec_mismatch_makes_a_backend_unusable_for_that_model():
    flashmla_like = _backend("paged64", page_sizes=frozenset({64}), kv_lora_ranks=frozenset({512}),
                             methods=frozenset({AttnForwardMethod.MLA}))
    registry = _registry(flashmla_like, _backend("anything"))
    status = {s.entry.name: s.availability for s in
              registry.statuses("attention", Phase.DECODE, H100, AttentionSpec(page_size=16))}
    assert status["paged64"].reason == "page size 16 is not supported (supports 64)"
    prefill = {s.entry.name: s.availability for s in registry.statuses("attention", Phase.PREFILL, H100)}
    assert prefill["paged64"].reason == "does not run prefill"
    fp16 = {s.entry.name: s.availability for s in
            registry.statuses("attention", Phase.DECODE, H100, AttentionSpec(dtype=torch.float16))}
    assert fp16["anything"].reason == "dtype float16 is not supported (supports bfloat16, float32)"


def test_deterministic_inference_takes_only_batch_invariant_backends():
    fast = _backend("fast", {"default": 90}, batch_invariant_note="splits the KV by the batch size")
    registry = _registry(fast, _backend("invariant", {"default": 1}, batch_invariant=True))
    spec = AttentionSpec(batch_invariant=True)
    assert registry.select("attention", Phase.DECODE, 8, H100).backend.name == "fast"
    assert registry.select("attention", Phase.DECODE, 8, H100, spec=spec).backend.name == "invariant"
    with pytest.raises(SelectionError) as err:
        registry.select("attention", Phase.DECODE, 8, H100, "fast", spec=spec)
    assert ("not batch-invariant, which --enable-deterministic-inference needs: splits the KV by the batch size"
            in str(err.value))
    assert "Usable: invariant" in str(err.value)


def test_auto_takes_the_highest_priority_for_this_arch():
    registry = _registry(
        _backend("hopper_fast", {"sm90": 90, "default": 10}),
        _backend("generic", {"cuda": 50}),
        _backend("blackwell", {"sm100": 100}, min_capability=(10, 0)),
    )
    assert registry.select("attention", Phase.DECODE, 1, H100).backend.name == "hopper_fast"
    assert registry.select("attention", Phase.DECODE, 1, B200).backend.name == "blackwell"
    assert "highest priority on sm90 (90)" in registry.select("attention", Phase.DECODE, 1, H100).reason


def test_auto_follows_the_measured_table_per_bucket_and_skips_unusable(tmp_path, monkeypatch):
    registry = _registry(_backend("a", {"default": 100}), _backend("b"),
                         _backend("c", min_capability=(10, 0)))
    table = {
        "device_name": H100.name,
        "rankings": {"attention": {"decode": [
            {"max_batch_size": 8, "order": ["b", "a"]},
            {"max_batch_size": 128, "order": ["c", "a", "b"]},  # c cannot run on sm90
        ]}},
    }
    (tmp_path / f"{H100.device_key}.json").write_text(json.dumps(table))
    monkeypatch.setenv(TABLES_ENV, str(tmp_path))
    pick = registry.select("attention", Phase.DECODE, 4, H100)
    assert pick.backend.name == "b" and "measured on NVIDIA H100 80GB HBM3" in pick.reason
    assert registry.select("attention", Phase.DECODE, 64, H100).backend.name == "a"
    assert registry.select("attention", Phase.DECODE, 4096, H100).backend.name == "a"  # beyond last bucket
    assert registry.select("attention", Phase.PREFILL, 4, H100).backend.name == "a"  # no table: priority


def test_auto_ranks_attention_by_the_heads_measured_nearest_the_models(tmp_path, monkeypatch):
    """A table measured at 128 heads with attention also measured at 16 (shootout --merge-into): 16-head problems
    (V2-Lite, V3 over 8 ranks) and 32-head ones take the 16-head ranking, 64 and 128 the main one."""
    registry = _registry(_backend("a"), _backend("b"))
    table = {
        "device_name": H100.name,
        "rankings": {"attention": {"decode": [{"max_batch_size": 8, "order": ["a", "b"]}]}},
        "attention_by_heads": {"16": {"decode": [{"max_batch_size": 8, "order": ["b", "a"]}]}},
    }
    (tmp_path / f"{H100.device_key}.json").write_text(json.dumps(table))
    monkeypatch.setenv(TABLES_ENV, str(tmp_path))

    def pick(heads: int) -> str:
        spec = AttentionSpec(num_heads=heads, dtype=torch.bfloat16)
        selection = registry.select("attention", Phase.DECODE, 1, H100, spec=spec)
        return f"{selection.backend.name} {selection.reason.split('batch size 1, ')[1].split(' (')[0]}"

    assert pick(16) == "b 16 heads" and pick(32) == "b 16 heads"
    assert pick(64) == "a 128 heads" and pick(128) == "a 128 heads"
    assert registry.select("attention", Phase.DECODE, 1, H100).backend.name == "a"  # no spec: the main ranking


def test_availability_is_asked_once_and_an_exception_becomes_a_reason():
    calls = []

    class Probe(_backend("probe")):
        @classmethod
        def availability(cls, hardware):
            calls.append(hardware)
            raise OSError("libcuda.so.1: cannot open shared object file")

    registry = _registry(Probe)
    first = registry.availability(Probe, H100)
    assert registry.availability(Probe, H100) == first and len(calls) == 1
    assert first == Availability.no("availability check raised OSError: libcuda.so.1: cannot open shared object file")
    assert OK and not first


def test_kernels_line_reaches_explain_and_a_raising_hook_is_reported():
    from rich.console import Console

    from plugserve.backends_report import describe, print_report

    class Switching(_backend("switching")):
        @classmethod
        def kernels(cls, hardware):
            return f"MLA decode: {'Gluon' if hardware.capability == (9, 0) else 'Triton'}"

    class Raising(_backend("raising")):
        @classmethod
        def kernels(cls, hardware):
            raise RuntimeError("no probe")

    registry = _registry(Switching, Raising, _backend("quiet"))
    assert registry.kernels("attention", "switching", H100) == "MLA decode: Gluon"
    assert registry.kernels("attention", "switching", B200) == "MLA decode: Triton"
    assert registry.kernels("attention", "raising", H100) == "kernels() raised RuntimeError: no probe"
    assert registry.kernels("attention", "quiet", H100) == ""
    report = describe(registry, H100, ["attention"], explain=True)
    assert {b["name"]: b["kernels"] for b in report["backends"]}["switching"] == "MLA decode: Gluon"
    console = Console(record=True, width=400)
    print_report(report, explain=True, console=console)
    assert "MLA decode: Gluon" in console.export_text()


SMALL = AttentionSpec(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                      dtype=torch.float32)


def _off_by_a_bit(name: str, priority: int) -> type[TorchRefAttention]:
    """Runs, but its absorbed MLA output is 1% too large: only the self-check can tell."""
    base = _backend(name, {"cpu": priority})

    def forward_mla(self, q_nope, q_rope, layer_id):
        return TorchRefAttention.forward_mla(self, q_nope, q_rope, layer_id) * 1.01

    return type(name, (base,), {"forward_mla": forward_mla})


def test_build_falls_back_past_a_backend_failing_its_self_check_and_says_so():
    registry = _registry(_off_by_a_bit("wrong", 10), _backend("right", {"cpu": 5}))
    backend, selection = registry.build("attention", Phase.DECODE, 1, torch.device("cpu"), SMALL, check=self_check)
    assert backend.name == "right" and isinstance(backend, TorchRefAttention)
    assert "fell back from wrong: self-check failed: AssertionError" in selection.reason


def test_build_of_a_requested_backend_failing_its_self_check_raises():
    registry = _registry(_off_by_a_bit("wrong", 10), _backend("right", {"cpu": 5}))
    with pytest.raises(SelectionError, match=r"no attention backend passed its start-up self-check.*wrong"):
        registry.build("attention", Phase.DECODE, 1, torch.device("cpu"), SMALL, requested="wrong",
                       check=self_check)


def test_build_gives_each_candidate_the_spec_it_fits():
    forced = _backend("paged64", {"cpu": 10}, page_sizes=frozenset({64}))
    registry = _registry(forced)
    backend, _ = registry.build("attention", Phase.DECODE, 1, torch.device("cpu"), SMALL,
                                fit_spec=lambda cls, spec: dataclasses.replace(spec, page_size=64), check=self_check)
    assert backend.spec.page_size == 64


def test_a_gpu_without_its_own_table_uses_the_closest_measured_and_says_so(tmp_path, monkeypatch):
    registry = _registry(_backend("a", {"default": 100}), _backend("b"))
    table = {"device_name": H100.name, "rankings": {"attention": {"decode": [{"max_batch_size": 8, "order": ["b"]}]}}}
    (tmp_path / f"{H100.device_key}.json").write_text(json.dumps(table))
    monkeypatch.setenv(TABLES_ENV, str(tmp_path))
    pcie = dataclasses.replace(H100, name="NVIDIA H100 PCIe")
    pick = registry.select("attention", Phase.DECODE, 4, pcie)
    assert pick.backend.name == "b"
    assert ("no selection table for NVIDIA H100 PCIe; using NVIDIA_H100_80GB_HBM3, the closest measured "
            "(same sm90 family, H100)") in pick.reason
    # Another compute capability: priority, saying that no table fits.
    other = registry.select("attention", Phase.DECODE, 4, dataclasses.replace(B200, name="NVIDIA B200 2"))
    assert other.backend.name == "a"
    assert other.reason.startswith("no selection table for NVIDIA B200 2, nor for another GPU known to share its "
                                   "compute capability (sm100) (measured: NVIDIA_H100_80GB_HBM3); highest priority")


def test_selection_table_loads_with_and_without_comm_buckets_and_round_trips():
    """A table written before comm was ranked still loads (no comm: every world by declared priority); comm buckets
    by world size come back sorted by size, and the JSON they dump reads back the same."""
    old = SelectionTable.model_validate({"device_name": "cpu", "rankings": {}})
    assert old.comm == {} and old.comm_buckets(2) == []
    table = SelectionTable.model_validate_json(json.dumps({"device_name": "cpu", "rankings": {}, "comm": {"2": [
        {"max_bytes": 1 << 20, "order": ["torch_ref"]}, {"max_bytes": 16 << 10, "order": ["fast", "torch_ref"]}]}}))
    assert [(b.max_bytes, b.order) for b in table.comm_buckets(2)] == [(16 << 10, ["fast", "torch_ref"]),
                                                                      (1 << 20, ["torch_ref"])]
    assert table.comm_buckets(4) == []
    assert SelectionTable.model_validate_json(table.model_dump_json()) == table


def test_comm_order_line_merges_buckets_of_one_order():
    line = comm_order_line([(4 << 10, ["a", "t"]), (16 << 10, ["a", "t"]), (64 << 10, ["t"]), (1 << 20, ["t"])])
    assert line == "up to 16 KiB: a > t; above: t"
    assert comm_order_line([(1 << 20, ["t"])]) == "any size: t"
    assert comm_order_line([(1000, ["a"]), (1 << 20, ["t"])]) == "up to 1000 B: a; above: t"
