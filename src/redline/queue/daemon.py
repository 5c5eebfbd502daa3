"""The queue's daemon: one per machine (or per user, where no machine-wide one runs), serving a unix socket.

Clients send one request per connection (``protocol``, ``server``); the kernel tells the daemon who is asking
(SO_PEERCRED), and only a job's owner or root may cancel, hold or release it, or read its log (unless it was
submitted with ``--share-logs``). A daemon run by root (the shipped systemd unit) runs each job as the user
who submitted it; one run by a user serves that user only.

Every moment of a job's life is in the store (``store.Store``) and in its attempt's directory
(``jobs/<id>/<attempt>/``: run.json, lock, pid.json, exit.json), so the daemon can be killed with -9 at any
instant: the next one ``recover``s every job (running ones are adopted, queued ones stay queued), and none runs
twice. See ``shim.py`` for the lock that makes "is this attempt still running" a question the kernel answers,
and ``layout.py`` for the folder and its modes: everything the daemon writes is private.

Root acts as the user on the user's paths (OpenSSH's privilege separation): the job's folder is entered by the
job's own process after it has become the user, and the one file a job leaves for the daemon (its out-of-memory
record) is opened without following links or blocking, and only when it is the user's regular file.

A full disk stops nothing that runs: submits are refused in one line, nothing new starts, and each state change
is written once there is room again (the shims' records need none: ``shim.preallocate``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import pwd
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redline.env import QUEUE_OOM_RECORD, REDLINE_JOB_ID, REDLINE_PLAN, REDLINE_QUEUE_RECORDS
from redline.errors import BadInput
from redline.files import read_user_bytes
from redline.lockfile import HeldElsewhere, WriterLock
from redline.queue import layout
from redline.queue.health import GpuHealth, new_xids, sampled_health
from redline.queue.placement import Devices, Placement, Request, Reservation, Slot, more_gpus_than_here
from redline.queue.policy import Limits, Running, Waiting, decide
from redline.queue.protocol import Op
from redline.queue.server import Answer, Server, say
from redline.queue.shim import preallocate, read_record, recorded
from redline.queue.spec import ACTIVE, FINAL_STATES, LIVE, JobSpec, JobState
from redline.queue.store import Job, Store

SHIM = Path(__file__).with_name("shim.py")
TICK_S = 0.5  # how often the daemon looks at its jobs when nothing wakes it
STATUS_TTL_S = 1.0  # a status is read again after this
BACKOFF_S = 10.0  # a retry waits this, doubling per attempt (with jitter)
MAX_BACKOFF_S = 300.0

ENDED_BADLY = (JobState.FAILED, JobState.CANCELLED, JobState.LOST)

GpuSource = Callable[[set[int]], list[Slot]]  # the devices now, the queue's own pids given


def probe_slots(ours: set[int]) -> list[Slot]:
    """The product path: this machine's GPUs as NVML sees them now."""
    from redline.hw.nvml.probe import probe_gpus
    from redline.queue.placement import slots_from

    return slots_from(probe_gpus(), ours)


