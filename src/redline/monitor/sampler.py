"""The sampler behind `redline monitor`: one ``Sample`` of every GPU, the host and the training steps per call.

``Sampler.sample()`` never raises and never blocks for long: whatever cannot be read is None, with a note
in ``Sample.notes`` the first time that problem is seen (not every second). It is built to run for days
next to a training job, at 1 s on 8 GPUs for well under 1% of one core and flat memory: NVML is read
through ``redline.hw.nvml.live.GpuStateReader`` (what never changes is read once), the kernel log only every
30 s (it is a subprocess), and every piece of state it keeps is bounded (previous counter readings, one
offset per metrics file, a capped set of notes already given).

NVML can vanish under a running monitor: a driver upgrade or reload, a GPU reset, Xid 79 on every GPU.
Then the GPUs it knew are reported ``lost`` while host and step samples carry on, and NVML is started
again at most every ``reinit_interval_s`` until it answers; GPU samples resume from there (rates restart,
since the driver's counters restarted too). Where the bindings are missing or NVML never starts (a
machine without an NVIDIA driver) ``Sample.gpus`` is empty and a note says why.

Rates (bytes per second, CPU ratios) are differences of cumulative counters between two ``sample()``
calls, so they are None on the first. ``run_sampler`` calls ``sample()`` on a fixed grid in a thread.
"""

from __future__ import annotations

import glob
import json
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from stat import S_ISREG
from typing import Any

from redline.errors import one_line
from redline.files import kind_of
from redline.hw.host_state import HostReader, HostReading, host_sample, read_host
from redline.hw.kernel_log import count_xids_by_device, read_kernel_log
from redline.hw.nvml.live import GpuStateReader
from redline.hw.nvml.query import NvmlGone, load_bindings
from redline.hw.sample import GpuSample
from redline.hw.sysfs import SysFs
from redline.monitor.sample import Sample, StepSample

REINIT_INTERVAL_S = 10.0  # how often to try starting NVML again while it is gone
XID_INTERVAL_S = 30.0  # how often to read the kernel log for Xids (dmesg is a subprocess)
MAX_STEP_BYTES_PER_POLL = 1 << 20  # per metrics file and sample: a backlog is read over several samples
MAX_REMEMBERED_NOTES = 512  # problems already reported; the oldest is forgotten (and reported again) past this


# ------------------------------------------------------------------------------------------- steps


@dataclass
class _TailedFile:
    identity: tuple[int, int]  # (st_dev, st_ino): a different pair at the same path is a new file
    offset: int  # where the next unread line starts
    resync: bool = False  # offset may be mid-line: drop everything up to the next newline first


