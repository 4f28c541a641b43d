"""profile_decode's host phases name functions that exist: a renamed one would fail the device run at its end."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.dev.profile_decode import phase_targets


def test_every_phase_target_exists() -> None:
    scheduler = SimpleNamespace(runner=SimpleNamespace(backends=SimpleNamespace(decode_buckets=[])))
    targets = phase_targets(scheduler)  # type: ignore[arg-type]
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in targets if name not in vars(owner)]
    assert missing == []
