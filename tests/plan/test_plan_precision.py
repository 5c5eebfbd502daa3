"""The precision a plan trains in by default: bf16 (or fp16) only where the device runs it faster than fp32.

A CPU without bf16 units (no AVX512-BF16, no AMX) emulates bf16 matmuls 20 to 250 times slower than fp32's, and
``redline bench compute --save`` measures it so; ``--hardware local`` plans with those saved ceilings, and a plan in
bf16 there would crawl (issue 43: the example's recipe ran 85-120 s per step instead of under a second)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from redline.bench import store
from redline.bench.model import BenchRun, Measurement
from redline.cli.plan import FLAGS
from redline.hw.snapshot import HostInfo, Snapshot
from redline.plan.hardware import Cluster, local_cluster
from redline.plan.inputs import Target
from redline.plan.planner import Note, NoteKind, plan_training
from redline.plan.search import Constraints, default_precision, slower_than_fp32
from redline.specs.catalog import gpu_catalog
from redline.workload.load import bare_params_profile

PROFILE = bare_params_profile(1e6, 64)  # `redline plan --params 1M --seq-len 64`
TARGET = Target(global_batch=32)
# what `redline bench compute memory --save` measured on a 2-core cloud VM whose CPU has AVX2 and no bf16 units
EMULATED = {"fp32": 0.052, "bf16": 0.0013}


def saved_ceilings(tflops: dict[str, float], snapshot: Snapshot) -> BenchRun:
    """A bench run of this CPU's matmul rates and host copy, as ``redline bench compute memory --save`` saves it."""
    fingerprint, machine = store.fingerprint(snapshot)
    measured = [
        Measurement("compute", f"matmul_{precision}", rate, "TFLOP/s", "torch.matmul (test)", device="cpu")
        for precision, rate in tflops.items()
    ]
    measured.append(Measurement("memory", "host_copy", 10.0, "GB/s", "dst.copy_(src) (test)", device="cpu"))
    return BenchRun(fingerprint, machine, "2026-12-07T12:00:00+00:00", measured, quick=True)


def cpu_cluster(tflops: dict[str, float], home: Path, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """``--hardware local`` on a CPU-only machine, its ceilings read back from a saved bench run."""
    monkeypatch.setenv("REDLINE_HOME", str(home))
    snapshot = Snapshot(host=HostInfo(hostname="cpu-box", cpu_model="Test CPU", memory_total_bytes=16 * 2**30))
    run = saved_ceilings(tflops, snapshot)
    store.save(run)
    return local_cluster(snapshot, store.latest(run.fingerprint))


def precision_notes(notes: tuple[Note, ...]) -> list[str]:
    """The notes about the precision, as `redline plan` words them."""
    return [note.text(FLAGS) for note in notes if note.kind is NoteKind.PRECISION]


def test_a_cpu_that_emulates_bf16_plans_in_fp32_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = cpu_cluster(EMULATED, tmp_path, monkeypatch)
    assert default_precision(cluster) == "fp32" and slower_than_fp32(cluster) == ("bf16",)
    plans = plan_training(PROFILE, cluster, TARGET)
    assert {e.strategy.precision for e in plans.ranked} == {"fp32"}
    assert precision_notes(plans.notes) == [
        "bf16 runs emulated here: 0.0013 TFLOP/s against fp32's 0.052, so the plans train in fp32 "
        "(--precision bf16 plans it anyway)"
    ]
    # the library says the field's name where the CLI says its flag
    said = next(note.text() for note in plans.notes if note.kind is NoteKind.PRECISION)
    assert said.endswith("(precision bf16 plans it anyway)")
    # what the choice saves: the step time of the same plan in bf16, at the measured bf16 rate
    in_bf16 = plan_training(PROFILE, cluster, TARGET, Constraints(precision="bf16"))
    assert in_bf16.best.time.total > 10 * plans.best.time.total


def test_bf16_fixed_by_the_user_is_kept_with_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plans = plan_training(PROFILE, cpu_cluster(EMULATED, tmp_path, monkeypatch), TARGET, Constraints(precision="bf16"))
    assert plans.best.strategy.precision == "bf16"
    assert precision_notes(plans.notes) == [
        "bf16 runs emulated here: 0.0013 TFLOP/s against fp32's 0.052: the plans would run faster in fp32 "
        "(leave out --precision)"
    ]
    fp32 = plan_training(PROFILE, cpu_cluster(EMULATED, tmp_path, monkeypatch), TARGET, Constraints(precision="fp32"))
    assert precision_notes(fp32.notes) == []


@pytest.mark.parametrize(
    ("tflops", "chosen", "said"),
    [
        ({"fp32": 1.0, "bf16": 4.0}, "bf16", None),  # AMX: bf16 is the faster, as on a GPU
        ({"fp32": 1.0, "bf16": 1.0}, "bf16", None),  # as fast: bf16 still halves activations
        ({"fp32": 1.0, "bf16": 0.8}, "fp32", "bf16 runs slower than fp32 here: 0.8 TFLOP/s against fp32's 1"),
        ({"fp32": 1.0}, "fp32", None),  # bench measured no bf16
    ],
)
def test_a_cpu_plans_in_whichever_runs_faster(
    tflops: dict[str, float], chosen: str, said: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans = plan_training(PROFILE, cpu_cluster(tflops, tmp_path, monkeypatch), TARGET)
    assert plans.best.strategy.precision == chosen
    notes = precision_notes(plans.notes)
    assert [note.split(",")[0] for note in notes] == ([said] if said else [])


def test_every_catalog_gpu_keeps_its_16_bit_default() -> None:
    """No GPU of the catalog runs 16 bits slower than its fp32 (TF32) ceiling: their defaults are unchanged."""
    from redline.plan.hardware import catalog_cluster

    for gpu in gpu_catalog():
        cluster = catalog_cluster(gpu, 1, name=gpu.key)
        expected = next((p for p in ("bf16", "fp16", "fp32") if p in cluster.matmul), None)
        assert slower_than_fp32(cluster) == (), gpu.key
        assert expected is None or default_precision(cluster) == expected, gpu.key


def test_plan_hardware_local_on_a_cpu_that_emulates_bf16(tmp_path: Path) -> None:
    """The example's recipe on this machine's saved ceilings, as a user runs it (this machine's fingerprint, so
    that `redline plan --hardware local` reads them): fp32 plans, and the note why."""
    from redline.hw.probe import take_snapshot

    snapshot = take_snapshot()
    if snapshot.gpus:
        pytest.skip("this machine has a GPU: --hardware local plans for it, not for the CPU")
    home = tmp_path / "home"
    env = {"REDLINE_HOME": str(home)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REDLINE_HOME", str(home))
        store.save(saved_ceilings(EMULATED, snapshot))
    args = ("plan", "--params", "1M", "--seq-len", "64", "--global-batch", "32", "--hardware", "local", "--json")
    result = run_cli(*args, env=env)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert {plan["strategy"]["precision"] for plan in shown["ranked"]} == {"fp32"}
    assert any(note.startswith("bf16 runs emulated here: 0.0013 TFLOP/s") for note in shown["plan"]["notes"])