class StepTail:
    """Follows the runtime's JSON-lines step files (redline.runtime.metrics: one per rank) as they grow.

    ``paths`` are files or patterns: ``{rank}`` (as in the runtime's ``metrics_path``) and glob wildcards
    match every rank's file; a pattern is expanded again on every poll (as ``tail -F`` follows a name), so
    files that appear later (a run started after the monitor, a restarted run's new files) are picked up,
    and read from their start; a pattern that matches nothing yet is no note, only a run still to come.
    Files already there on the first poll are followed from their end (``from_start=False``, as ``tail -f``
    does): the monitor reports steps finished while it watches, not a backlog of a run's history.

    Each poll reads only complete lines (a line the runtime is still writing waits for the next poll), at
    most ``max_bytes`` per file (a backlog comes over several polls), and starts a file again from the top
    when it was truncated or replaced (rotated). Lines that are not step records are skipped with a note.
    """

    def __init__(
        self,
        paths: Iterable[str | os.PathLike[str]],
        from_start: bool = False,
        max_bytes: int = MAX_STEP_BYTES_PER_POLL,
    ) -> None:
        self.patterns = [str(p).replace("{rank}", "*") for p in paths]
        self.from_start = from_start
        self.max_bytes = max_bytes
        self._files: dict[str, _TailedFile] = {}
        self._polled = False

    def poll(self, notes: list[str]) -> list[StepSample]:
        """The steps written since the previous poll, file by file in path order."""
        paths = self._expand()
        first = not self._polled
        self._polled = True
        steps: list[StepSample] = []
        for path in paths:
            steps.extend(self._read(path, first, notes))
        for gone in self._files.keys() - set(paths):  # deleted or no longer matching: forget it
            del self._files[gone]
        return steps

    def _expand(self) -> list[str]:
        found: set[str] = set()
        for pattern in self.patterns:
            # nothing there is no problem of the moment: a run not started yet, which the monitor waits for
            # (it says where it watches when it starts, and on screen until the first step comes)
            found.update(glob.glob(pattern) if glob.has_magic(pattern) else [pattern] * os.path.exists(pattern))
        return sorted(found)

    def _read(self, path: str, first_poll: bool, notes: list[str]) -> list[StepSample]:
        try:
            stat = os.stat(path)
        except OSError:
            self._files.pop(path, None)
            return []
        if not S_ISREG(stat.st_mode):  # a FIFO would block the open, a device read without end
            notes.append(f"steps: {path} is {kind_of(stat.st_mode)}, not a file: not read")
            return []
        identity = (stat.st_dev, stat.st_ino)
        tailed = self._files.get(path)
        if tailed is None:
            tailed = self._start(path, identity, stat.st_size, at_end=first_poll and not self.from_start)
            self._files[path] = tailed
        elif tailed.identity != identity or stat.st_size < tailed.offset:
            notes.append(f"steps: {path} was truncated or replaced; reading it again from the start")
            tailed.identity, tailed.offset, tailed.resync = identity, 0, False
        if stat.st_size <= tailed.offset:
            return []
        try:
            with open(path, "rb") as f:
                f.seek(tailed.offset)
                data = f.read(min(stat.st_size - tailed.offset, self.max_bytes))
        except OSError as exc:
            notes.append(f"steps: cannot read {path}: {exc.strerror or exc}")
            return []
        return self._parse(path, tailed, data, notes)

    @staticmethod
    def _start(path: str, identity: tuple[int, int], size: int, at_end: bool) -> _TailedFile:
        if not at_end or size == 0:
            return _TailedFile(identity, 0)
        # following from the end: if the file ends mid-line, the rest of that line is not a whole record
        try:
            with open(path, "rb") as f:
                f.seek(size - 1)
                ends_a_line = f.read(1) == b"\n"
        except OSError:
            ends_a_line = False
        return _TailedFile(identity, size, resync=not ends_a_line)

    def _parse(self, path: str, tailed: _TailedFile, data: bytes, notes: list[str]) -> list[StepSample]:
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) >= self.max_bytes:  # one "line" longer than a poll may read: not the runtime's
                notes.append(f"steps: {path} has a line over {self.max_bytes} bytes; skipped")
                tailed.offset += len(data)
                tailed.resync = True
            return []  # else: a line still being written
        tailed.offset += end + 1
        lines = data[:end].split(b"\n")
        if tailed.resync:
            lines, tailed.resync = lines[1:], False
        steps = []
        for line in lines:
            step = _step(line)
            if step is not None:
                steps.append(step)
            elif line.strip():
                notes.append(f"steps: {path} has lines that are not step records; skipped")
        return steps


_STEP_NUMBERS = ("time_s", "data_s", "compute_s", "optimizer_s")


def _step(line: bytes) -> StepSample | None:
    """A StepSample from one JSON line, or None where it is not a step record."""
    try:
        record = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        return None
    if not isinstance(record, dict):
        return None
    if not all(_is_int(record.get(k)) for k in ("rank", "step")):
        return None
    if not all(_is_number(record.get(k)) for k in _STEP_NUMBERS):
        return None
    try:
        return StepSample.from_record(record)
    except TypeError:
        return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# ------------------------------------------------------------------------------------------- notes


class _OnceNotes:
    """Lets each note through once: a problem that lasts is reported when it starts, not every second.
    Bounded: past ``limit`` remembered notes the oldest is forgotten."""

    def __init__(self, limit: int = MAX_REMEMBERED_NOTES) -> None:
        self.limit = limit
        self._seen: OrderedDict[str, None] = OrderedDict()

    def new(self, notes: Iterable[str]) -> list[str]:
        out = []
        for note in notes:
            if note in self._seen:
                continue
            self._seen[note] = None
            if len(self._seen) > self.limit:
                self._seen.popitem(last=False)
            out.append(note)
        return out


