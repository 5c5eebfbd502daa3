"""The Ray engine: a job spec handed to a Ray cluster through Ray's Job Submission API, the dashboard's REST API
that ``ray job submit`` uses, so the jobs show in ``ray job list`` and the dashboard like any other.

The module is ``ray_engine``, not ``ray``, so that nothing run from this folder imports it in place of Ray.
Ray is optional and imported only when a cluster is reached: rendering a job (``--dry-run``) needs no Ray.

How a job spec becomes a Ray job:

- The argv is the entrypoint, quoted with ``shlex.join`` and run by ``exec`` (Ray runs the entrypoint with
  ``/bin/sh -c``): the job's process is the program itself, so its exit code is its own, and a program killed
  by a signal reports ``-N`` (Python's convention, which Ray passes on) rather than the shell's ``128+N``.
- The working directory: by default the entrypoint starts with ``cd <cwd>``, so the job runs where its user
  stood, as the local queue and Slurm run it; the directory must exist on the cluster's nodes (a shared file
  system). ``upload_working_dir`` instead hands it to Ray as ``runtime_env["working_dir"]``: Ray packs the
  directory, uploads it to the cluster and runs the job in the unpacked copy, what Ray users do for a remote
  cluster without shared storage (Ray caps the upload's size).
- The environment captured at submit travels as ``runtime_env["env_vars"]``, less the variables that belong to
  the submitting shell or terminal, or that Ray sets itself (``NOT_CARRIED``); Ray sets them for the job's
  tasks and actors too. Ray expands ``$NAME`` and ``${NAME}`` in these values on the node (its way to append to
  a node's PATH), with no escape: a value that holds such a word literally arrives changed.
- GPUs: ``entrypoint_num_gpus`` whole devices. Ray reserves them for the entrypoint alone and sets
  ``CUDA_VISIBLE_DEVICES`` to them. A job with no GPUs asks for none, and then Ray leaves
  ``CUDA_VISIBLE_DEVICES`` unset: a Ray driver holds no GPU and its tasks and actors ask for theirs. Ray packs
  jobs on a GPU with fractional ``num_gpus``; a job spec asks whole devices, so it never does.
- GPU memory is not a Ray resource: Ray counts devices, not their bytes, and ``entrypoint_memory`` is host
  memory. A job's ``gpu_memory_bytes`` is recorded in the job's metadata, for the record, and whole devices
  leave the job all of theirs.
- ``exclusive`` is what whole devices are in Ray already: no other task is given them.
- What Ray's jobs cannot carry (several nodes for the entrypoint, priorities, dependencies, retries, a time
  limit, a queue) is refused in one line rather than dropped.

States: Ray's PENDING (waiting for the entrypoint's resources or its runtime environment) is ``queued``,
RUNNING ``running``, SUCCEEDED ``done``, FAILED ``failed`` (``lost`` when the node that ran it died), STOPPED
``cancelled``. Ray records one time before the end, when the job was submitted; it does not record when a job
left PENDING. A job Ray cannot place stays PENDING for 15 minutes (RAY_JOB_START_TIMEOUT_SECONDS on the head),
then fails.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

from redline.errors import BadInput, one_line
from redline.queue.engine import Engine
from redline.queue.spec import EngineJob, JobSpec, quoted

DEFAULT_ADDRESS = "http://127.0.0.1:8265"  # the dashboard of a head started with `ray start --head`
INSTALL = "pip install 'ray[default]'"
MARK = "redline"  # the metadata key on every job redline submits: jobs() lists these alone

NOT_CARRIED = frozenset(
    {
        # the submitting shell's own bookkeeping: the job has its own directory and shell depth
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
        # the submitting terminal or login session, gone or elsewhere when the job runs
        "SSH_AUTH_SOCK",
        "SSH_AGENT_PID",
        "SSH_CLIENT",
        "SSH_CONNECTION",
        "SSH_TTY",
        "DISPLAY",
        "XAUTHORITY",
        "DBUS_SESSION_BUS_ADDRESS",
        "XDG_RUNTIME_DIR",
        "XDG_SESSION_ID",
        "TMUX",
        "TMUX_PANE",
        "STY",
        "WINDOWID",
        # the devices the job sees are the ones Ray gives it, on its node
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        # where the submitter found the cluster: Ray points the job at its own
        "RAY_ADDRESS",
        "RAY_API_SERVER_ADDRESS",
    }
)

_STATES = {"PENDING": "queued", "RUNNING": "running", "SUCCEEDED": "done", "FAILED": "failed", "STOPPED": "cancelled"}


def resolve_address(address: str | None = None) -> str:
    """The cluster's address as Ray's job client will use it: RAY_API_SERVER_ADDRESS or RAY_ADDRESS when set
    (Ray's client lets them win over the address it is given, as ``ray.init`` does), else ``address``, else
    the dashboard of a local head. An ``http(s)://`` address is the dashboard's; a bare ``host:port`` is the
    head's GCS, which Ray asks for its dashboard."""
    return os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or address or DEFAULT_ADDRESS


def carried_env(env: Mapping[str, str]) -> dict[str, str]:
    """The captured environment less what does not travel to the cluster (``NOT_CARRIED``)."""
    return {k: v for k, v in env.items() if k not in NOT_CARRIED}


def entrypoint(spec: JobSpec, *, upload_working_dir: bool = False) -> str:
    """The shell line Ray runs: the argv, quoted, run by exec, after a ``cd`` into the job's directory unless
    Ray takes the directory itself (``upload_working_dir``)."""
    line = f"exec {quoted(spec.argv)}"
    if spec.cwd and not upload_working_dir:
        line = f"cd {quoted([spec.cwd])} && {line}"
    return line


def submission_id(spec: JobSpec) -> str:
    """A fresh id for the job: redline, the job's name (letters, digits, ``._-``) and 8 random hex digits."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", spec.label).strip("-.")[:40]
    return f"redline-{name}-{secrets.token_hex(4)}" if name else f"redline-{secrets.token_hex(4)}"


def submit_arguments(spec: JobSpec, job_id: str, *, upload_working_dir: bool = False) -> dict[str, Any]:
    """The keyword arguments of ``JobSubmissionClient.submit_job`` for ``spec``; BadInput, one line, naming
    what a Ray job cannot carry."""
    refused = [
        option
        for option, asked in (
            ("--nodes", spec.nodes > 1),
            ("--priority", spec.priority != 0),
            ("--after", bool(spec.after)),
            ("--retries", spec.retries > 0),
            ("--time-limit", spec.time_limit_s is not None),
            ("--queue", spec.queue is not None),
        )
        if asked
    ]
    if refused:
        raise BadInput(
            f"a Ray job cannot take {', '.join(refused)}: Ray runs a job's entrypoint once, on one node, as soon as "
            "its resources are free (spread work over nodes from the entrypoint, with Ray's tasks or Ray Train)"
        )
    if upload_working_dir and not spec.cwd:
        raise BadInput("uploading the working directory to Ray needs the job's directory (cwd)")
    runtime_env: dict[str, Any] = {"env_vars": carried_env(spec.env)}
    if upload_working_dir:
        runtime_env["working_dir"] = spec.cwd
    metadata = {MARK: "1", "name": spec.label}
    user = spec.env.get("USER") or spec.env.get("LOGNAME")
    if user:
        metadata["user"] = user
    if spec.gpu_memory_bytes is not None:
        metadata["gpu_memory_bytes"] = str(spec.gpu_memory_bytes)
    if spec.plan:
        metadata["plan"] = spec.plan
    arguments: dict[str, Any] = {
        "entrypoint": entrypoint(spec, upload_working_dir=upload_working_dir),
        "submission_id": job_id,
        "runtime_env": runtime_env,
        "metadata": metadata,
    }
    if spec.gpus:
        arguments["entrypoint_num_gpus"] = spec.gpus
    return arguments


def engine_job(job_id: str, info: Any) -> EngineJob:
    """One of Ray's job records (a JobInfo or JobDetails) as a row of `redline jobs`."""
    status = getattr(info.status, "value", info.status)
    state = _STATES.get(status, "lost")
    error_type = getattr(info.error_type, "value", info.error_type)
    if state == "failed" and error_type == "JOB_SUPERVISOR_ACTOR_DIED":
        state = "lost"  # the process that ran the job died with its node: no exit code to tell
    metadata = info.metadata or {}
    return EngineJob(
        engine="ray",
        id=job_id,
        name=metadata.get("name", ""),
        state=state,
        exit_code=info.driver_exit_code,
        reason=_reason(info.message or ""),
        user=metadata.get("user", ""),
        submitted_at=info.start_time / 1000 if info.start_time else None,
        started_at=None,  # Ray does not record when a job left PENDING
        ended_at=info.end_time / 1000 if info.end_time else None,
    )


def _reason(message: str) -> str:
    """Ray's message on a job, its first line: a failed job's message goes on with the tail of its log."""
    first = message.strip().split("\n", 1)[0]
    return first.split(", last available logs", 1)[0]


class RayEngine(Engine):
    """Jobs on a Ray cluster, reached at its dashboard's address (``resolve_address``)."""

    name = "ray"
    options = ("address",)

    def __init__(self, address: str | None = None, *, upload_working_dir: bool = False) -> None:
        self.address = resolve_address(address)
        self.upload_working_dir = upload_working_dir
        self._client: Any = None

    def render(self, spec: JobSpec) -> str:
        """What ``submit`` would hand Ray, as JSON: the arguments of ``submit_job`` (the submission id is drawn
        afresh at each submit). No Ray, no cluster needed: this is ``--dry-run``."""
        arguments = submit_arguments(spec, submission_id(spec), upload_working_dir=self.upload_working_dir)
        return json.dumps({"address": self.address, "submit_job": arguments}, indent=2, sort_keys=True)

    def submit(self, spec: JobSpec) -> str:
        """Submit the job; its Ray submission id."""
        arguments = submit_arguments(spec, submission_id(spec), upload_working_dir=self.upload_working_dir)
        return self._call("submit the job", lambda client: client.submit_job(**arguments))

    def status(self, ids: Iterable[str]) -> list[EngineJob]:
        """The jobs ``ids`` as Ray reports them; one Ray no longer knows (its head restarted without its
        records, or the job was deleted) is ``lost``."""
        rows = []
        for job_id in ids:
            info = self._call(f"read job {job_id}", lambda client, job_id=job_id: _job_info(client, job_id))
            if info is None:
                rows.append(EngineJob(engine="ray", id=job_id, name="", state="lost", reason="Ray has no such job"))
            else:
                rows.append(engine_job(job_id, info))
        return rows

    def cancel(self, job_id: str) -> bool:
        """Stop the job: Ray sends SIGTERM to its processes, and SIGKILL to those left a few seconds later. False
        when it had already ended. Ray cannot stop a job that has not started (ray-project/ray#58353): the stop
        waits for it, the job shows queued until its resources are free, then its program starts and is stopped
        at once; a job that never gets its resources fails at the cluster's start timeout."""
        if self._call(f"read job {job_id}", lambda client: _job_info(client, job_id)) is None:
            raise BadInput(f"the Ray cluster at {self.address} has no job {job_id}")
        return bool(self._call(f"stop job {job_id}", lambda client: client.stop_job(job_id)))

    def jobs(self) -> list[EngineJob]:
        """The jobs redline submitted to the cluster (marked in their metadata), oldest first; the cluster's
        other jobs are left out."""
        details = self._call("list its jobs", lambda client: client.list_jobs())
        mine = [d for d in details if (d.metadata or {}).get(MARK) == "1" and d.submission_id]
        return [engine_job(d.submission_id, d) for d in sorted(mine, key=lambda d: d.start_time or 0)]

    def _call(self, what: str, call: Any) -> Any:
        """``call(client)``, with Ray's errors (the cluster gone, a request refused) as one line."""
        client = self._connect()
        try:
            return call(client)
        except (OSError, RuntimeError, ValueError) as exc:  # requests' errors are OSErrors
            raise BadInput(f"the Ray cluster at {self.address} could not {what}: {_first_line(exc)}") from None

    def _connect(self) -> Any:
        """Ray's job client, connected (it checks the cluster's Ray version on connecting)."""
        if self._client is None:
            client_class = _job_submission_client()
            try:
                self._client = client_class(self.address)
            except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError or its own RpcError
                if "ray[default]" in str(exc):  # ray without its [default] extra: no HTTP client for the jobs API
                    raise BadInput(f"the Ray engine needs Ray's job client: {INSTALL}") from None
                raise BadInput(
                    f"cannot reach a Ray cluster at {self.address} ({_first_line(exc)}): start one with "
                    "`ray start --head`, or give its dashboard address (RAY_ADDRESS=http://HEAD:8265)"
                ) from None
        return self._client


def _job_info(client: Any, job_id: str) -> Any:
    """Ray's record of the job; None when Ray has none (Ray answers a 404 with a RuntimeError)."""
    try:
        return client.get_job_info(job_id)
    except RuntimeError as exc:
        if "404" in str(exc) or "does not exist" in str(exc):
            return None
        raise


def _job_submission_client() -> Any:
    """Ray's JobSubmissionClient class; BadInput, one line, when Ray or its job client is not installed."""
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise BadInput(f"the Ray engine needs Ray's job client: {INSTALL}") from None
    return JobSubmissionClient


def _first_line(exc: BaseException) -> str:
    """Ray's error as one line without its closing full stop: it is followed by more of the sentence."""
    return one_line(exc, typed=False).rstrip(".")