@dataclass
class Daemon:
    directory: Path
    gpus: GpuSource = probe_slots
    policy: str = "pack"
    limits: Limits = field(default_factory=Limits)
    backoff_s: float = BACKOFF_S  # a retry's first wait
    metrics_port: int | None = None  # serve the queue's series for Prometheus here (0: any free port)
    health: GpuHealth | None = None  # what drains GPUs and tells a GPU fault's end (serve: the monitor's sampler)
    store: Store = field(init=False)
    _slots: dict[str, Slot] = field(default_factory=dict, init=False)  # the devices as last read
    wake: asyncio.Event | None = field(default=None, init=False)
    full: bool = field(default=False, init=False)  # the disk was full at the last tick
    job_nofile: int | None = field(default=None, init=False)  # the descriptor limit jobs get: the daemon's own
    _status_cache: tuple[float, tuple[Any, ...], dict[str, Any]] | None = field(default=None, init=False)

    @property
    def socket_path(self) -> Path:
        return self.directory / "queue.sock"

    # ---------------------------------------------------------------------------------------------- life

    def serve(self) -> None:
        """Run until SIGTERM or SIGINT: one daemon per directory (a second one exits at once, said)."""
        os.umask(0o077)  # private unless said otherwise (layout.py)
        self.job_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # before the server raises it
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            lock = WriterLock(self.directory / "daemon", what="queue daemon").acquire()
        except HeldElsewhere as exc:
            raise BadInput(f"a queue daemon already serves {self.directory} (pid {exc.holder})") from None
        try:
            self.store = Store(self.directory / "queue.db")
            shared_logs = {j.key for j in self.store.jobs() if j.share_logs}
            changed = layout.make_private(self.directory, shared_logs)
            if changed:
                say(f"made {changed} files and folders under {self.directory} private (the modes in layout.py)")
            for folder in ("jobs", "spool"):
                layout.make_folder(self.directory / folder, self.directory)
            if self.health is None:
                self.health = sampled_health()
            self.recover()
            if self.metrics_port is not None:
                self._serve_metrics()
            asyncio.run(self._main())
        finally:
            lock.release()

    async def _main(self) -> None:
        self.wake = asyncio.Event()
        self.socket_path.unlink(missing_ok=True)
        server = Server(self.handle, self.wake.set)
        server.start(str(self.socket_path))
        # root's queue is the machine's: every user may connect (the peer's uid decides what it may do)
        os.chmod(self.socket_path, 0o666 if layout.shared() else 0o600)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        try:
            while not stopping.is_set():
                self._tick_through_a_full_disk()
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(_first(self.wake.wait(), stopping.wait()), TICK_S)
        finally:
            server.close()
            self.socket_path.unlink(missing_ok=True)

    def _serve_metrics(self) -> None:
        """The queue's series on ``metrics_port``, on a thread of prometheus_client's; the port it bound is
        written to ``metrics.port`` (for a port of 0)."""
        from prometheus_client import CollectorRegistry

        from redline.monitor.metrics_server import start_metrics_server
        from redline.queue.metrics import QueueCollector

        # the scrapes' own view of the queue: its own connection, used by one scrape at a time (QueueCollector)
        view = Daemon(self.directory, gpus=self.gpus, policy=self.policy)
        view.store = Store(self.directory / "queue.db", threads=True)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(QueueCollector(view.store, view._status))
        assert self.metrics_port is not None
        server, _ = start_metrics_server(self.metrics_port, addr="127.0.0.1", registry=registry)
        (self.directory / "metrics.port").write_text(str(server.server_address[1]))

    def recover(self) -> None:
        """After a start (a crash, a kill -9, a reboot): every job that was starting or running is adopted
        when its shim still holds its attempt's lock, finished when its shim wrote how it ended, requeued when
        its shim never started (it did not run), and marked lost (retried if it may) when its shim is gone
        without a word: a reboot, or the shim killed."""
        for job in self.store.jobs(ACTIVE):
            self._follow(job)

    # ------------------------------------------------------------------------------------------- the loop

    def _tick_through_a_full_disk(self) -> None:
        """``tick``, unless the queue's disk is full: then said once, and tried again at the next tick (what
        runs goes on; each job's end is in its shim's record, which needs no room)."""
        try:
            self.tick()
        except Exception as exc:
            if not layout.disk_full(exc):
                raise
            if not self.full:
                say(f"the disk of {self.directory} is full: nothing starts and no state is written until there is room")
            self.full = True
            return
        if self.full:
            say(f"the disk of {self.directory} has room again")
        self.full = False

    def tick(self) -> None:
        """Reap the shims, follow the running jobs, settle dependencies, start what may start."""
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        for job in self.store.jobs(ACTIVE):
            self._follow(job)
        self._settle_dependencies()
        if self.health is not None:
            self.health.observe()
        self._schedule()

    def _follow(self, job: Job) -> None:
        """Where the job's attempt is. While its shim holds the lock only its start is news; once the lock is
        free its records are final (read before the lock, an end written in between would be missed)."""
        attempt = self._attempt_dir(job)
        started = read_record(attempt / "pid.json")
        if started is not None and job.state == JobState.STARTING:
            self.store.update(job.id, state=JobState.RUNNING, started_at=started["started_at"])
        if _locked(attempt / "lock"):
            return
        started = read_record(attempt / "pid.json")
        ended = read_record(attempt / "exit.json")
        if ended is not None:  # the shim's word on how it ended is final, whatever else is found
            self._finish(job, ended)
            return
        if started is None:  # the shim never let the job run: it did not run, it waits again
            self.store.update(job.id, state=JobState.QUEUED, attempt=job.attempt - 1, placement=None, reason="")
            return
        if recorded(started, "pid"):  # the job may outlive its shim: stop it before it could run twice
            _kill_group(started["pid"])
        self._end(job, JobState.LOST, None, "its shim vanished (a reboot, or the shim killed)", retry=True)

    def _finish(self, job: Job, ended: dict[str, Any]) -> None:
        code, reason = ended["returncode"], ended.get("reason") or ""
        oom, refused = self._oom_record(job)
        records = self._records_dir(job)
        if records is not None and records.parent == self.directory / "spool":  # read: the user's folder goes
            shutil.rmtree(records, ignore_errors=True)  # fd-relative, never following a link the user made
        if reason == "cancelled":
            self._end(job, JobState.CANCELLED, code, "cancelled")
        elif code == 0:
            self._end(job, JobState.DONE, 0, "")
        elif oom is not None and not reason:  # the next attempt resumes with it, from its checkpoints
            why = f"out of memory; the runtime recorded micro-batch {oom.get('micro_batch')}"
            self._end(job, JobState.FAILED, code, why, retry=True)
        elif code < 0 and not reason:  # killed by a signal it did not ask for: preempted, the OOM killer
            self._end(job, JobState.FAILED, code, f"killed by signal {-code}", retry=True)
        elif not reason and (faults := self._gpu_faults(job)):  # a GPU fault, not the job's own
            self._end(job, JobState.FAILED, code, f"exit {code} after {faults}", retry=True)
        else:
            self._end(job, JobState.FAILED, code, "; ".join(filter(None, (reason or f"exit {code}", refused))))

    def _oom_record(self, job: Job) -> tuple[dict[str, Any] | None, str]:
        """The out-of-memory record the job's runtime left, and why one there was not taken (""). The folder is
        the job's user's: the record is taken only when it is that user's regular file, under a size cap,
        opened without following a link or waiting on a FIFO."""
        records = self._records_dir(job)
        if records is None or not os.path.lexists(records / QUEUE_OOM_RECORD):
            return None, ""
        try:
            data = read_user_bytes(
                records / QUEUE_OOM_RECORD,
                "out-of-memory record",
                limit_bytes=layout.RECORD_LIMIT_BYTES,
                follow=False,
                owner=job.uid,
            )
            record = json.loads(data)
            if not isinstance(record, dict) or not isinstance(record.get("micro_batch"), int):
                raise ValueError("no micro_batch in it")
            return record, ""
        except BadInput as exc:
            return None, f"not taken: {exc}"
        except ValueError as exc:
            return None, f"not taken: its out-of-memory record is not JSON ({exc})"

    def _records_dir(self, job: Job) -> Path | None:
        """Where the attempt's runtime leaves its records (the spool; an older daemon's attempts: inside them)."""
        try:
            run = json.loads((self._attempt_dir(job) / "run.json").read_text())
        except (OSError, ValueError):
            return None
        records = (run.get("env") or {}).get(REDLINE_QUEUE_RECORDS)
        return Path(records) if records else None

    def _gpu_faults(self, job: Job) -> str:
        """The critical Xids that appeared on the job's GPUs while it ran, in words ("" for none)."""
        placement = job.placement or {}
        if self.health is None or not placement.get("xids"):
            return ""
        pci = dict(zip(placement["uuids"], placement.get("pci_bus_ids", ()), strict=False))
        grew = new_xids(placement["xids"], self.health.critical_xids({u: p for u, p in pci.items() if p}))
        return "; ".join(f"Xid {', '.join(codes)} on {uuid}" for uuid, codes in sorted(grew.items()))

    def _end(self, job: Job, state: JobState, code: int | None, why: str, *, retry: bool = False) -> None:
        """The job's attempt is over: requeued after a backoff when it may retry, else ended as ``state``."""
        if retry and job.retries_left > 0:
            backoff = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (job.attempt - 1)) * random.uniform(0.8, 1.2)
            self.store.update(
                job.id,
                state=JobState.QUEUED,
                reason=f"{why}; retry {job.spec.retries - job.retries_left + 1} of {job.spec.retries}",
                retries_left=job.retries_left - 1,
                not_before=time.time() + backoff,
                exit_code=code,
                placement=None,
            )
            return
        self.store.update(job.id, state=state, exit_code=code, reason=why, ended_at=time.time())

    def _settle_dependencies(self) -> None:
        """A job waiting for one that ended badly fails, said; one whose dependencies all ended well may go."""
        states = {}
        for job in self.store.jobs((JobState.QUEUED,)):
            for other in job.spec.after:
                if other not in states:
                    found = self.store.get(int(other))
                    states[other] = found.state if found else "missing"
            failed = [o for o in job.spec.after if states[o] in (*ENDED_BADLY, "missing")]
            if failed:
                self._end(job, JobState.FAILED, None, f"job {failed[0]} it runs after {states[failed[0]]}")

    def _schedule(self) -> None:
        now = time.time()
        queued = [j for j in self.store.jobs((JobState.QUEUED,)) if j.not_before <= now]
        running = self.store.jobs(ACTIVE)
        ready = []
        for job in queued:
            waiting_for = [o for o in job.spec.after if (self.store.get(int(o)) or job).state != JobState.DONE]
            if waiting_for:
                self._say(job, f"waits for job {waiting_for[0]}")
            else:
                ready.append(job)
        if not ready:
            return
        needs_gpus = any(j.spec.gpus for j in ready)
        devices = self._devices(running) if needs_gpus else Devices([])
        decision = decide(
            [_waiting(j) for j in ready],
            [_running(j) for j in running],
            devices,
            now,
            limits=self.limits,
            policy=self.policy,
        )
        jobs = {j.key: j for j in ready}
        for waiting, placement in decision.starts:
            self._launch(jobs[waiting.id], placement)
        for key, why in decision.waiting.items():
            self._say(jobs[key], why)

    def _say(self, job: Job, why: str) -> None:
        if job.reason != why:
            self.store.update(job.id, reason=why)

    def _devices(self, running: list[Job]) -> Devices:
        """The GPUs now, and what the running jobs reserved on them and use (NVML's figure for the processes of
        each job's tree: its launcher and its ranks)."""
        from redline.hw.host import process_tree

        trees = {}
        for job in running:
            started = read_record(self._attempt_dir(job) / "pid.json")
            trees[job.key] = process_tree(started["pid"]) if started is not None else set()
        found = self.gpus(set().union(*trees.values()))
        slots = {slot.uuid: slot for slot in (self.health.drain(found) if self.health is not None else found)}
        self._slots = slots
        reservations = []
        for job in running:
            placement = job.placement or {}
            exclusive = job.spec.exclusive or job.spec.gpu_memory_bytes is None
            for uuid, size in zip(placement.get("uuids", ()), placement.get("reserved_bytes", ()), strict=True):
                using = slots[uuid].using(trees[job.key]) if uuid in slots else 0
                reservations.append(Reservation(job.key, uuid, size, using, exclusive))
        return Devices(list(slots.values()), reservations)

    # ------------------------------------------------------------------------------------------- a launch

    def _attempt_dir(self, job: Job, attempt: int | None = None) -> Path:
        return self.directory / "jobs" / str(job.id) / str(job.attempt if attempt is None else attempt)

    def _xid_baseline(self, placement: Placement) -> dict[str, Any]:
        """The placement's GPUs' PCI addresses and the critical Xids the kernel log holds for them now: what
        tells, when the job fails, whether a GPU fault came in between."""
        if self.health is None or not placement.uuids:
            return {}
        slots = [self._slots[uuid] for uuid in placement.uuids if uuid in self._slots]
        pci = {s.uuid: s.pci_bus_id for s in slots if s.pci_bus_id is not None}
        return {"pci_bus_ids": [pci.get(uuid) for uuid in placement.uuids], "xids": self.health.critical_xids(pci)}

    def _launch(self, job: Job, placement: Placement) -> None:
        """Start the job's next attempt: its directory, records and lock first, then "starting" committed, then
        the shim (which inherits the locked descriptor), then the daemon's copy of the descriptor closed. A kill
        -9 between any two steps leaves a state ``recover`` reads right. What fails one job's start (a full
        disk, a user gone from the machine, no process to be had) is that job's, said; the others go on."""
        number = job.attempt + 1
        attempt = self._attempt_dir(job, number)
        try:
            self._prepare(job, placement, attempt)
        except KeyError:  # pwd: the user was removed, or its directory service is down
            shutil.rmtree(attempt, ignore_errors=True)
            self._end(job, JobState.FAILED, None, f"its user (uid {job.uid}) is not known to this machine now")
            return
        except OSError as exc:
            shutil.rmtree(attempt, ignore_errors=True)  # the daemon's own folder: what this try made of it
            if not layout.disk_full(exc):
                raise
            self._say(job, f"waits: the disk of {self.directory} is full")
            return
        lock = os.open(attempt / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            placed = {"uuids": list(placement.uuids), "reserved_bytes": list(placement.reserved_bytes)}
            placed |= self._xid_baseline(placement)
            self.store.update(job.id, state=JobState.STARTING, attempt=number, placement=placed, reason=placement.note)
            self._start_shim(job, attempt, lock)
        finally:
            os.close(lock)

    def _start_shim(self, job: Job, attempt: Path, lock: int) -> None:
        try:
            with open(attempt / "shim.log", "wb") as shim_log:
                subprocess.Popen(
                    # -I -S: the shim needs only the standard library, and starts faster without site-packages
                    [sys.executable, "-I", "-S", str(SHIM), str(attempt)],
                    pass_fds=(lock,),
                    stdin=subprocess.DEVNULL,
                    stdout=shim_log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    cwd="/",
                )
        except OSError as exc:  # no process to be had now (EAGAIN: the tasks limit; ENOMEM): it waits a while
            say(f"job {job.id}: its shim did not start: {exc}")
            why = f"waits: its supervisor could not start ({exc.strerror or exc})"
            wait = time.time() + self.backoff_s
            self.store.update(
                job.id, state=JobState.QUEUED, attempt=job.attempt, placement=None, reason=why, not_before=wait
            )

    def _prepare(self, job: Job, placement: Placement, attempt: Path) -> None:
        """The attempt's folder, its shim's orders (run.json), its records made ahead (they need no room later),
        the job's log and its records folder in the spool, both its user's. An attempt whose shim never let
        its job run (``_follow``) is made anew."""
        shutil.rmtree(attempt, ignore_errors=True)
        layout.make_folder(attempt.parent, self.directory)
        layout.make_folder(attempt, self.directory)
        owner = pwd.getpwuid(job.uid)
        log = attempt.parent / "output.log"
        records = self.directory / "spool" / f"{job.id}.{attempt.name}"
        os.close(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        records.mkdir(mode=0o700, exist_ok=True)
        if layout.shared():
            for path in (log, records):
                os.chown(path, job.uid, owner.pw_gid, follow_symlinks=False)
        os.chmod(log, 0o644 if job.share_logs else 0o600)
        env = dict(job.spec.env) | {
            REDLINE_JOB_ID: job.key,
            REDLINE_QUEUE_RECORDS: str(records),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(placement.uuids),
        }
        if job.spec.plan:
            env[REDLINE_PLAN] = job.spec.plan
        run = {
            "argv": list(job.spec.argv),
            "cwd": job.spec.cwd,
            "env": env,
            "umask": job.spec.umask,
            "nofile": self.job_nofile,
            "log": str(log),
            "time_limit_s": job.spec.time_limit_s,
            "uid": job.uid,
            "gid": owner.pw_gid,
            "groups": os.getgrouplist(owner.pw_name, owner.pw_gid) if layout.shared() else [],
        }
        for name in ("pid.json", "exit.json"):
            preallocate(attempt / name)
        (attempt / "run.json").write_text(json.dumps(run))

    # -------------------------------------------------------------------------------------------- requests

    def handle(self, op: Op, request: dict[str, Any], uid: int) -> Answer:
        """One request from user ``uid``: its answer, or BadInput saying why not."""
        if op == Op.SUBMIT:
            return Answer({"job": self._submit(request, uid).to_dict(private=True)})
        if op == Op.JOBS:
            return Answer({"jobs": [j.to_dict(private=_may(uid, j)) for j in self._listed(request)]})
        if op == Op.JOB:
            job = self._job(request["id"])
            return Answer({"job": job.to_dict(private=_may(uid, job))})
        if op in (Op.CANCEL, Op.HOLD, Op.RELEASE):
            return Answer({"jobs": [self._change(op, key, uid) for key in request["ids"]]})
        if op == Op.LOG:
            job = self._owned(request["id"], uid, reading=True)
            log = self.directory / "jobs" / job.key / "output.log"
            try:
                fd = os.open(log, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:  # queued, not started yet: nothing written
                return Answer({"state": job.state, "log": False})
            return Answer({"state": job.state, "log": True}, fd=fd)
        return Answer(self._status())

    def _submit(self, request: dict[str, Any], uid: int) -> Job:
        spec = JobSpec.from_dict(request["spec"])
        if uid != os.geteuid() and os.geteuid() != 0:
            raise BadInput("this queue is another user's: submit to the machine's queue, or start your own")
        for other in spec.after:
            if not other.isdigit() or self.store.get(int(other)) is None:
                raise BadInput(f"--after {other}: no such job")
        if spec.gpus:
            slots = self.gpus(set())
            if len(slots) < spec.gpus:
                source = " (its plan's; --gpus overrides it)" if spec.plan else ""
                raise BadInput(f"the job {more_gpus_than_here(spec.gpus, len(slots), source)}")
            largest = max(s.total_bytes for s in slots)
            if spec.gpu_memory_bytes and spec.gpu_memory_bytes > largest:
                raise BadInput(f"the job asks {spec.gpu_memory_bytes} bytes per GPU; the largest has {largest}")
        free = layout.free_bytes(self.directory)
        full = BadInput(
            f"the queue's disk is full ({free} bytes free at {self.directory}): running jobs go on; "
            "submit again once there is room"
        )
        if free < layout.MIN_FREE_BYTES:
            raise full
        try:
            return self.store.add(
                spec, uid, _user_name(uid), held=bool(request.get("hold")), share=bool(request.get("share"))
            )
        except Exception as exc:
            if layout.disk_full(exc):
                raise full from None
            raise

    def _listed(self, request: dict[str, Any]) -> list[Job]:
        if request.get("all"):
            return self.store.jobs()
        return self.store.jobs(LIVE) + self.store.jobs(FINAL_STATES, limit=20)

    def _job(self, key: Any) -> Job:
        job = self.store.get(int(key)) if str(key).isdigit() and len(str(key)) < 20 else None
        if job is None:
            raise BadInput(f"no job {key}")
        return job

    def _owned(self, key: Any, uid: int, *, reading: bool = False) -> Job:
        job = self._job(key)
        if not (_may(uid, job) or (reading and job.share_logs)):
            raise BadInput(f"job {job.id} is {job.user}'s: only its owner or root may do that")
        return job

    def _change(self, op: Op, key: Any, uid: int) -> dict[str, Any]:
        job = self._owned(key, uid)
        if op == Op.HOLD and job.state == JobState.QUEUED:
            self.store.update(job.id, state=JobState.HELD, reason="held")
        elif op == Op.RELEASE and job.state == JobState.HELD:
            self.store.update(job.id, state=JobState.QUEUED, reason="")
        elif op == Op.CANCEL and job.state in (JobState.QUEUED, JobState.HELD):
            self.store.update(job.id, state=JobState.CANCELLED, reason="cancelled", ended_at=time.time())
        elif op == Op.CANCEL and job.state in ACTIVE:
            attempt = self._attempt_dir(job)
            (attempt / "cancel").touch()
            started = read_record(attempt / "pid.json")
            if started is not None and recorded(started, "shim"):  # else the shim reads the file before its go
                with contextlib.suppress(ProcessLookupError):
                    os.kill(started["shim"], signal.SIGTERM)
        elif op != Op.CANCEL or job.state not in FINAL_STATES:
            raise BadInput(f"job {job.id} is {job.state}: it cannot be {op}{'ed' if op != Op.HOLD else ''}")
        changed = self.store.get(job.id)
        assert changed is not None
        return changed.to_dict(private=True)

    def _status(self) -> dict[str, Any]:
        """The GPUs and counts. The GPUs are read again (NVML and /proc walks are not free, and any user may ask)
        after a second, or at once when the queue's jobs changed: a status never contradicts `jobs`."""
        running = self.store.jobs(ACTIVE)
        counts = self.store.counts()
        key = (tuple((job.id, job.state, job.attempt) for job in running), tuple(sorted(counts.items())))
        now = time.monotonic()
        cached = self._status_cache
        if cached is None or cached[1] != key or now - cached[0] > STATUS_TTL_S:
            self._status_cache = cached = (now, key, self._read_status(running, counts))
        return cached[2]

    def _read_status(self, running: list[Job], counts: dict[str, int]) -> dict[str, Any]:
        devices = self._devices(running)
        gpus = []
        for slot in devices.slots:
            held = [r for r in devices.reservations if r.uuid == slot.uuid]
            gpus.append(
                {
                    "index": slot.index,
                    "mig": slot.mig,
                    "uuid": slot.uuid,
                    "total_bytes": slot.total_bytes,
                    "used_bytes": slot.used_bytes,
                    "room_bytes": devices.room(slot),
                    "jobs": [{"id": r.job, "reserved_bytes": r.reserved_bytes} for r in held],
                    "foreign": [{"pid": pid, "bytes": used} for pid, used in slot.foreign],
                    "drained": slot.drained,
                }
            )
        return {"gpus": gpus, "counts": counts, "policy": self.policy, "pid": os.getpid()}


# ----------------------------------------------------------------------------------------------- helpers


async def _first(*waits: Any) -> None:
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def _waiting(job: Job) -> Waiting:
    request = Request(job.spec.gpus, job.spec.gpu_memory_bytes, job.spec.exclusive)
    return Waiting(job.key, job.uid, job.spec.priority, job.submitted_at, request, job.spec.time_limit_s)


def _running(job: Job) -> Running:
    return Running(job.key, job.uid, job.started_at or time.time(), job.spec.gpus, job.spec.time_limit_s)


def _may(uid: int, job: Job) -> bool:
    return uid in (0, job.uid)


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _locked(path: Path) -> bool:
    """Whether a shim holds the attempt's lock (a lock the daemon can take has no holder)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
