import pytest

from benchmarks.dev import sweep_triton_mha
from plugserve.plugins.attention.mha_prefill import MhaConfig


def test_configs_parse_from_the_command_line():
    assert sweep_triton_mha.parse_config("128x64x8x3") == MhaConfig(128, 64, 8, 3)
    assert sweep_triton_mha.parse_config("128x64x8x3xtma") == MhaConfig(128, 64, 8, 3, tma=True)
    assert sweep_triton_mha.parse_config("64x64x4x2xwsxtma") == MhaConfig(64, 64, 4, 2, True, True)
    assert sweep_triton_mha.parse_config("128x128x8x2xgluon") == MhaConfig(128, 128, 8, 2, gluon=True)
    for bad in ["128x64x8", "128x64x8x3xfast", "axbxcxd"]:
        with pytest.raises(ValueError, match="MxNxWARPSxSTAGES"):
            sweep_triton_mha.parse_config(bad)
