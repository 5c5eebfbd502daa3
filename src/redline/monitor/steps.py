"""Where a run's step metrics go when nobody names a file, and where ``redline monitor`` looks for them.

The shipped examples write there (``prepare(..., metrics_path=DEFAULT_STEPS)``), and ``redline monitor``
without ``--steps`` watches it, whether or not a run has written it yet: a monitor is often started first,
and the run's files that appear later are picked up (``sampler.StepTail`` expands the patterns on every
sample, as ``tail -F`` follows a name). It lives here, below the runtime, because both sides need it: the
monitor may not import the runtime.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

DEFAULT_STEPS = "redline-steps/rank-{rank}.jsonl"  # relative to the working directory; one file per rank


def step_patterns(given: Sequence[str]) -> list[str]:
    """The step files to watch: the ``--steps`` patterns ``given``, else the examples' ``DEFAULT_STEPS``;
    made absolute against the working directory now, so that what the monitor says it watches is a path a
    user can compare with the run's."""
    return [os.path.abspath(os.path.expanduser(pattern)) for pattern in given or [DEFAULT_STEPS]]


def watch_note(patterns: Sequence[str]) -> str:
    """The sentence the monitor says once at start: which files it follows, and how many are there yet."""
    found = {path for pattern in patterns for path in glob.glob(pattern.replace("{rank}", "*"))}
    where = ", ".join(patterns)
    if not found:
        return f"watching for step files at {where}: none yet; a run that writes them later shows up"
    return f"watching for step files at {where}: {len(found)} there now, and any a run writes later"
