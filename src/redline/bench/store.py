"""Where measurements live between runs, so the doctor and the planner can read what bench measured.

Runs are saved per machine: ``$REDLINE_HOME/bench/<fingerprint>/<time>.json`` (``redline.env.state_dir``;
default ``~/.local/share/redline``). The fingerprint names the machine by what makes its figures comparable:
hostname, CPU model, and the GPUs (model and UUID).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from redline.bench.model import BENCH_SCHEMA_VERSION, BenchRun, Measurement, Spread
from redline.env import State, state_dir
from redline.errors import BadInput, one_line
from redline.hw.snapshot import Snapshot


def runs_dir() -> Path:
    """Where saved runs live: a folder per machine in it."""
    return state_dir(State.BENCH)


def fingerprint(snapshot: Snapshot) -> tuple[str, dict[str, Any]]:
    """A short stable id of this machine, and the facts it was made from."""
    machine = {
        "hostname": snapshot.host.hostname,
        "cpu_model": snapshot.host.cpu_model,
        "cpu_logical_cores": snapshot.host.cpu_logical_cores,
        "gpus": [{"name": g.name, "uuid": g.uuid} for g in snapshot.gpus],
        "driver": snapshot.gpu.driver_version,
        "torch": snapshot.software.torch.version if snapshot.software.torch else None,
    }
    identity = json.dumps([machine["hostname"], machine["cpu_model"], machine["gpus"]], sort_keys=True)
    return hashlib.sha256(identity.encode()).hexdigest()[:12], machine


def save(run: BenchRun) -> Path:
    folder = runs_dir() / run.fingerprint
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{run.taken_at.replace(':', '').replace('+0000', 'Z')}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(run.to_dict(), indent=2), encoding="utf-8")
    os.replace(tmp, path)
    return path


def saved_runs(machine_fingerprint: str) -> list[Path]:
    """This machine's saved runs, oldest first (file names are UTC timestamps)."""
    folder = runs_dir() / machine_fingerprint
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def latest(machine_fingerprint: str) -> BenchRun | None:
    """Everything this machine has measured, newest figure of each kind: `bench compute --save` then
    `bench storage --save` leaves both for the doctor, not only the storage run."""
    paths = saved_runs(machine_fingerprint)
    if not paths:
        return None
    newest: dict[tuple[str, str, str], Measurement] = {}
    runs = [load(p) for p in paths]
    for run in runs:  # oldest first, so newer figures replace older ones
        for m in run.measurements:
            newest[(m.suite, m.name, m.device)] = m
    last = runs[-1]
    return BenchRun(
        fingerprint=last.fingerprint,
        machine=last.machine,
        taken_at=last.taken_at,
        measurements=list(newest.values()),
        quick=all(r.quick for r in runs),
    )


def latest_here() -> BenchRun | None:
    """This machine's newest saved figures (as ``latest``), or None when there are none or they cannot be
    read: a caller (a training run, a transfer) goes on without measured figures rather than stopping."""
    from redline.hw.host import probe_host
    from redline.hw.nvml.probe import probe_gpus
    from redline.hw.snapshot import HostInfo
    from redline.hw.sysfs import SysFs

    fs = SysFs("/")
    try:
        host = probe_host(fs)
    except Exception:  # as take_snapshot does: a probe bug must not stop the caller
        host = HostInfo()
    snapshot = Snapshot(host=host, gpu=probe_gpus(None, [], fs))
    try:
        return latest(fingerprint(snapshot)[0])
    except BadInput:
        return None


def load(path: Path) -> BenchRun:
    """Read a saved run; a malformed file is bad input with the reason, never a traceback."""
    from redline.files import read_user_file

    try:  # never a FIFO or a device, never past the cap
        data = json.loads(read_user_file(path, "bench results"))
    except json.JSONDecodeError as exc:
        raise BadInput(f"cannot read bench results {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("schema_version") != BENCH_SCHEMA_VERSION:
        raise BadInput(f"{path} is not a redline bench result of schema {BENCH_SCHEMA_VERSION}")
    try:
        quick = bool(data.get("quick", False))
        measurements = [_measurement(m) for m in data["measurements"]]
        for m in measurements:  # kept per figure, so a merge of quick and full runs still knows
            m.extra.setdefault("quick", quick)
        return BenchRun(
            fingerprint=data["fingerprint"],
            machine=data["machine"],
            taken_at=data["taken_at"],
            measurements=measurements,
            quick=quick,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BadInput(f"{path}: malformed bench result ({one_line(exc)})") from None


def _measurement(data: dict[str, Any]) -> Measurement:
    fields = {k: v for k, v in data.items() if k != "ratio"}
    spread = fields.pop("spread", None)
    return Measurement(**fields, spread=Spread(**spread) if spread else None)
