"""The closest measured GPU for one without its own selection table or tuned config."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugserve.core.device_match import closest_measured, gpu_family, measured_device_keys
from plugserve.core.hardware import Hardware

H100_SXM = "NVIDIA_H100_80GB_HBM3"
H100_NVL = "NVIDIA_H100_NVL"
H200 = "NVIDIA_H200"
GH200 = "NVIDIA_GH200_480GB"
A100 = "NVIDIA_A100-SXM4-80GB"


def gpu(name: str, capability: tuple[int, int] | None = (9, 0)) -> Hardware:
    return Hardware("cuda", name, capability, 80 * 2**30, 132)


def test_families_of_names_and_keys() -> None:
    assert gpu_family("NVIDIA H100 PCIe") == gpu_family(H100_SXM) == "H100"
    assert gpu_family("NVIDIA H200 NVL") == "H200" and gpu_family(GH200) == "GH200"
    assert gpu_family("NVIDIA A100-SXM4-80GB") is None and gpu_family("cpu") is None


def test_own_measurements_come_first() -> None:
    match = closest_measured(gpu("NVIDIA H200"), [H100_SXM, H200], "selection table")
    assert (match.key, match.exact) == (H200, True)
    assert match.reason == "measured on NVIDIA H200"


@pytest.mark.parametrize(("name", "measured", "expected", "why"), [
    ("NVIDIA H100 PCIe", [H100_SXM, H200], H100_SXM, "same sm90 family, H100"),
    ("NVIDIA H100 94GB HBM2e", [H200, H100_SXM], H100_SXM, "same sm90 family, H100"),
    ("NVIDIA H100 NVL", [H100_SXM, H100_NVL.replace("H100", "H200"), "NVIDIA_H100_NVL_2"], "NVIDIA_H100_NVL_2",
     "same sm90 family, H100"),  # within the family: the most words in common (NVL)
    ("NVIDIA H200 NVL", [H100_SXM, H200], H200, "same sm90 family, H200"),
    ("NVIDIA H200 NVL", [H100_SXM, GH200], GH200, "GH200: the nearest measured family to the H200"),
    ("NVIDIA GH200 480GB", [H100_SXM, H200], H200, "H200: the nearest measured family to the GH200"),
    ("NVIDIA GH200 480GB", [H100_SXM], H100_SXM, "H100: the nearest measured family to the GH200"),
    ("NVIDIA H100 PCIe", [H200, GH200], H200, "H200: the nearest measured family to the H100"),
])
def test_another_size_or_form_factor_takes_the_closest_measured(name, measured, expected, why) -> None:
    match = closest_measured(gpu(name), measured, "selection table")
    assert (match.key, match.exact) == (expected, False)
    assert match.reason.startswith(f"no selection table for {name}; using {expected}, the closest measured ({why}")


@pytest.mark.parametrize("hardware", [
    gpu("NVIDIA A10", (8, 6)),  # no known family
    gpu("NVIDIA H100 PCIe", (8, 0)),  # a family, but not its compute capability: nothing to match
    Hardware.detect("cpu"),
])
def test_no_match_outside_the_compute_capability_says_so(hardware: Hardware) -> None:
    match = closest_measured(hardware, [H100_SXM, A100], "tuned config N=1,K=2")
    assert match.key is None and not match.exact
    assert match.reason == (f"no tuned config N=1,K=2 for {hardware.name}, nor for another GPU known to share its "
                            f"compute capability ({hardware.arch}) (measured: {A100}, {H100_SXM})")


def test_measured_device_keys_reads_only_files_of_the_one_shape(tmp_path: Path) -> None:
    def name(key: str) -> str:
        return f"N=4,K=8,device_name={key},dtype=fp8_w8a8.json"

    for path in (name(H100_SXM), name(H200), "N=4,K=16,device_name=NVIDIA_H100_NVL,dtype=fp8_w8a8.json", "README.md"):
        (tmp_path / path).write_text("{}")
    assert sorted(measured_device_keys(tmp_path, name)) == [H100_SXM, H200]
    assert measured_device_keys(tmp_path / "absent", name) == []
