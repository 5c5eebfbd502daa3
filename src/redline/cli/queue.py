"""`redline submit`, `redline jobs`, `redline cancel | hold | release`, `redline logs` and `redline queue`: share
this machine's GPUs between jobs and people through the queue's daemon (started on first use)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from redline.cli import ui
from redline.cli.params import parsed
from redline.errors import BadInput

if TYPE_CHECKING:
    from rich.table import Table

    from redline.queue.spec import EngineJob, JobSpec

app = typer.Typer(help="The machine's job queue: its GPUs and jobs, and its daemon.", no_args_is_help=True)

PLAN_MARGIN = 0.10  # a plan's predicted peak plus this share is what its job reserves on each GPU


def submit(
    ctx: typer.Context,
    command: str = typer.Argument(..., metavar="-- COMMAND [ARGS]...", help="The job: a program and its arguments."),
    gpus: int | None = typer.Option(None, "--gpus", help="GPUs the job needs (default 0, or the plan's)."),
    gpu_memory: str | None = typer.Option(
        None,
        "--gpu-memory",
        help="Memory per GPU it needs (20G): jobs share a GPU while they fit. Default: whole GPUs.",
    ),
    plan: Path | None = typer.Option(
        None, "--plan", help="A redline plan file: its GPUs, its predicted peak (+10%) per GPU; the job runs with it."
    ),
    exclusive: bool = typer.Option(False, "--exclusive", help="No other job on its GPUs."),
    priority: int = typer.Option(0, "--priority", help="Higher starts first (waiting jobs gain 1 per 10 minutes)."),
    after: list[str] = typer.Option([], "--after", help="Start only after this job ended well (repeatable)."),
    retries: int = typer.Option(0, "--retries", help="Restarts after a preemption-class end (signal, OOM record)."),
    time_limit: str | None = typer.Option(None, "--time-limit", help="Stop the job after this long (90m, 12h)."),
    name: str = typer.Option("", "--name", help="A name for `redline jobs`."),
    hold: bool = typer.Option(False, "--hold", help="Queue it held: it starts after `redline release`."),
    share_logs: bool = typer.Option(False, "--share-logs", help="Other users may read its log."),
    engine: str = typer.Option(
        "local",
        "--engine",
        help="local (this machine's queue), slurm, ray or kubernetes: the same job past one server.",
    ),
    nodes: int = typer.Option(1, "--nodes", help="Slurm or Kubernetes: nodes, each with --gpus GPUs."),
    queue: str | None = typer.Option(None, "--queue", help="A Slurm partition, or a Kueue LocalQueue."),
    image: str | None = typer.Option(None, "--image", help="Kubernetes: the container image the job runs in."),
    kind: str | None = typer.Option(None, "--kind", help="Kubernetes: job, trainjob or pytorchjob (default by nodes)."),
    namespace: str = typer.Option("default", "--namespace", help="Kubernetes: the namespace."),
    address: str | None = typer.Option(None, "--address", help="Ray: the dashboard address (default $RAY_ADDRESS)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be submitted (a script, JSON, YAML)."),
    json_output: bool = typer.Option(False, "--json", help="The queued job as JSON."),
) -> None:
    """Queue a job: it starts when GPUs with room for it are free, as the user who submitted it; or hand it to
    Slurm, Ray or Kubernetes."""
    from redline.queue.spec import JobSpec
    from redline.units import parse_bytes, parse_duration

    memory = parsed(parse_bytes, "--gpu-memory", gpu_memory)
    limit = parsed(parse_duration, "--time-limit", time_limit)
    if plan is not None:
        plan_gpus, plan_memory = _plan_needs(plan)
        gpus = plan_gpus if gpus is None else gpus
        memory = plan_memory if memory is None else memory
    spec = JobSpec(
        argv=(command, *ctx.args),
        name=name,
        gpus=gpus or 0,
        gpu_memory_bytes=memory,
        exclusive=exclusive,
        priority=priority,
        after=tuple(after),
        retries=retries,
        time_limit_s=limit,
        cwd=os.getcwd(),
        env=dict(os.environ),
        umask=_umask(),
        plan=str(plan.resolve()) if plan is not None else None,
        nodes=nodes,
        queue=queue,
    )
    if engine != "local":
        _submit_elsewhere(
            spec, engine, dry_run, json_output, image=image, kind=kind, namespace=namespace, address=address
        )
        return
    if nodes > 1 or queue is not None:
        raise BadInput(
            "the local queue runs jobs on this machine: --nodes and --queue go with --engine slurm|kubernetes"
        )
    _submit_here(spec, dry_run, json_output, hold=hold, share_logs=share_logs)


def _submit_here(spec: JobSpec, dry_run: bool, json_output: bool, *, hold: bool, share_logs: bool) -> None:
    """Queue ``spec`` on this machine's queue (or print what would be queued), and say which queue that is."""
    from redline.queue.client import request

    if dry_run:
        if not json_output:
            _say_queue()
        ui.print_json(spec.to_dict() | {"env": sorted(spec.env)})
        return
    job = request({"op": "submit", "spec": spec.to_dict(), "hold": hold, "share": share_logs})["job"]
    if json_output:
        ui.print_json(job)
        return
    _say_queue()
    ui.console.print(f"job {job['id']} ({job['name']}) {job['state']}")


