"""--skip-server-warmup: the engine serves without running the warm-up's shapes first (each compiles on its first
request instead); without it every shape runs before `ready`."""

from __future__ import annotations

import pytest

from plugserve.runtime import warmup
from plugserve.runtime.engine import Engine
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs


@pytest.mark.parametrize("skip", [False, True])
def test_skip_server_warmup_runs_no_warm_up_shape_and_still_serves(skip, monkeypatch):
    ran: list[str] = []
    for name in ("warm_up_prefill", "warm_up_decode"):
        original = getattr(warmup, name)
        monkeypatch.setattr(warmup, name, lambda *args, _name=name, _original=original: (ran.append(_name),
                                                                                         _original(*args)))
    engine = Engine(ServerArgs(model_preset="tiny", max_total_tokens=512, skip_server_warmup=skip))
    try:
        assert engine.ready.wait(60)
        assert (ran == []) is skip
        assert engine.generate("Hello", SamplingParams(max_new_tokens=3, ignore_eos=True))[0].completion_tokens == 3
    finally:
        engine.shutdown()
