"""`redline tune` on a CPU that emulates bf16: its measured trials would never pick bf16 (each runs 20 to 250 times
slower than fp32), but such a trial only runs out its time limit (600 s by default) before it loses. Where this
machine's saved `redline bench compute` figures measured bf16 slower than fp32, the space leaves bf16 out."""

from __future__ import annotations

import pytest

from redline.bench import store
from redline.bench.model import BenchRun, Measurement
from redline.tune.space import Machine, default_space


def saved(tflops: dict[str, float]) -> BenchRun:
    """This machine's saved figures, as `redline bench compute --save` leaves them."""
    measured = [
        Measurement("compute", f"matmul_{precision}", rate, "TFLOP/s", "torch.matmul (test)", device="cpu")
        for precision, rate in tflops.items()
    ]
    return BenchRun("f", {}, "2026-12-07T12:00:00+00:00", measured, quick=True)


@pytest.mark.parametrize(
    ("tflops", "precisions"),
    [
        ({"fp32": 0.052, "bf16": 0.0013}, [None]),  # emulated: fp32 only (the runtime's default on a CPU)
        ({"fp32": 1.0, "bf16": 4.0}, [None, "bf16"]),  # AMX: worth a trial
        ({"fp32": 1.0}, [None, "bf16"]),  # bf16 not measured: the trial decides
        (None, [None, "bf16"]),  # nothing saved
    ],
)
def test_tune_on_a_cpu_tries_bf16_unless_bench_measured_it_slower(
    tflops: dict[str, float] | None, precisions: list[str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(store, "latest_here", lambda: saved(tflops) if tflops else None)
    assert default_space(Machine.here(1))["precision"] == precisions