# ------------------------------------------------------------------------------------------- sampler


class Sampler:
    """One ``Sample`` per ``sample()`` call; see the module docstring.

    ``nvml``: the pynvml module (imported here when None; tests pass a fake). ``indices``: NVML indices
    of the GPUs to watch (None: all). ``step_paths``: the runtime's metrics files or patterns (see
    ``StepTail``); ``steps_from_start``: also report steps already in files present at the first sample.
    ``clock``: Unix time for ``Sample.time``; ``monotonic``: seconds for rates and retry timing.
    ``host``: returns a ``HostReading`` (``read_host``, through psutil, by default; None: no host
    figures). ``kernel_log``: returns the kernel log text or None (``dmesg`` by default; None: no Xids).
    ``proc_root``: where /proc is, for the names and owners of GPU processes.
    """

    def __init__(
        self,
        nvml: Any | None = None,
        indices: Iterable[int] | None = None,
        step_paths: Iterable[str | os.PathLike[str]] = (),
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        host: HostReader | None = read_host,
        kernel_log: Callable[[], str | None] | None = read_kernel_log,
        proc_root: str | os.PathLike[str] = "/",
        steps_from_start: bool = False,
        reinit_interval_s: float = REINIT_INTERVAL_S,
        xid_interval_s: float = XID_INTERVAL_S,
    ) -> None:
        self.indices = None if indices is None else list(indices)
        self.clock = clock
        self.monotonic = monotonic
        self.host = host
        self.kernel_log = kernel_log
        self.reinit_interval_s = reinit_interval_s
        self.xid_interval_s = xid_interval_s
        self.steps = StepTail(step_paths, from_start=steps_from_start)
        self._fs = SysFs(proc_root)
        self._once = _OnceNotes()
        self._pending: list[str] = []  # notes to give with the next sample, before deduplication
        self._transitions: list[str] = []  # NVML lost / back: given every time they happen
        self._nvml = nvml if nvml is not None else self._import_pynvml()
        self._reader: GpuStateReader | None = None
        self._driver_version: str | None = None
        self._retry_at: float | None = None  # monotonic time of the next NVML start; None: now
        self._lost_since: float | None = None  # monotonic time NVML went away under a running reader
        self._known: list[GpuSample] = []  # the last GPUs read: what an outage reports as lost
        self._xids: dict[str, dict[str, int]] | None = None
        self._xids_at: float | None = None
        self._host_previous: HostReading | None = None
        self._host_previous_at: float | None = None

    @property
    def driver_version(self) -> str | None:
        """The NVIDIA driver's version as NVML reports it ("550.54.15"), the last one seen; None where NVML
        never answered. Asked before the first sample, it starts NVML (as that sample would have)."""
        if self._reader is None and self._retry_at is None and self._nvml is not None:
            self._open(self.monotonic(), self._pending)
        return self._driver_version

    def _import_pynvml(self) -> Any | None:
        nvml = load_bindings()
        if nvml is None:
            self._pending.append("no GPU telemetry: nvidia-ml-py (pynvml) is not installed")
        return nvml

    # ------------------------------------------------------------------------------------ sample

    def sample(self) -> Sample:
        """Read everything once; never raises."""
        now = self.monotonic()
        sample = Sample(time=self.clock())
        notes = self._pending
        self._pending = []
        for what, part in (("GPUs", self._sample_gpus), ("host", self._sample_host), ("steps", self._sample_steps)):
            try:
                part(sample, now, notes)
            except Exception as exc:  # a bug here must cost one part of one sample, not the monitor
                notes.append(f"sampling the {what} failed: {one_line(exc)}")
        sample.notes = self._transitions + self._once.new(notes)
        self._transitions = []
        return sample

    def _sample_gpus(self, sample: Sample, now: float, notes: list[str]) -> None:
        if self._nvml is None:
            return
        if self._reader is None and (self._retry_at is None or now >= self._retry_at):
            self._open(now, notes)
        if self._reader is None:
            sample.gpus = [_lost_copy(g) for g in self._known]
            return
        reader = self._reader
        try:
            sample.gpus = reader.read(now, self._xid_counts(now, notes))
        except NvmlGone as exc:
            self._drop(now, f"NVML stopped answering ({exc.message})")
            sample.gpus = [_lost_copy(g) for g in self._known]
            return
        finally:
            notes.extend(reader.notes)
            reader.notes.clear()
        if sample.gpus and all(g.lost for g in sample.gpus):
            # every GPU fell off together: the driver must be reloaded, and only a fresh NVML sees it back
            self._drop(now, "every GPU answers GPU_IS_LOST")
        elif self._lost_since is not None:
            self._transitions.append(
                f"NVML is back after {now - self._lost_since:.0f} s with {len(sample.gpus)} GPUs; "
                "their counters restarted with the driver"
            )
            self._lost_since = None
        self._known = sample.gpus

    def _open(self, now: float, notes: list[str]) -> None:
        try:
            self._reader = GpuStateReader.open(self._nvml, self.indices, fs=self._fs)
        except NvmlGone as exc:
            self._retry_at = now + self.reinit_interval_s
            notes.append(f"no GPU telemetry: {exc.message} (trying again every {self.reinit_interval_s:g} s)")
            return
        except Exception as exc:  # a binding or fake that fails in a way NVML does not: same treatment
            self._retry_at = now + self.reinit_interval_s
            notes.append(f"no GPU telemetry: starting NVML failed: {one_line(exc)}")
            return
        self._driver_version = self._reader.driver_version or self._driver_version
        if not self._reader.gpus:
            notes.append("NVML started but found no GPUs to watch")

    def _drop(self, now: float, why: str) -> None:
        """Give up the reader: GPUs read as lost until a new NVML start (no sooner than reinit_interval_s)."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._retry_at = now + self.reinit_interval_s
        if self._lost_since is None:
            self._lost_since = now
            self._transitions.append(
                f"{why}: the GPUs read as lost; restarting NVML every {self.reinit_interval_s:g} s until it answers"
            )

    def _xid_counts(self, now: float, notes: list[str]) -> dict[str, dict[str, int]] | None:
        """Xid counts per PCI device, from a kernel log read at most every ``xid_interval_s``."""
        if self.kernel_log is None:
            return None
        if self._xids_at is None or now - self._xids_at >= self.xid_interval_s:
            self._xids_at = now
            text = self.kernel_log()
            if text is None:
                notes.append("Xid counts unavailable: the kernel log is not readable here (dmesg)")
                self._xids = None
            else:
                self._xids = count_xids_by_device(text)
        return self._xids

    def _sample_host(self, sample: Sample, now: float, notes: list[str]) -> None:
        if self.host is None:
            return
        reading = self.host()
        notes.extend(reading.notes)
        elapsed = None if self._host_previous_at is None else now - self._host_previous_at
        sample.host = host_sample(self._host_previous, reading, elapsed)
        self._host_previous, self._host_previous_at = reading, now

    def _sample_steps(self, sample: Sample, now: float, notes: list[str]) -> None:
        sample.steps = self.steps.poll(notes)

    # ------------------------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Shut NVML down (the sampler can be used again: the next sample starts it anew)."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._retry_at = None

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lost_copy(gpu: GpuSample) -> GpuSample:
    return GpuSample(index=gpu.index, uuid=gpu.uuid, name=gpu.name, lost=True)


def run_sampler(
    sampler: Sampler,
    interval_s: float,
    on_sample: Callable[[Sample], None],
    stop_event: threading.Event,
    monotonic: Callable[[], float] = time.monotonic,
) -> None:
    """Call ``on_sample(sampler.sample())`` every ``interval_s`` until ``stop_event`` is set.

    Samples land on a fixed grid (start + k x interval) rather than "interval after the previous one
    finished", so the time a sample takes does not add up into drift; a sample that overruns its slot
    skips the slots it missed instead of firing a burst to catch up. Returns promptly once ``stop_event``
    is set; an exception from ``on_sample`` ends the loop and propagates.
    """
    if interval_s <= 0:
        raise ValueError(f"interval_s must be positive, not {interval_s}")
    deadline = monotonic()
    while not stop_event.is_set():
        on_sample(sampler.sample())
        deadline += interval_s
        now = monotonic()
        if deadline <= now:
            missed = math.floor((now - deadline) / interval_s) + 1
            deadline += missed * interval_s
        stop_event.wait(deadline - now)