def _submit_elsewhere(spec: Any, engine: str, dry_run: bool, json_output: bool, **options: Any) -> None:
    """Hand ``spec`` to Slurm, Ray or Kubernetes (``options``: the engine's own), or print what would be."""
    from redline.queue.engines import engine as make

    target = make(engine, **options)
    if dry_run:
        typer.echo(target.render(spec), nl=False)
        return
    job_id = target.submit(spec)
    if json_output:
        ui.print_json({"engine": engine, "id": job_id})
        return
    ui.console.print(f"{engine} job {job_id} ({spec.label}) submitted")


def jobs(
    everything: bool = typer.Option(False, "--all", help="Every job the queue has had, not the live and latest."),
    engine: str = typer.Option(
        "local", "--engine", help="local, slurm, ray, kubernetes, or all: the jobs redline gave each engine."
    ),
    namespace: str = typer.Option("default", "--namespace", help="Kubernetes: the namespace."),
    address: str | None = typer.Option(None, "--address", help="Ray: the dashboard address (default $RAY_ADDRESS)."),
    json_output: bool = typer.Option(False, "--json", help="The jobs as JSON."),
) -> None:
    """The queue's jobs: what runs where, what waits and why, how the latest ended; with --engine, those redline
    handed to Slurm, Ray or Kubernetes."""
    from redline.queue.client import request
    from redline.queue.engines import ENGINES

    if engine not in ("local", "all", *ENGINES):
        raise BadInput(f"--engine is local, {', '.join(ENGINES)} or all; not {engine!r}")
    local = engine in ("local", "all")
    listed = request({"op": "jobs", "all": everything})["jobs"] if local else []
    remote = _engine_jobs(
        list(ENGINES) if engine == "all" else (engine,) if engine != "local" else (), namespace, address
    )
    if json_output:
        ui.print_json({"jobs": listed, "engines": [j.to_dict() for j in remote]})
        return
    if local:
        _say_queue()
        ui.print_table(jobs_table(listed, time.time()))
    if remote:
        _print_engine_jobs(remote)


