"""The kit itself: it must fail deliberately wrong backends, and pass a correct third-party one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WRONG_BACKENDS = '''
import torch
from plugserve.plugins.attention.torch_ref import TorchRefAttention
from plugserve.plugins.gemm.torch_ref import TorchRefFp8Gemm
from plugserve.plugins.moe.torch_ref import TorchRefMoE
from plugserve.registry import hookimpl


class NoRope(TorchRefAttention):
    """Forgets the rope part of the MLA scores."""
    name = "no_rope"

    def forward_mla(self, q_nope, q_rope, layer_id):
        return super().forward_mla(q_nope, torch.zeros_like(q_rope), layer_id)


class NoScaling(TorchRefMoE):
    """Forgets DeepSeek's routed_scaling_factor."""
    name = "no_scaling"

    def forward(self, x, packed, topk_ids, topk_weights, routed_scaling_factor):
        return super().forward(x, packed, topk_ids, topk_weights, 1.0)


class LastBlockScaleIgnored(TorchRefFp8Gemm):
    """Uses the first K-block's weight scale for the whole row of blocks."""
    name = "one_scale"

    def prepare(self, weight, weight_scale_inv):
        return super().prepare(weight, weight_scale_inv[:, :1].expand_as(weight_scale_inv).contiguous())


@hookimpl
def plugserve_backends():
    return [NoRope, NoScaling, LastBlockScaleIgnored]
'''


def _kit(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "plugserve.testing",
         "--plugserve-device", "cpu", "--plugserve-dtypes", "float32", *args],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(folder)}, check=False,
    )


@pytest.mark.parametrize(
    ("backend", "failing_test"),
    [
        ("attention:no_rope", "test_forward_mla"),
        ("moe:no_scaling", "test_forward"),
        ("gemm:one_scale", "test_apply"),
    ],
)
def test_kit_fails_a_wrong_backend(make_plugin, backend: str, failing_test: str):
    folder = make_plugin("wrong-kernels", "wrong_kernels_plugin", WRONG_BACKENDS)
    result = _kit(folder, "--plugserve-backend", backend)
    assert result.returncode == 1, result.stdout[-3000:]
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    assert failed and all(f"::{failing_test}[" in line for line in failed), "\n".join(failed)


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
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "plugserve.testing",
         "--plugserve-backend", "attention:sdpa"],
        capture_output=True, text=True, env=env, check=False,
    )
    assert kit.returncode == 0, kit.stdout[-3000:]
    assert " passed" in kit.stdout and "failed" not in kit.stdout
