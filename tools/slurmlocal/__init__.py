"""A real single-node Slurm cluster in a directory, for testing redline's Slurm engine against Slurm itself.

``LocalSlurm(root, gpus=2)`` writes slurm.conf and gres.conf under ``root`` (GPUs as character devices made
there with mknod: gres.conf with ``AutoDetect=off`` takes any device file, no GPU needed), starts munged with its
own key and socket, then slurmctld and slurmd in the foreground as its children, and waits for the node to be
idle. ``accounting=True`` adds what ``sacct`` reads: a MariaDB server in the directory (its own data, a TCP port
on 127.0.0.1) and slurmdbd, with the cluster registered (Debian's ``slurmdbd mariadb-server``).

Slurm's commands find this cluster through ``SLURM_CONF`` (``LocalSlurm.env``). ``stop()`` cancels the jobs
left, stops the daemons and ends any process still carrying this cluster's SLURM_CONF (a job's slurmstepd
outlives slurmd). It needs root (slurmd starts jobs as their users) and Debian's ``slurmctld slurmd
slurm-client munge``. ``PYTHONPATH=tools python -m slurmlocal DIR`` holds one open until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

NODE = "redline0"
PARTITION = "debug"
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel")
ACCOUNTING_PROGRAMS = ("mariadbd", "mariadb-install-db", "slurmdbd", "sacctmgr", "sacct")
START_DEADLINE_S = 120.0  # daemons that are not up by then will not come up; each step returns as soon as it is
STOP_DEADLINE_S = 60.0


class SlurmUnavailable(RuntimeError):
    """This machine cannot run a local Slurm; the message says why."""


def _program(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(path) for path in (Path("/usr/sbin") / name, Path("/sbin") / name) if path.exists()), None
    )


def unavailable_reason(accounting: bool = False) -> str | None:
    """Why a local Slurm (with accounting, when asked) cannot run here; None when it can (as far as can be told
    without starting one)."""
    missing = [name for name in PROGRAMS if _program(name) is None]
    if missing:
        install = "apt-get install slurmctld slurmd slurm-client munge"
        return f"Slurm is not installed ({', '.join(missing)} missing): {install}"
    missing = [name for name in ACCOUNTING_PROGRAMS if accounting and _program(name) is None]
    if missing:
        install = "apt-get install slurmdbd mariadb-server"
        return f"Slurm accounting is not installed ({', '.join(missing)} missing): {install}"
    if os.geteuid() != 0:
        return "a local Slurm needs root: slurmd starts each job as its user"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class LocalSlurm:
    """One slurmctld and one slurmd (node ``redline0``, partition ``debug``) with ``gpus`` GPUs, under ``root``."""

    def __init__(
        self, root: Path, gpus: int = 2, cpus: int = 8, min_job_age_s: int = 300, accounting: bool = False
    ) -> None:
        self.root = Path(root).absolute()
        self.gpus = gpus
        self.accounting = accounting
        self.cpus = cpus  # slurmd is told to believe it (config_overrides), so tests can run jobs side by side
        self.min_job_age_s = min_job_age_s
        self.conf = self.root / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}  # what Slurm's commands need to find this cluster
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}

    # ---- configuration ----

    def _write_config(self) -> None:
        root = self.root
        for sub in ("state", "spool", "log", "munge", "dev"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        devices = []
        for index in range(self.gpus):
            device = root / "dev" / f"nvidia{index}"
            if not device.exists():
                try:
                    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(195, index))  # NVIDIA's major number
                except OSError as exc:
                    raise SlurmUnavailable(f"cannot make the GPU device files slurmd needs (mknod): {exc}") from None
            devices.append(device)
        ctld_port, slurmd_port = _free_port(), _free_port()
        self.db_port, self.dbd_port = _free_port(), _free_port()
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        if self.accounting:
            accounting = [
                "AccountingStorageType=accounting_storage/slurmdbd",
                "AccountingStorageHost=127.0.0.1",
                f"AccountingStoragePort={self.dbd_port}",
                f"AccountingStoragePass={root}/munge/munge.socket",  # the munge socket for slurmdbd's connections
                "AccountingStorageTRES=gres/gpu",
                "JobAcctGatherType=jobacct_gather/linux",
            ]
        else:
            accounting = ["AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none"]
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=redline",
                    f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
                    "SlurmUser=root",
                    f"SlurmctldPort={ctld_port}",
                    f"SlurmdPort={slurmd_port}",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={root}/munge/munge.socket",
                    f"StateSaveLocation={root}/state",
                    f"SlurmdSpoolDir={root}/spool",
                    f"SlurmctldPidFile={root}/slurmctld.pid",
                    f"SlurmdPidFile={root}/slurmd.pid",
                    f"SlurmctldLogFile={root}/log/slurmctld.log",
                    f"SlurmdLogFile={root}/log/slurmd.log",
                    "ProctrackType=proctrack/linuxproc",  # no cgroups: runs in a container too
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "SlurmdParameters=config_overrides",
                    "GresTypes=gpu",
                    *accounting,
                    "JobCompType=jobcomp/none",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    f"MinJobAge={self.min_job_age_s}",
                    "KillWait=2",  # a cancelled or timed-out job gets SIGKILL 2 s after SIGTERM
                    "SchedulerType=sched/backfill",
                    f"NodeName={NODE} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} CPUs={self.cpus}"
                    f" RealMemory=1000{gres} State=UNKNOWN",
                    f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                ]
            )
            + "\n"
        )
        lines = ["AutoDetect=off"]
        lines += [f"NodeName={NODE} Name=gpu File={device}" for device in devices]
        (root / "gres.conf").write_text("\n".join(lines) + "\n")
        if self.accounting:
            dbd_conf = root / "slurmdbd.conf"  # slurmdbd reads it beside slurm.conf; it must be private
            dbd_conf.write_text(
                "\n".join(
                    [
                        "AuthType=auth/munge",
                        f"AuthInfo=socket={root}/munge/munge.socket",
                        "DbdHost=localhost",
                        "DbdAddr=127.0.0.1",
                        f"DbdPort={self.dbd_port}",
                        "SlurmUser=root",
                        f"LogFile={root}/log/slurmdbd.log",
                        f"PidFile={root}/slurmdbd.pid",
                        "StorageType=accounting_storage/mysql",
                        "StorageHost=127.0.0.1",
                        f"StoragePort={self.db_port}",
                        "StorageUser=root",
                        "StorageLoc=slurm_acct_db",
                    ]
                )
                + "\n"
            )
            dbd_conf.chmod(0o600)

    def _start_accounting(self, deadline: float) -> None:
        """MariaDB on its own data directory and port, slurmdbd on it, and this cluster registered there."""
        data = self.root / "mariadb"
        install = subprocess.run(
            [
                _program("mariadb-install-db") or "mariadb-install-db",
                "--no-defaults",
                f"--datadir={data}",
                "--user=root",
                "--auth-root-authentication-method=normal",  # root without a password, over TCP too
                "--skip-test-db",
            ],
            capture_output=True,
            text=True,
            timeout=START_DEADLINE_S,
            check=False,
        )
        if install.returncode != 0:
            raise SlurmUnavailable(f"mariadb-install-db failed: {install.stderr.strip()[-300:]}")
        self._spawn(
            "mariadbd",
            "--no-defaults",
            f"--datadir={data}",
            "--user=root",
            f"--socket={self.root}/mariadb.sock",
            "--bind-address=127.0.0.1",
            f"--port={self.db_port}",
            f"--pid-file={self.root}/mariadb.pid",
            f"--log-error={self.root}/log/mariadbd.log",
        )
        self._wait("mariadbd", lambda: _listening(self.db_port), deadline)
        self._spawn("slurmdbd", "-D")
        self._wait("slurmdbd", lambda: _listening(self.dbd_port), deadline)
        self._wait("the cluster's registration", self._register_cluster, deadline)

    def _register_cluster(self) -> bool:
        """Add this cluster to the accounting (slurmctld will not start without it); True once it is there."""
        self.command("sacctmgr", "-i", "add", "cluster", "redline")
        listed = self.command("sacctmgr", "-n", "-P", "list", "cluster", "format=cluster")
        return "redline" in listed.stdout.split()

    # ---- daemons ----

    def _spawn(self, name: str, *args: str) -> None:
        log = (self.root / "log" / f"{name}.out").open("ab")
        self._daemons[name] = subprocess.Popen(
            [_program(name) or name, *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ | self.env,
            start_new_session=True,
        )
        log.close()

    def _log_tail(self, name: str) -> str:
        texts = []
        for path in (self.root / "log" / f"{name}.log", self.root / "log" / f"{name}.out"):
            with contextlib.suppress(OSError):
                texts += path.read_text(errors="replace").splitlines()
        lines = [line for line in texts if "error" in line or "fatal" in line] or texts
        return " | ".join(lines[-3:])

    def _wait(self, what: str, ready, deadline: float) -> None:
        """Poll ``ready()`` until it holds; fail at once, with the daemon's last log lines, if a daemon died."""
        while not ready():
            for name, process in self._daemons.items():
                if process.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited ({process.returncode}): {self._log_tail(name)}")
            if time.monotonic() > deadline:
                tails = "; ".join(f"{name}: {self._log_tail(name)}" for name in self._daemons)
                raise SlurmUnavailable(f"{what} not ready within {START_DEADLINE_S:.0f} s: {tails}")
            time.sleep(0.2)

    def command(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run one of Slurm's commands against this cluster."""
        return subprocess.run(
            [_program(argv[0]) or argv[0], *argv[1:]],
            capture_output=True,
            text=True,
            env=os.environ | self.env,
            timeout=timeout,
            check=False,
        )

    def _node_state(self) -> str:
        result = self.command("sinfo", "-h", "-n", NODE, "-o", "%T")
        return result.stdout.strip() if result.returncode == 0 else ""

    def start(self) -> LocalSlurm:
        reason = unavailable_reason(self.accounting)
        if reason:
            raise SlurmUnavailable(reason)
        self._write_config()
        munge = self.root / "munge"
        deadline = time.monotonic() + START_DEADLINE_S
        try:
            self._spawn(
                "munged",
                "--foreground",
                "--force",  # the key's directory is the test's, not /etc/munge
                f"--socket={munge}/munge.socket",
                f"--key-file={munge}/munge.key",
                f"--log-file={self.root}/log/munged.log",
                f"--pid-file={munge}/munged.pid",
                f"--seed-file={munge}/munged.seed",
            )
            self._wait("munged", (munge / "munge.socket").exists, deadline)
            if self.accounting:
                self._start_accounting(deadline)
            self._spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
            self._wait("slurmctld", lambda: self.command("scontrol", "ping").stdout.count("UP") > 0, deadline)
            self._spawn("slurmd", "-D", "-N", NODE, "-f", str(self.conf))
            self._wait("the node", lambda: self._node_state() == "idle", deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _stray_processes(self) -> list[int]:
        """Processes still carrying this cluster's SLURM_CONF: slurmstepd and the jobs it started."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        found.append(int(entry.name))
        return found

    def stop(self) -> None:
        """Cancel what is left, stop the daemons (SIGTERM, then SIGKILL) and end the jobs' processes."""
        if "slurmctld" in self._daemons and self._daemons["slurmctld"].poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                self.command("scancel", "--user", "root", timeout=30)
        deadline = time.monotonic() + STOP_DEADLINE_S
        for name in ("slurmd", "slurmctld", "slurmdbd", "mariadbd", "munged"):
            process = self._daemons.pop(name, None)
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pid in self._stray_processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
