"""The Slurm engine: a job spec as an sbatch script, submitted, watched and cancelled with Slurm's own commands.

Past one server the cluster's scheduler places the job, not redline: ``render`` turns a ``JobSpec`` into the batch
script (``#SBATCH`` lines for the name, nodes, GPUs, time limit, partition, working directory and log), ``submit``
hands it to ``sbatch --parsable`` on stdin, ``status`` and ``jobs`` read ``squeue --json`` for the jobs the
controller still holds (running ones, and finished ones for ``MinJobAge``, 300 s by default) and ``sacct`` for older
ones where the cluster keeps accounting, ``cancel`` is ``scancel``.

The environment travels as Slurm's ``--export=ALL`` does: sbatch runs with the variables captured at submit time,
and the job gets them. A job on several nodes with GPUs runs as one torchrun per node under ``srun``, meeting at a
c10d rendezvous on the first node (the pattern of PyTorch's and torchtitan's multi-node Slurm scripts).
"""

from __future__ import annotations

import json
import math
import os
import pwd
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from redline.env import REDLINE_PLAN
from redline.errors import BadInput, RedlineError
from redline.queue.engine import Engine
from redline.queue.spec import FINAL_STATES, EngineJob, JobSpec, quoted

ENGINE = "slurm"
RDZV_PORT = 29500  # torchrun's c10d rendezvous on the job's first node
DEFAULT_OUTPUT = "redline-%x-%j.log"  # in the job's working directory: %x is the job name, %j its id
COMMAND_TIMEOUT_S = 120.0  # a Slurm command that has not answered by then is stuck on an unreachable controller

# Slurm's job states (squeue's and sacct's words) as the queue's STATES. A state Slurm adds later reads as "running"
# while the job is live and "lost" once it has ended (see _state).
QUEUED = {"PENDING", "REQUEUED", "REQUEUE_FED", "CONFIGURING", "POWER_UP_NODE"}
HELD = {"REQUEUE_HOLD", "SPECIAL_EXIT", "RESV_DEL_HOLD", "SUSPENDED", "STOPPED"}
RUNNING = {"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING", "UPDATE_DB"}
DONE = {"COMPLETED"}
FAILED = {"FAILED", "TIMEOUT", "OUT_OF_MEMORY", "DEADLINE"}
CANCELLED = {"CANCELLED"}
LOST = {"NODE_FAIL", "BOOT_FAIL", "PREEMPTED", "REVOKED"}  # ended by the cluster, not by the job
HELD_REASONS = {"JobHeldUser", "JobHeldAdmin"}  # a pending job that waits for `scontrol release`
# states whose name says why the job ended, kept in the reason beside Slurm's own reason
TELLING = {"TIMEOUT", "OUT_OF_MEMORY", "DEADLINE", "NODE_FAIL", "BOOT_FAIL", "PREEMPTED", "REVOKED"} | HELD


def require_slurm(command: str = "sbatch") -> str:
    """The path of one of Slurm's client commands; a one-line BadInput when it is not on PATH."""
    path = shutil.which(command)
    if path is None:
        raise BadInput(
            f"the Slurm engine needs Slurm's {command}, which is not on PATH: run it on a Slurm login node "
            "(or install the client: apt install slurm-client), or submit with the embedded queue"
        )
    return path


# ---- the batch script ---------------------------------------------------------------------------------------


