"""Every environment variable redline reads or sets, by name, each with what it means.

Each constant is named as its variable is. The product names a variable through these constants, never as a
string literal, so that this file lists them all and a misspelt name fails at import instead of reading an
unset variable (``tests/test_env.py`` keeps literals out of the rest of ``src/``). Tests may set the variables
by their literal names.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------- a user sets

# redline's data folder (bench results per machine, the stage cache, the push journals); default
# $XDG_DATA_HOME/redline (~/.local/share/redline)
REDLINE_HOME = "REDLINE_HOME"
# set to anything: an unexpected error is raised with its traceback (the CLI, a rank's script, torchrun's
# failure table) instead of being told in one line
REDLINE_DEBUG = "REDLINE_DEBUG"
# the folder of `redline tune`'s journals; default $XDG_CACHE_HOME/redline/tune (~/.cache/redline/tune)
REDLINE_TUNE_CACHE = "REDLINE_TUNE_CACHE"
# the job queue's folder (a queue of one's own); default the machine's, /var/lib/redline/queue, for root or
# where it runs, else $XDG_DATA_HOME/redline/queue
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
