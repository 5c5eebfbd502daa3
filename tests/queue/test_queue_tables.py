"""`redline jobs` and `redline queue status` readable at 80 and 120 columns: every id, name, state, size and
reason whole on a line, nothing cut, no line past the width (through ``ui.print_table``; in process)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from redline.cli import ui
from redline.cli.queue import jobs_table, status_table
from redline.queue.spec import JobSpec, JobState
from redline.queue.store import Job
from tables import WIDTHS, assert_whole

GIB = 2**30
NOW = 1_800_000_000.0
UUIDS = ["GPU-5c1e9a3b-7f41-4d2e-9a55-0c8b2f4e1d77", "GPU-a7d03c55-19e2-4b6f-8e01-6f2d9c3b4a10"]


def _job(key: int, name: str, state: JobState, reason: str, gpus: int = 0, placed: bool = False) -> Job:
    spec = JobSpec(argv=("python", "train.py"), name=name, gpus=gpus, gpu_memory_bytes=20 * GIB if gpus else None)
    placement = {"uuids": UUIDS[:gpus], "reserved_bytes": [20 * GIB] * gpus} if placed else None
    started = NOW - 3600 if placed else None
    return Job(key, 1000, "alice", spec, state, reason, NOW - 7200, started, None, 1, 0, 0.0, None, placement, False)


def _drawn(table: object, width: int) -> str:
    out = io.StringIO()
    ui.print_table(table, out=Console(file=out, width=width, color_system=None, markup=False))  # type: ignore[arg-type]
    return out.getvalue()


@pytest.mark.parametrize("width", WIDTHS)
def test_jobs_are_whole_at_any_width(width: int) -> None:
    listed = [
        _job(41, "llama-8b-finetune", JobState.RUNNING, "", gpus=2, placed=True).to_dict(private=False),
        _job(42, "eval-sweep", JobState.QUEUED, "GPU 0 has 12.0 GiB free of the 20.0 GiB asked", gpus=1).to_dict(
            private=False
        ),
    ]
    text = _drawn(jobs_table(listed, NOW), width)
    assert_whole(text, "41", "llama-8b-finetune", "running", "GPU-5c1e9a3b", "20.0 GiB", "eval-sweep", width=width)
    assert_whole(text, "queued", "12.0 GiB free", "20.0 GiB asked", width=width)


@pytest.mark.parametrize("width", WIDTHS)
def test_queue_status_is_whole_at_any_width(width: int) -> None:
    answer = {
        "policy": "pack",
        "pid": 4321,
        "gpus": [
            {
                "index": i,
                "uuid": uuid,
                "used_bytes": 21 * GIB * i,
                "total_bytes": 80 * GIB,
                "room_bytes": 80 * GIB - 21 * GIB * i,
                "jobs": [{"id": "41", "reserved_bytes": 20 * GIB}],
                "foreign": [{"pid": 4242, "bytes": 21 * GIB}] if i else [],
                "drained": "failing: Xid 79" if i else "",
            }
            for i, uuid in enumerate(UUIDS)
        ],
    }
    text = _drawn(status_table(answer), width)
    assert_whole(text, "GPU-5c1e9a3b", "21.0 GiB", "80.0 GiB", "59.0 GiB", "41 (20.0 GiB)", width=width)
    assert_whole(text, "pid 4242", "Xid 79", "daemon pid 4321", width=width)
