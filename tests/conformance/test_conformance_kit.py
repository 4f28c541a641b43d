"""The kit itself: it must fail deliberately wrong backends, and pass a correct third-party one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WRONG_BACKENDS = '''
import dataclasses

import torch
from plugserve.core.interfaces import CommCapabilities
from plugserve.plugins.attention.torch_ref import TorchRefAttention
from plugserve.plugins.comm.torch_ref import TorchDistributedAllReduce
from plugserve.plugins.gemm.torch_ref import TorchRefFp8Gemm
from plugserve.plugins.moe.torch_ref import TorchRefMoE
from plugserve.registry import hookimpl


class NoRope(TorchRefAttention):
    """Forgets the rope part of the MLA scores."""
    name = "no_rope"

    def forward_mla(self, q_nope, q_rope, layer_id):
        return super().forward_mla(q_nope, torch.zeros_like(q_rope), layer_id)


class HotSoftmax(TorchRefAttention):
    """A softmax scale 5% too large (a YaRN mscale applied twice would do that)."""
    name = "hot_softmax"

    def __init__(self, spec, device):
        super().__init__(dataclasses.replace(spec, sm_scale=spec.softmax_scale * 1.05), device)


class NoScaling(TorchRefMoE):
    """Forgets DeepSeek's routed_scaling_factor."""
    name = "no_scaling"

    def forward(self, x, packed, topk_ids, topk_weights, routed_scaling_factor):
        return super().forward(x, packed, topk_ids, topk_weights, 1.0)


class WrongExpert(TorchRefMoE):
    """Runs each token through the expert after the one it was routed to."""
    name = "wrong_expert"

    def forward(self, x, packed, topk_ids, topk_weights, routed_scaling_factor):
        shifted = (topk_ids + 1) % self.spec.num_experts
        return super().forward(x, packed, shifted, topk_weights, routed_scaling_factor)


class NoBias(TorchRefMoE):
    """Chooses V3's experts without the e_score_correction_bias."""
    name = "no_bias"

    def route(self, router_logits, correction_bias):
        return super().route(router_logits, None if correction_bias is None else torch.zeros_like(correction_bias))


class LastBlockScaleIgnored(TorchRefFp8Gemm):
    """Uses the first K-block's weight scale for the whole row of blocks."""
    name = "one_scale"

    def prepare(self, weight, weight_scale_inv):
        return super().prepare(weight, weight_scale_inv[:, :1].expand_as(weight_scale_inv).contiguous())


class OwnRowsOnly(TorchDistributedAllReduce):
    """Returns its own rank's tensor: a sum that was never sent."""
    name = "own_rows_only"

    def all_reduce(self, x):
        return x


class PastItsBound(TorchDistributedAllReduce):
    """Declares 4 KiB at two ranks, but takes messages of any size."""
    name = "past_its_bound"
    capabilities = CommCapabilities(dtypes=frozenset({torch.float32}), devices=frozenset({"cpu", "cuda"}),
                                    max_bytes={2: 4096})

    def takes(self, x):
        return True


@hookimpl
def plugserve_backends():
    return [NoRope, HotSoftmax, NoScaling, WrongExpert, NoBias, LastBlockScaleIgnored, OwnRowsOnly, PastItsBound]
'''

# Subtle bugs put into the torch references themselves: before the kit had its own oracle it compared
# torch_ref with torch_ref and could not see them.
BROKEN_REFERENCES = '''
import torch
from plugserve.plugins.attention import torch_ref as attention_ref
from plugserve.plugins.gemm import torch_ref as gemm_ref
from plugserve.plugins.moe import torch_ref as moe_ref


def top_left_causal_mask(q_len, kv_len, device=None):
    """Causality aligned top-left: right only when there is no cached prefix."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril()


def all_groups(scores, group_scores, topk_group, fill):
    """Forgets the group limit of V2 / V3 routing."""
    return scores


def fnuz_quant(x, group_size=128):
    """Scales for e4m3fnuz's largest value, 240, not e4m3fn's 448: x_q * scale is still about x, but on
    a coarser grid, with scales that are not the contract's."""
    x_q, scales = per_token_group_quant_fp8(x, group_size)
    return (x_q.float() * (240 / 448)).to(x_q.dtype), scales * (448 / 240)


per_token_group_quant_fp8 = gemm_ref.per_token_group_quant_fp8
attention_ref.causal_mask = top_left_causal_mask
moe_ref._keep_top_groups = all_groups
gemm_ref.per_token_group_quant_fp8 = fnuz_quant


def plugserve_backends():
    return []