def slurm_time(seconds: float) -> str:
    """A time limit in Slurm's ``D-HH:MM:SS``, whole seconds rounded up. Slurm keeps whole minutes: it rounds up
    again, so a 90 s limit stops the job after 2 minutes."""
    total = math.ceil(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"


def _directive(option: str, value: object = None) -> str:
    """One ``#SBATCH`` line. sbatch splits these lines on blanks and honours double quotes, so a value with a
    blank is quoted; one with a double quote or a line break cannot be written and is refused."""
    if value is None:
        return f"#SBATCH --{option}"
    text = str(value)
    if '"' in text or "\n" in text or "\r" in text:
        raise BadInput(f"a Slurm job's --{option} cannot hold a double quote or a line break: {text!r}")
    if not text or any(ch.isspace() for ch in text):
        text = f'"{text}"'
    return f"#SBATCH --{option}={text}"


def _launch(spec: JobSpec) -> list[str]:
    """The script's last lines: what runs the job's argv on its nodes.

    One node: the argv itself, exec'd, so its exit status is the job's. Several nodes: one task per node under
    srun; with GPUs, a torchrun per node (``--nproc-per-node`` the job's GPUs) whose workers meet at a c10d
    rendezvous on the first node's address. An argv that is already torchrun keeps its own options, which come
    after these and so win; any other argv runs under ``torchrun --no-python``, which starts it as given (a
    ``python train.py`` stays one) with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set."""
    argv = list(spec.argv)
    if spec.nodes == 1:
        return [f"exec {quoted(argv)}"]
    if spec.gpus == 0:
        return [f"exec srun {quoted(argv)}"]
    # the script's own variables, double-quoted so bash expands them; the argv's words are all quoted literally
    rendezvous = (
        f'--nnodes "$SLURM_NNODES" --nproc-per-node {spec.gpus} --rdzv-id "$SLURM_JOB_ID" '
        f'--rdzv-backend c10d --rdzv-endpoint "$head_addr:{RDZV_PORT}"'
    )
    if Path(argv[0]).name == "torchrun":
        command = f"{quoted(argv[:1])} {rendezvous} {quoted(argv[1:])}".rstrip()
    else:
        command = f"torchrun {rendezvous} --no-python {quoted(argv)}"
    return [
        "# the first node hosts the rendezvous; its address as that node reports it",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "head_addr=$(srun --nodes=1 --ntasks=1 -w \"$head\" hostname --ip-address | awk '{print $1}')",
        f"exec srun {command}",
    ]


def render(spec: JobSpec, output: str | None = None) -> str:
    """The sbatch script for ``spec``: ``#SBATCH`` lines, then the argv (quoted with shlex, never a shell line).

    ``output`` is the job's log (stdout and stderr together), relative to its working directory; Slurm fills
    in ``%j`` (the job id) and ``%x`` (its name). Per-GPU memory has no Slurm request (GPUs are whole devices,
    never shared between jobs, so ``exclusive`` holds already); ``priority`` P becomes ``--nice=-P`` (a higher
    priority is a lower nice value; sbatch takes one below 0 from operators only); ``retries`` above 0 lets Slurm
    requeue the job after a node failure or preemption (Slurm does not count them); ``after`` waits for those jobs
    to end well; ``plan`` reaches the job as REDLINE_PLAN, an absolute path, as `redline run` hands it."""
    lines = ["#!/bin/bash", _directive("job-name", spec.label), _directive("nodes", spec.nodes)]
    if spec.nodes > 1:
        lines.append(_directive("ntasks-per-node", 1))
    if spec.gpus:
        lines.append(_directive("gres", f"gpu:{spec.gpus}"))  # per node
    if spec.time_limit_s is not None:
        lines.append(_directive("time", slurm_time(spec.time_limit_s)))
    if spec.queue:
        lines.append(_directive("partition", spec.queue))
    if spec.cwd:
        lines.append(_directive("chdir", spec.cwd))
    lines.append(_directive("output", output or DEFAULT_OUTPUT))
    lines.append(_directive("export", "ALL"))
    if spec.after:
        lines.append(_directive("dependency", "afterok:" + ":".join(spec.after)))
    if spec.priority:
        lines.append(_directive("nice", -spec.priority))
    lines.append(_directive("requeue" if spec.retries else "no-requeue"))
    if spec.plan:
        plan = Path(spec.cwd or ".", spec.plan) if not Path(spec.plan).is_absolute() else Path(spec.plan)
        lines.append(f"export {REDLINE_PLAN}={quoted([str(plan.absolute())])}")
    lines.extend(_launch(spec))
    return "\n".join(lines) + "\n"


# ---- running Slurm's commands -------------------------------------------------------------------------------


def _error_lines(text: str, command: str) -> str:
    """A command's stderr as one line, without the ``sbatch: error:`` prefixes."""
    lines = [re.sub(rf"^{re.escape(command)}: (error|fatal): ", "", line.strip()) for line in text.splitlines()]
    return "; ".join(line for line in lines if line) or "no message"


def _run(
    argv: Sequence[str], *, stdin: str | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run one of Slurm's commands, found on PATH; a one-line RedlineError when it hangs."""
    command = argv[0]
    try:
        return subprocess.run(
            [require_slurm(command), *argv[1:]],
            input=stdin,
            stdin=subprocess.DEVNULL if stdin is None else None,
            capture_output=True,
            text=True,
            env=None if env is None else dict(env),
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RedlineError(
            f"Slurm's {command} did not answer within {COMMAND_TIMEOUT_S:.0f} s: is slurmctld reachable?"
        ) from None


def _checked(argv: Sequence[str], **kwargs: Any) -> str:
    """A Slurm command's stdout; a one-line RedlineError with its stderr when it fails."""
    result = _run(argv, **kwargs)
    if result.returncode != 0:
        raise RedlineError(f"{' '.join(argv[:2])} failed: {_error_lines(result.stderr, argv[0])}")
    return result.stdout


def _submit_env(spec: JobSpec) -> dict[str, str]:
    """sbatch's environment, which ``--export=ALL`` hands to the job: the captured one (or this process's when
    none was captured), with the Slurm configuration this process uses when the captured one names none."""
    if not spec.env:
        return dict(os.environ)
    env = dict(spec.env)
    if "SLURM_CONF" in os.environ:
        env.setdefault("SLURM_CONF", os.environ["SLURM_CONF"])
    return env


def submit(spec: JobSpec, output: str | None = None) -> str:
    """Submit ``spec`` with ``sbatch --parsable`` (the script on stdin) and return Slurm's job id; what sbatch
    refuses (an unknown partition, more GPUs than a node has) is a one-line BadInput."""
    script = render(spec, output)
    result = _run(["sbatch", "--parsable"], stdin=script, env=_submit_env(spec))
    if result.returncode != 0:
        raise BadInput(f"sbatch refused the job: {_error_lines(result.stderr, 'sbatch')}")
    job_id = result.stdout.strip().split(";", 1)[0]  # "id" or, on a federation, "id;cluster"
    if not job_id.isdigit():
        answer = result.stdout.strip() or _error_lines(result.stderr, "sbatch")
        raise RedlineError(f"sbatch answered no job id: {answer}")
    return job_id


def cancel(job_id: str) -> None:
    """Cancel a job (``scancel``). scancel says nothing about an id it does not know, so the id is looked up first:
    an unknown one is a one-line BadInput. Cancelling a job that has ended already does nothing."""
    job_id = str(job_id)
    if job_id not in _known([job_id]):
        raise BadInput(f"no Slurm job {job_id}")
    _checked(["scancel", job_id])


# ---- reading Slurm's answers --------------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    """A number from Slurm's JSON: plain in Slurm 22.05, ``{"set", "infinite", "number"}`` from 23.02 on."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _epoch(value: Any) -> float | None:
    """A time from Slurm's JSON (seconds since the epoch); 0 and unset are None."""
    number = _number(value)
    return float(number) if number else None


def _exit_code(value: Any) -> int | None:
    """The job's exit status, 128+N when signal N ended it. Slurm 22.05 gives the raw wait status; 23.02 on
    gives ``{"status", "return_code", "signal": {"id"}}``."""
    if isinstance(value, dict):
        signal = _number((value.get("signal") or {}).get("id"))
        if signal:
            return 128 + int(signal)
        code = _number(value.get("return_code"))
        return None if code is None else int(code)
    raw = _number(value)
    if raw is None:
        return None
    raw = int(raw)
    return 128 + (raw & 0x7F) if raw & 0x7F else raw >> 8


def _state(slurm_states: Iterable[str], slurm_reason: str) -> tuple[str, str]:
    """The queue's state and the reason in Slurm's words, from the job's Slurm states (one word up to 22.05, a
    list from 23.11 on: the base state, then flags such as COMPLETING) and its reason."""
    words = [word.upper() for word in slurm_states if word]
    base = next((word for word in words if word not in {"COMPLETING", "REQUEUED", "UPDATE_DB"}), "")
    base = base or (words[0] if words else "")
    reason = "" if slurm_reason in ("", "None", "(null)") else slurm_reason
    why = ", ".join(part for part in (base if base in TELLING else "", reason) if part)
    if base == "PENDING" and reason in HELD_REASONS:
        return "held", why
    for states, state in (
        (QUEUED, "queued"),
        (HELD, "held"),
        (RUNNING, "running"),
        (DONE, "done"),
        (FAILED, "failed"),
        (CANCELLED, "cancelled"),
        (LOST, "lost"),
    ):
        if base in states:
            return state, why
    return "lost", ", ".join(part for part in (base or "no state", reason) if part)


def _job_id(job: Mapping[str, Any]) -> str:
    """An array task reads ``ARRAYID_TASK``, as squeue prints it; any other job its plain id."""
    task = _number(job.get("array_task_id"))
    array = _number(job.get("array_job_id"))
    if task is not None and array:
        return f"{int(array)}_{int(task)}"
    return str(int(_number(job.get("job_id")) or 0))


def parse_squeue_json(text: str) -> dict[str, EngineJob]:
    """Jobs from ``squeue --json`` (Slurm 21.08 on): every job the controller holds, whatever filter was given
    (Slurm 22.05 ignores ``-j`` and ``-u`` with ``--json``), keyed by id."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RedlineError(f"squeue --json answered something that is not JSON: {exc}") from None
    errors = [e.get("error") or e.get("description") or str(e) for e in data.get("errors") or []]
    if errors:
        raise RedlineError(f"squeue --json failed: {'; '.join(map(str, errors))}")
    jobs = {}
    for job in data.get("jobs") or []:
        raw_state = job.get("job_state") or []
        words = [raw_state] if isinstance(raw_state, str) else raw_state
        state, reason = _state(words, job.get("state_reason") or "")
        ended = state in FINAL_STATES
        started = _epoch(job.get("start_time")) if state not in ("queued", "held") else None  # else: an estimate
        jobs[_job_id(job)] = EngineJob(
            engine=ENGINE,
            id=_job_id(job),
            name=job.get("name") or "",
            state=state,
            exit_code=_exit_code(job.get("exit_code")) if ended else None,
            reason=reason,
            user=job.get("user_name") or "",
            submitted_at=_epoch(job.get("submit_time")),
            started_at=started,
            ended_at=_epoch(job.get("end_time")) if ended else None,
        )
    return jobs


def _local_time(text: str) -> float | None:
    """A time as scontrol and sacct print it (``2026-12-04T21:18:17``, local time); Unknown, None, N/A are None."""
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def _colon_exit_code(text: str) -> int | None:
    """scontrol's and sacct's ``CODE:SIGNAL`` exit code, 128+SIGNAL when a signal ended the job."""
    code, _, signal = text.partition(":")
    if not code.isdigit():
        return None
    return 128 + int(signal) if signal.isdigit() and int(signal) else int(code)


def _row(fields: Mapping[str, str], state_words: list[str], reason: str) -> EngineJob:
    """One job from scontrol's or sacct's fields (JobId, JobName, ExitCode, the times, the user)."""
    state, why = _state(state_words, reason)
    ended = state in FINAL_STATES
    started = None if state in ("queued", "held") else _local_time(fields.get("StartTime") or fields.get("Start", ""))
    user = fields.get("UserId") or fields.get("User") or ""
    return EngineJob(
        engine=ENGINE,
        id=fields.get("JobId") or fields.get("JobID") or "",
        name=fields.get("JobName") or "",
        state=state,
        exit_code=_colon_exit_code(fields.get("ExitCode", "")) if ended else None,
        reason=why,
        user=user.split("(", 1)[0],
        submitted_at=_local_time(fields.get("SubmitTime") or fields.get("Submit", "")),
        started_at=started,
        ended_at=_local_time(fields.get("EndTime") or fields.get("End", "")) if ended else None,
    )


def parse_scontrol_jobs(text: str) -> dict[str, EngineJob]:
    """Jobs from ``scontrol show job --oneliner``, the fallback where squeue has no ``--json`` (Slurm before
    21.08, or a build without its JSON plugin): one line of ``Key=Value`` fields per job, the ones still held
    by the controller. A value may hold blanks (a job name does), so a field starts only where ``Key=`` does."""
    jobs = {}
    for line in text.splitlines():
        if not line.startswith("JobId="):
            continue
        parts = re.split(r"(?:^|\s)([A-Za-z][\w/:]*)=", line)
        fields = {key: value.strip() for key, value in zip(parts[1::2], parts[2::2], strict=True)}
        job = _row(fields, [fields.get("JobState", "")], fields.get("Reason", ""))
        jobs[job.id] = job
    return jobs


SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "User", "Submit", "Start", "End")


def parse_sacct(text: str) -> dict[str, EngineJob]:
    """Jobs from ``sacct -P -n --format=`` SACCT_FIELDS: ``|``-separated, a job's line, then its steps'
    (``12.batch``, ``12.0``). sacct's state may carry who cancelled (``CANCELLED by 1000``): the first word is the
    state. A cancelled job's own line says ``0:0``; its batch step has the signal that ended the script, which is
    the job's exit code as squeue gives it. A job that ended moments ago may still be named ``allocation`` there
    (slurmdbd's name for a job whose start it recorded without one); by the time the controller has forgotten it,
    it has its name."""
    jobs: dict[str, EngineJob] = {}
    batch_codes: dict[str, int | None] = {}
    for line in text.splitlines():
        values = line.split("|")
        if len(values) != len(SACCT_FIELDS):
            continue
        fields = dict(zip(SACCT_FIELDS, values, strict=True))
        job_id, _, step = fields["JobID"].partition(".")
        if step == "batch":
            batch_codes[job_id] = _colon_exit_code(fields["ExitCode"])
        elif not step:
            jobs[job_id] = _row(fields, [fields["State"].split(" ", 1)[0]], "")
    for job_id, job in jobs.items():
        if job.state == "cancelled" and not job.exit_code and batch_codes.get(job_id):
            jobs[job_id] = replace(job, exit_code=batch_codes[job_id])
    return jobs


def _live_jobs(ids: Sequence[str] = (), user: str | None = None) -> dict[str, EngineJob]:
    """The jobs the controller holds (live ones, and ended ones for MinJobAge): all of them, or those asked for.

    The selection (``--jobs``, ``--user``) spares a large cluster's controller a dump of every job where squeue
    honours it with ``--json``; Slurm 22.05 does not, so the callers pick their jobs out of the answer anyway.
    Where squeue refuses the selection (an id it does not know), it is asked for everything."""
    selection = [f"--jobs={','.join(ids)}"] if ids else [f"--user={user}"] if user else []
    for argv in (["squeue", "--json", *selection], ["squeue", "--json"])[: 2 if selection else 1]:
        result = _run(argv)
        if result.returncode == 0:
            return parse_squeue_json(result.stdout)
    # no --json here (Slurm before 21.08, or no JSON plugin): scontrol's one-line form, which has exit codes
    return parse_scontrol_jobs(_checked(["scontrol", "show", "job", "--oneliner"]))


def _accounted_jobs(*, ids: Sequence[str] = (), user: str | None = None) -> dict[str, EngineJob]:
    """Ended jobs from Slurm's accounting (``sacct``): ``ids``, or ``user``'s since midnight. Empty where the
    cluster keeps no accounting (no slurmdbd) or sacct is not installed."""
    if shutil.which("sacct") is None:
        return {}
    selection = ["-j", ",".join(ids)] if ids else ["-u", user or ""]
    result = _run(["sacct", "-P", "-n", f"--format={','.join(SACCT_FIELDS)}", *selection])
    return parse_sacct(result.stdout) if result.returncode == 0 else {}


def _known(ids: Sequence[str]) -> dict[str, EngineJob]:
    """Those of ``ids`` the controller holds, and those of the rest that accounting has."""
    found = {job_id: job for job_id, job in _live_jobs(ids=ids).items() if job_id in ids}
    missing = [job_id for job_id in ids if job_id not in found]
    if missing:
        found |= {job_id: job for job_id, job in _accounted_jobs(ids=missing).items() if job_id in missing}
    return found


def status(ids: Sequence[str]) -> dict[str, EngineJob]:
    """Each job's state, keyed by id: from the controller while it holds the job, else from accounting. A job
    neither knows (ended longer than MinJobAge ago on a cluster without accounting, or never submitted) is
    ``lost``, with no name, and says why."""
    wanted = [str(job_id) for job_id in ids]
    found = _known(wanted)
    unknown = "Slurm no longer knows this job: it ended before the controller's MinJobAge and sacct has no record"
    return {
        job_id: found.get(job_id) or EngineJob(engine=ENGINE, id=job_id, name="", state="lost", reason=unknown)
        for job_id in wanted
    }


def _me() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def jobs(user: str | None = None) -> list[EngineJob]:
    """The user's jobs (this process's user by default), for `redline jobs`: those the controller holds, and those
    accounting has since midnight; newest first."""
    user = user or _me()
    mine = {job_id: job for job_id, job in _live_jobs(user=user).items() if job.user == user}
    mine = _accounted_jobs(user=user) | mine  # the controller's view is the fresher one
    return sorted(mine.values(), key=lambda job: (job.submitted_at or 0, job.id), reverse=True)


class Slurm(Engine):
    """This machine's Slurm cluster, as its user: ``sbatch``, ``squeue``/``scontrol``/``sacct`` and ``scancel``."""

    name = ENGINE

    def render(self, spec: JobSpec) -> str:
        return render(spec)

    def submit(self, spec: JobSpec) -> str:
        return submit(spec)

    def jobs(self) -> list[EngineJob]:
        return jobs()

    def cancel(self, job_id: str) -> None:
        cancel(job_id)
