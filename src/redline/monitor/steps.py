"""Where a run's step metrics go when nobody names a file, so that ``redline monitor`` finds them.

The shipped examples write there (``prepare(..., metrics_path=DEFAULT_STEPS)``), and ``redline monitor``
without ``--steps`` follows it when a run in the working directory has written it. It lives here, below the
runtime, because both sides need it: the monitor may not import the runtime.
"""

from __future__ import annotations

import glob

DEFAULT_STEPS = "redline-steps/rank-{rank}.jsonl"  # relative to the working directory; one file per rank


def default_steps() -> list[str]:
    """``[DEFAULT_STEPS]`` when some rank's file is there, else nothing (no note about a run that is not)."""
    return [DEFAULT_STEPS] if glob.glob(DEFAULT_STEPS.replace("{rank}", "*")) else []
