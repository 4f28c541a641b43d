import pytest

from plugserve.core.hardware import Hardware


def test_cpu_is_described():
    cpu = Hardware.detect("cpu")
    assert cpu.arch == "cpu" and cpu.capability is None and not cpu.is_cuda
    assert cpu.total_memory_bytes > 0 and cpu.multiprocessors >= 1


def test_gpu_names_and_arch():
    h100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 * 2**30, 132)
    assert h100.arch == "sm90" and h100.device_key == "NVIDIA_H100_80GB_HBM3"
    assert "sm90" in h100.describe()


def test_unknown_device_type_is_refused():
    with pytest.raises(ValueError, match="'cuda' or 'cpu'"):
        Hardware.detect("meta")
