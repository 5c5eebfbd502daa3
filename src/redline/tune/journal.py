"""The tune's journal: every trial's result, appended and flushed as it ends, in a file named by what the
results depend on (this machine, the software, the script and its arguments, the trial setup). A tune killed
at any point starts again where it stopped; a tune run again on the same machine finds every result there and
runs nothing; on another machine it tries the best that a journal of the same script found first.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

from redline.env import State, state_dir
from redline.tune.space import Candidate
from redline.tune.trial import Setup, TrialResult

JOURNAL_FORMAT = 1


def cache_dir() -> Path:
    """``$REDLINE_TUNE_CACHE``, else the data home's (``$REDLINE_HOME/tune``: ``redline.env.state_dir``)."""
    return state_dir(State.TUNE)


def machine_signature() -> dict[str, Any]:
    """What makes this machine run a script at the speed it does: its accelerators, CPUs and software."""
    import torch

    import redline
    from redline.hw.host import usable_cpus

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "gpus": gpus,
        "cpu": _cpu_model(),
        "cpus": usable_cpus(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "redline": redline.__version__,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def script_fingerprint(setup: Setup, base_plan: dict[str, Any] | None) -> str:
    """The script's text, its arguments, the base plan and the trial setup, hashed: a change to any of them
    makes old results say nothing of the new runs."""
    digest = hashlib.sha256()
    digest.update(Path(setup.script).read_bytes())
    setup_fields = asdict(setup) | {"script": Path(setup.script).name, "timeout_s": None}
    digest.update(json.dumps([setup_fields, base_plan], sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


class Journal:
    """The results of one tune, by candidate key, on disk as JSON lines (a header, then a line per trial)."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.results: dict[str, tuple[Candidate | None, TrialResult]] = {}  # None: the baseline's
        self.resumed = False
        if path.exists():
            lines = _lines(path)
            if len(lines) < len(path.read_text().splitlines()):  # a line cut short: keep the whole ones
                path.write_text("".join(json.dumps(line) + "\n" for line in lines))
            for line in lines[1:]:
                candidate = Candidate.from_dict(line["candidate"]) if line["candidate"] else None
                self.results[line["key"]] = (candidate, TrialResult.from_dict(line["result"]))
            self.resumed = bool(self.results)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._append({"format": JOURNAL_FORMAT} | header)

    @classmethod
    def open(cls, setup: Setup, base_plan: dict[str, Any] | None, directory: Path | None = None) -> Journal:
        machine = machine_signature()
        script = script_fingerprint(setup, base_plan)
        machine_id = hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:12]
        path = (directory or cache_dir()) / f"{script}-{machine_id}.jsonl"
        return cls(path, {"script": script, "machine": machine})

    def get(self, key: str) -> TrialResult | None:
        found = self.results.get(key)
        return found[1] if found else None

    def record(self, key: str, candidate: Candidate | None, result: TrialResult) -> None:
        self.results[key] = (candidate, result)
        self._append({"key": key, "candidate": candidate.to_dict() if candidate else None, "result": result.to_dict()})

    def _append(self, line: dict[str, Any]) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps(line) + "\n")
            out.flush()
            os.fsync(out.fileno())

    def best_elsewhere(self) -> Candidate | None:
        """The fastest candidate that a journal of the same script on another machine found: the first to
        try here after the baseline."""
        script = self.path.name.split("-")[0]
        best: tuple[float, Candidate] | None = None
        for other in self.path.parent.glob(f"{script}-*.jsonl"):
            if other == self.path:
                continue
            for entry in _lines(other)[1:]:
                result = entry["result"]
                speed = result["samples_per_s"] if entry["candidate"] and result["status"] == "ok" else None
                if speed and (best is None or speed > best[0]):
                    best = (speed, Candidate.from_dict(entry["candidate"]))
        return best[1] if best else None


def _lines(path: Path) -> list[dict[str, Any]]:
    """A journal's entries; a last line cut short (the tune was killed while writing it) is left out."""
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return entries
