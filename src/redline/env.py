"""Every environment variable redline reads or sets, by name, each with what it means; and the one rule, read
from them, for where redline keeps what it keeps between commands (``state_dir``).

Each constant is named as its variable is. The product names a variable through these constants, never as a
string literal, so that this file lists them all and a misspelt name fails at import instead of reading an
unset variable (``tests/test_env.py`` keeps literals out of the rest of ``src/``). Tests may set the variables
by their literal names.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

# ---------------------------------------------------------------------------------------------- a user sets

# redline's data folder, which holds everything redline keeps (see State): bench results per machine, the stage
# cache, the push journals, tune's journals, the job queue; default $XDG_DATA_HOME/redline
# (~/.local/share/redline), the queue then the machine's where its daemon runs
REDLINE_HOME = "REDLINE_HOME"
# set to anything: an unexpected error is raised with its traceback (the CLI, a rank's script, torchrun's
# failure table) instead of being told in one line
REDLINE_DEBUG = "REDLINE_DEBUG"
# the folder of `redline tune`'s journals, over the data folder's (REDLINE_HOME/tune)
REDLINE_TUNE_CACHE = "REDLINE_TUNE_CACHE"
# the job queue's folder, over the rule of state_dir(State.QUEUE): a queue of one's own, or another's
REDLINE_QUEUE_DIR = "REDLINE_QUEUE_DIR"

# ------------------------------------------------------------------------------------ redline sets for a job

# the plan file, an absolute path, that the training script's prepare() applies: set by `redline run` (which
# also reads it as its --plan default) and by the queue for a job submitted with a plan
REDLINE_PLAN = "REDLINE_PLAN"
# the runtime settings of `redline run`'s options, a JSON object {prepare() keyword: value} that prepare()
# lays over the plan's runtime: section and its own keywords
REDLINE_RUNTIME = "REDLINE_RUNTIME"
# the queue's id of the job (its key), set in the job's environment by the queue's daemon
REDLINE_JOB_ID = "REDLINE_JOB_ID"
# the folder, one per attempt, where a queued job's runtime leaves records for the queue: the daemon sets it,
# the runtime writes QUEUE_OOM_RECORD there after an out-of-memory, and the daemon requeues the job with it
REDLINE_QUEUE_RECORDS = "REDLINE_QUEUE_RECORDS"
# the name of that out-of-memory record in $REDLINE_QUEUE_RECORDS (a file name, not a variable: the runtime
# and the queue agree on it here, beside the variable that names its folder)
QUEUE_OOM_RECORD = "oom.json"

# -------------------------------------------------------------------------------------------- test hooks

# "STEP:RANK[:MICRO]": raise an out-of-memory error at that optimizer step, on that rank, in that micro-batch
# (0 by default), once, in the first launch attempt only (runtime/oom.py)
REDLINE_TEST_OOM_AT = "REDLINE_TEST_OOM_AT"
# seconds each rank sleeps inside a checkpoint save after writing its files, before the save is complete, so a
# test can kill a process mid-save; unset (or 0) in real runs (runtime/checkpoint.py)
REDLINE_TEST_SLOW_SAVE_S = "REDLINE_TEST_SLOW_SAVE_S"

# ---------------------------------------------------------------------------------------- where state lives

# the machine's queue: root's daemon (the systemd unit `redline queue unit` prints) runs every user's jobs
# from it, each as its user
MACHINE_QUEUE = Path("/var/lib/redline/queue")


class State(enum.Enum):
    """What redline keeps between commands, each a folder under the data home (its value, the folder's path
    there)."""

    BENCH = "bench"  # `redline bench --save`'s results, per machine
    STAGE = "cache"  # the stage cache (`redline stage`, the Staged reader)
    PUSH = "transfer/push"  # the journals that resume a cut `redline push`
    TUNE = "tune"  # `redline tune`'s journals: a killed tune goes on, a tune run again is instant
    QUEUE = "queue"  # the job queue's database, socket, logs and daemon


# the variables that name one part's folder outright, over the data home's rule
_OVERRIDES = {State.TUNE: REDLINE_TUNE_CACHE, State.QUEUE: REDLINE_QUEUE_DIR}


def data_home() -> Path:
    """``$REDLINE_HOME``, else ``$XDG_DATA_HOME/redline`` (``~/.local/share/redline``)."""
    if os.environ.get(REDLINE_HOME):
        return Path(os.environ[REDLINE_HOME])
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "redline"


def state_dir(part: State) -> Path:
    """The folder where redline keeps ``part``: every part asks here, so that one rule places them all.

    A variable that names the part's folder outright (``$REDLINE_TUNE_CACHE``, ``$REDLINE_QUEUE_DIR``) wins.
    Then ``$REDLINE_HOME`` holds every part, the queue included, so a test, a CI job or a second setup set
    there is whole and apart from the rest. Without it the queue is the machine's (``MACHINE_QUEUE``) for
    root, who runs it, and for everyone where its daemon runs (its socket is there): jobs on a shared server
    go through the one queue that sees every GPU; everything else is under the user's own data home."""
    override = _OVERRIDES.get(part)
    if override is not None and os.environ.get(override):
        return Path(os.environ[override])
    if part is State.QUEUE and not os.environ.get(REDLINE_HOME) and _machine_queue_serves():
        return MACHINE_QUEUE
    return data_home() / part.value


def _machine_queue_serves() -> bool:
    """Whether this process uses the machine's queue: root's own, or one whose daemon has its socket open."""
    return os.geteuid() == 0 or (MACHINE_QUEUE / "queue.sock").exists()