'''


def _kit(folder: Path, report: Path, *args: str) -> dict[str, set[str]]:
    """Run the kit in float32 on the CPU over the plugin in `folder`; {backend: names of its failed tests}."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--tb=line", "-p", "no:cacheprovider", "--pyargs",
         "plugserve.conformance",
         "--plugserve-device", "cpu", "--plugserve-dtypes", "float32", "--plugserve-report", str(report), *args],
        capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))},
    )
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]
    failed: dict[str, set[str]] = {}
    for outcome in json.loads(report.read_text())["results"]:
        test, _, params = outcome["test"].partition("::")[2].partition("[")
        if params.partition("-")[0].rstrip("]") == "none":  # a kind none of `args` selects: its tests skip
            continue
        backend = params.split("-float32")[0].split("-")[-1]  # ids hold "<backend>-float32"
        failed.setdefault(backend, set())
        if outcome["outcome"] == "failed":
            failed[backend].add(test)
    return failed


def test_kit_fails_wrong_backends(make_plugin, tmp_path: Path):
    expected = {
        # They inherit torch_ref's tree_verify, so the tree case runs on them and catches them too.
        "attention:no_rope": {"test_forward_mla", "test_forward_mla_tree_verify"},
        "attention:hot_softmax": {"test_forward_mla", "test_forward_mha", "test_forward_mla_tree_verify"},
        "moe:no_scaling": {"test_forward", "test_forward_on_one_ranks_experts",
                           "test_forward_skips_the_slots_of_expert_minus_one"},
        "moe:wrong_expert": {"test_forward", "test_forward_on_one_ranks_experts",
                             "test_forward_skips_the_slots_of_expert_minus_one"},
        "moe:no_bias": {"test_route", "test_route_hidden"},  # route_hidden's default goes through route
        "gemm:one_scale": {"test_apply"},
        "comm:own_rows_only": {"test_all_reduce"},
        "comm:past_its_bound": {"test_all_reduce"},
    }
    folder = make_plugin("wrong-kernels", "wrong_kernels_plugin", WRONG_BACKENDS)
    failed = _kit(folder, tmp_path / "report.json", *(a for b in expected for a in ("--plugserve-backend", b)))
    assert failed == {backend.partition(":")[2]: tests for backend, tests in expected.items()}


def test_kit_checks_the_torch_references_against_its_oracle(make_plugin, tmp_path: Path):
    folder = make_plugin("broken-references", "broken_references_plugin", BROKEN_REFERENCES)
    references = ("attention:torch_ref", "gemm:torch_ref", "moe:torch_ref")
    failed = _kit(folder, tmp_path / "report.json", *(a for b in references for a in ("--plugserve-backend", b)))
    # A top-left mask is right without a cached prefix (not in DECODE); the others are wrong everywhere. The mask
    # also gives an extend's last token other keys after a cached prefix than in a whole prefill.
    assert failed == {"torch_ref": {"test_forward_mla", "test_forward_mha", "test_route", "test_route_hidden",
                                    "test_quantize_activation", "test_apply", "test_forward_mla_is_batch_invariant"}}


def test_third_party_plugin_installs_is_listed_selected_and_passes_the_kit(tmp_path: Path):
    example = Path(__file__).parents[2] / "examples" / "third_party_plugin"
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site),
         str(example)],
        check=True, capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    listing = subprocess.run([sys.executable, "-m", "plugserve", "backends", "--kind", "attention", "--json"],
                             capture_output=True, text=True, env=env, check=True)
    report = json.loads(listing.stdout)
    [sdpa] = [b for b in report["backends"] if b["name"] == "sdpa"]
    assert sdpa["package"] == "plugserve-sdpa"
    assert sdpa["phases"]["decode"]["usable"] and sdpa["phases"]["prefill"]["reason"] == "does not run prefill"
    # Higher priority than the reference: auto picks it for decode on the CPU, and never for prefill.
    picks = {(r["phase"], r["max_batch_size"]): r["backend"] for r in report["auto"]}
    assert picks[("decode", 1)] == "sdpa" and picks[("prefill", 1)] == "torch_ref"

    selected = subprocess.run(
        [sys.executable, "-c", "from plugserve.registry import select; from plugserve.core.forward_batch import Phase;"
         "from plugserve.core.hardware import Hardware;"
         "print(select('attention', Phase.DECODE, 8, Hardware.detect('cpu'), 'sdpa').backend.__module__)"],
        capture_output=True, text=True, env=env, check=True,
    )
    assert selected.stdout.strip() == "plugserve_sdpa"

    kit = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "plugserve.conformance",
         "--plugserve-backend", "attention:sdpa"],
        capture_output=True, text=True, env=env, check=False,
    )
    assert kit.returncode == 0, kit.stdout[-3000:]
    assert " passed" in kit.stdout and "failed" not in kit.stdout


def test_kit_runs_attention_at_one_ranks_heads(tmp_path: Path):
    """--plugserve-heads: every attention case at the given per-rank head counts (here 3: odd, and no grid's)."""
    report = tmp_path / "report.json"
    failed = _kit(tmp_path, report, "--plugserve-backend", "attention:torch_ref", "--plugserve-heads", "3",
                  "-k", "test_forward_mla and not graph or test_merge_attn_states or test_forward_mha")
    assert failed == {"torch_ref": set()}
    ran = [r["test"] for r in json.loads(report.read_text())["results"] if r["outcome"] == "passed"]
    assert ran and all("-h3" in test for test in ran), ran
    assert {t.partition("::")[2].partition("[")[0] for t in ran} == {
        "test_forward_mla", "test_forward_mla_tree_verify", "test_merge_attn_states", "test_forward_mha",
        "test_forward_mla_is_batch_invariant"}

    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                             "plugserve.conformance", "--plugserve-heads", "0"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 4 and "--plugserve-heads '0': expected positive head counts" in result.stderr
