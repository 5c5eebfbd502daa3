"""Under `redline submit`, an out of memory the ranks could not agree on in place is also recorded where the queue
looks: the queue requeues the job (tests/queue/test_daemon.py), and the next attempt resumes smaller."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from redline.env import REDLINE_QUEUE_RECORDS
from redline.runtime.checkpoint import Checkpointer
from redline.runtime.oom import OutOfMemoryDuringCollective, restart_smaller


def test_the_smaller_micro_batch_is_recorded_for_the_queue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = tmp_path / "records"
    records.mkdir()
    monkeypatch.setenv(REDLINE_QUEUE_RECORDS, str(records))
    checkpointer = Checkpointer(tmp_path / "ckpt")
    with pytest.raises(OutOfMemoryDuringCollective):
        restart_smaller(
            torch.OutOfMemoryError("CUDA out of memory"), checkpointer, step=3, rank=1, smaller=(4, 2), events=[]
        )
    assert json.loads((records / "oom.json").read_text()) == {
        "micro_batch": 4,
        "accumulation": 2,
        "checkpoint_dir": str(tmp_path / "ckpt"),
    }
    assert checkpointer.recorded_micro_batch() == (4, 2)  # where the next attempt's runtime reads it