def jobs_table(listed: list[dict[str, Any]], now: float) -> Table:
    """The queue's jobs (the daemon's answer) as `redline jobs` shows them: a job's GPUs with the devices and
    what it reserves on each, how long it waited (or ran, once started)."""
    from rich.table import Table

    from redline.units import fmt_bytes, fmt_duration

    table = Table(title="redline jobs", title_justify="left")
    table.add_column("id", no_wrap=True)
    for column in ("user", "name"):
        table.add_column(column)
    table.add_column("state", no_wrap=True)
    table.add_column("GPUs")
    table.add_column("waited/ran", no_wrap=True)
    table.add_column("why, or how it ended")
    for job in listed:
        placement = job["placement"] or {}
        reserved = placement.get("reserved_bytes") or []
        devices = ", ".join(u[:12] for u in placement.get("uuids", []))
        gpus = f"{job['spec']['gpus']}" + (f" ({devices}; {fmt_bytes(max(reserved))} each)" if reserved else "")
        since = job["started_at"] or job["submitted_at"]
        table.add_row(
            str(job["id"]),
            *map(_shown, (job["user"], job["name"], job["state"], gpus)),
            fmt_duration((job["ended_at"] or now) - since),
            _shown(job["reason"]),
        )
    return table


def _say_queue() -> None:
    """Which queue this command talked to, on stderr (stdout stays the command's output): the machine's, shared
    by every user, or this user's own ($REDLINE_HOME's, or the one under the data home). Said once the queue
    answered, so that a refusal stays one line."""
    from redline.queue.client import queue_dir, whose

    directory = queue_dir()
    ui.err_console.print(ui.dim(f"queue: {directory} ({whose(directory)})"), highlight=False, soft_wrap=True)


def _shown(text: object) -> str:
    """Text another user chose (a job's name, its program, a reason quoting its path) without what a terminal
    would act on: control characters (escape sequences) become "?". The console prints no markup."""
    return "".join(c if c.isprintable() else "?" for c in str(text))


def _engine_jobs(names: Sequence[str], namespace: str, address: str | None) -> list[EngineJob]:
    """The jobs redline gave each engine in ``names``; with several (``--engine all``), one that cannot be asked
    (no client, no cluster) is said and skipped."""
    from redline.errors import RedlineError
    from redline.queue.engines import engine

    found: list[EngineJob] = []
    for name in names:
        try:
            found += engine(name, namespace=namespace, address=address).jobs()
        except RedlineError as exc:
            if len(names) == 1:
                raise
            ui.warn(f"{name}: {exc}")
    return found


def _print_engine_jobs(remote: list[EngineJob]) -> None:
    from rich.table import Table

    table = Table(title="redline jobs on other engines", title_justify="left")
    for column in ("engine", "id", "name", "state", "why, or how it ended"):
        table.add_column(column, no_wrap=column in ("engine", "state"))
    for job in remote:
        table.add_row(*map(_shown, (job.engine, job.id, job.name, job.state, job.reason)))
    ui.print_table(table)


def _change(op: str, ids: list[str], json_output: bool) -> None:
    from redline.queue.client import request

    for key in ids:
        if not key.isdigit():
            raise BadInput(f"a job id is a number, not {key!r}")
    changed = request({"op": op, "ids": ids}, start=False)["jobs"]
    if json_output:
        ui.print_json({"jobs": changed})
        return
    for job in changed:
        ui.console.print(
            f"job {job['id']} ({_shown(job['name'])}): {job['state']}"
            + (" (stopping)" if op == "cancel" and job["state"] in ("starting", "running") else "")
        )


def cancel(
    ids: list[str] = typer.Argument(..., help="Job ids."),
    engine: str = typer.Option("local", "--engine", help="local, slurm, ray or kubernetes: whose ids they are."),
    namespace: str = typer.Option("default", "--namespace", help="Kubernetes: the namespace."),
    address: str | None = typer.Option(None, "--address", help="Ray: the dashboard address (default $RAY_ADDRESS)."),
    json_output: bool = typer.Option(False, "--json"),
) -> None:
    """Cancel jobs: a waiting one leaves the queue, a running one is stopped (SIGTERM, SIGKILL after 10 s)."""
    if engine == "local":
        _change("cancel", ids, json_output)
        return
    from redline.queue.engines import engine as make

    target = make(engine, namespace=namespace, address=address)
    for job_id in ids:
        target.cancel(job_id)
        if not json_output:
            ui.console.print(f"{engine} job {job_id}: cancelled")
    if json_output:
        ui.print_json({"engine": engine, "cancelled": ids})


def hold(
    ids: list[str] = typer.Argument(..., help="Job ids."), json_output: bool = typer.Option(False, "--json")
) -> None:
    """Keep waiting jobs from starting until released."""
    _change("hold", ids, json_output)


def release(
    ids: list[str] = typer.Argument(..., help="Job ids."), json_output: bool = typer.Option(False, "--json")
) -> None:
    """Let held jobs start."""
    _change("release", ids, json_output)


def logs(
    job: str = typer.Argument(..., help="A job id."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing as the job writes, until it ends."),
) -> None:
    """A job's output (its stdout and stderr, every attempt)."""
    from redline.queue.client import open_log
    from redline.queue.spec import LIVE

    if not job.isdigit():
        raise BadInput(f"a job id is a number, not {job!r}")
    answer, fd = open_log(job)
    while fd is None:  # not started yet: nothing written
        if not follow or answer["state"] not in LIVE:
            ui.warn(f"job {job} is {answer['state']} and has written nothing")
            return
        time.sleep(0.25)
        answer, fd = open_log(job)
    with open(fd, "rb") as log:
        _copy_log(job, log, follow)


def _copy_log(job: str, log: Any, follow: bool) -> None:
    """The log's bytes to stdout as they come; with ``follow``, until the job has ended."""
    import sys

    from redline.queue.client import request
    from redline.queue.spec import LIVE

    while True:
        chunk = log.read(1 << 16)
        if chunk:
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            continue
        if not follow or request({"op": "job", "id": job}, start=False)["job"]["state"] not in LIVE:
            if follow:  # what it wrote between the last read and its end
                sys.stdout.buffer.write(log.read())
            return
        time.sleep(0.25)


@app.command("status")
def status(json_output: bool = typer.Option(False, "--json", help="The GPUs and counts as JSON.")) -> None:
    """The GPUs with their jobs, reservations and processes the queue did not start; the jobs by state."""
    from redline.queue.client import request

    answer = request({"op": "status"})
    if json_output:
        ui.print_json(answer)
        return
    _say_queue()
    if answer["gpus"]:
        ui.print_table(status_table(answer))
    else:
        ui.console.print("no GPU here: jobs without --gpus only")
    ui.console.print("jobs: " + (", ".join(f"{n} {state}" for state, n in sorted(answer["counts"].items())) or "none"))


def status_table(answer: dict[str, Any]) -> Table:
    """The daemon's status answer as `redline queue status` shows it: each GPU's memory, the jobs on it with
    what each reserves, the processes the queue did not start, and why it is drained."""
    from rich.table import Table

    from redline.units import fmt_bytes

    table = Table(title=f"redline queue ({answer['policy']}; daemon pid {answer['pid']})", title_justify="left")
    table.add_column("GPU")
    table.add_column("used", no_wrap=True)
    table.add_column("room", justify="right", no_wrap=True)
    for column in ("jobs (reserved)", "not the queue's", "drained"):
        table.add_column(column)
    for gpu in answer["gpus"]:
        table.add_row(
            f"{gpu['index']}{' MIG ' + gpu['mig'] if gpu.get('mig') else ''} {gpu['uuid'][:16]}",
            f"{fmt_bytes(gpu['used_bytes'])} of {fmt_bytes(gpu['total_bytes'])}",
            fmt_bytes(max(gpu["room_bytes"], 0)),
            ", ".join(f"{j['id']} ({fmt_bytes(j['reserved_bytes'])})" for j in gpu["jobs"]),
            ", ".join(f"pid {p['pid']} ({fmt_bytes(p['bytes'])})" for p in gpu["foreign"]),
            gpu["drained"],
        )
    return table


@app.command("daemon")
def daemon(
    directory: Path | None = typer.Option(
        None, "--dir", help="Its state, socket and logs (default: as clients find it)."
    ),
    policy: str = typer.Option("pack", "--policy", help="pack: fill the fullest GPU that fits; spread: the emptiest."),
    jobs_per_user: int | None = typer.Option(None, "--max-jobs-per-user", help="Running jobs per user at most."),
    gpus_per_user: int | None = typer.Option(None, "--max-gpus-per-user", help="GPUs held per user at most."),
    backoff: float = typer.Option(10.0, "--retry-backoff", help="Seconds before a retry (doubling each time)."),
    metrics_port: int | None = typer.Option(
        None, "--metrics-port", help="Serve the queue's series for Prometheus on 127.0.0.1:PORT (0: any free port)."
    ),
) -> None:
    """Run the queue's daemon in the foreground (the systemd unit runs this; clients start it on first use)."""
    from redline.queue.client import queue_dir
    from redline.queue.daemon import Daemon
    from redline.queue.placement import POLICIES
    from redline.queue.policy import Limits

    if policy not in POLICIES:
        raise BadInput(f"--policy is {' or '.join(POLICIES)}, not {policy!r}")
    for option, value in (("--max-jobs-per-user", jobs_per_user), ("--max-gpus-per-user", gpus_per_user)):
        if value is not None and value < 1:
            raise BadInput(f"{option} must be at least 1, not {value}")
    if backoff < 0:
        raise BadInput(f"--retry-backoff must be 0 or more, not {backoff}")
    limits = Limits(jobs_per_user, gpus_per_user)
    if metrics_port is not None:
        from redline.cli.params import tcp_port

        tcp_port("--metrics-port", metrics_port, allow_zero=True)
    Daemon(directory or queue_dir(), policy=policy, limits=limits, backoff_s=backoff, metrics_port=metrics_port).serve()


UNIT = """[Unit]
Description=redline queue: this machine's GPUs shared between jobs and people
After=network-online.target nvidia-persistenced.service

[Service]
ExecStart={python} -m redline queue daemon --dir /var/lib/redline/queue
Restart=on-failure
# a stop or restart of the daemon leaves its jobs running: the next daemon adopts them
KillMode=process
StateDirectory=redline/queue
# the jobs run in this unit's cgroup: systemd's default TasksMax would cap every job's processes and threads
TasksMax=infinity
# users reach the socket in it and list nothing; what is inside is private (the daemon makes it so)
StateDirectoryMode=0711

[Install]
WantedBy=multi-user.target
"""


@app.command("unit")
def unit() -> None:
    """Print the systemd unit that runs the machine's queue as root (each job as its user):
    `redline queue unit > /etc/systemd/system/redline-queue.service && systemctl enable --now redline-queue`."""
    import sys

    python = Path(sys.executable)
    if unsafe := _writable_by_others(python):
        ui.warn(
            f"{unsafe} may be changed by a user other than root, and the unit runs {python} as root: install "
            "redline where only root can write (a root-owned environment in /opt, say)"
        )
    typer.echo(UNIT.format(python=sys.executable), nl=False)


def _writable_by_others(python: Path) -> Path | None:
    """The first of the interpreter and the folders above it that a user other than root owns or may write
    (a sticky folder excepted: others may not rename what is in it), or None."""
    import stat

    resolved = python.resolve()
    for path in (resolved, *resolved.parents):
        found = path.stat()
        loose = found.st_mode & 0o022 and not (stat.S_ISDIR(found.st_mode) and found.st_mode & stat.S_ISVTX)
        if found.st_uid != 0 or loose:
            return path
    return None


def _umask() -> int:
    """This process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _plan_needs(path: Path) -> tuple[int, int | None]:
    """The GPUs a plan runs on and its predicted peak per GPU plus ``PLAN_MARGIN`` (None: the plan predicts no
    memory)."""
    from redline.plan.planfile import load_plan

    plan = load_plan(path)
    if plan.hardware.get("accelerator") == "cpu":
        return 0, None
    total = (plan.predicted.get("memory_bytes") or {}).get("device_total")
    return plan.strategy.gpus, int(total * (1 + PLAN_MARGIN)) if total else None
