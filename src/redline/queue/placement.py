"""Where a job may run: the GPUs (and MIG instances) with room for it, as NVML sees them now.

A device's room is what NVML says is free, less what the queue's running jobs have reserved and do not use
yet: a job that asked for 20 GiB and holds 3 GiB so far will take 17 more, and a process the queue did not
start (a notebook, a hand-started run) is in NVML's figure from its first byte. A job that does not say
its memory takes its devices whole, as task-spooler's `ts -G` and Slurm's gres do. Devices that are lost
or failing are drained: nothing new goes there.

Several devices for one job come from one NVLink domain where one has enough, else one NUMA node, else
anywhere (said). Pack fills the fullest device that fits (it keeps whole devices free for large jobs);
spread takes the emptiest (a job gets the most headroom).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from redline.units import fmt_bytes

if TYPE_CHECKING:
    from redline.hw.snapshot import GpuProcess, GpuSection

POLICIES = ("pack", "spread")


@dataclass(frozen=True)
class Slot:
    """A device a job can be given."""

    uuid: str  # GPU-... or MIG-...: what CUDA_VISIBLE_DEVICES names it by
    index: int  # nvidia-smi's index
    total_bytes: int
    used_bytes: int  # NVML's figure now: every process's, the queue's jobs' and others'
    numa_node: int | None = None
    domain: str | None = None  # the NVLink domain (GPUs that reach each other over NVLink share one)
    processes: tuple[tuple[int, int], ...] = ()  # (pid, bytes) of every compute process NVML lists on it
    ours: frozenset[int] = frozenset()  # the pids of the queue's jobs (and their children)
    drained: str = ""  # why nothing new may run here: "lost", "failing: ..."
    pci_bus_id: str | None = None  # '0000:3b:00.0': what the kernel log's Xid lines name it by
    mig: str = ""  # a MIG instance of GPU ``index``: its profile ("3g.40gb"); "" for a whole GPU

    @property
    def label(self) -> str:
        """How messages name it: "GPU 3", or "GPU 3 MIG 3g.40gb"."""
        return f"GPU {self.index}" + (f" MIG {self.mig}" if self.mig else "")

    @property
    def foreign(self) -> tuple[tuple[int, int], ...]:
        """(pid, bytes) of the processes on it the queue did not start."""
        return tuple((pid, used) for pid, used in self.processes if pid not in self.ours)

    def using(self, pids: set[int]) -> int:
        """Bytes the processes ``pids`` hold on it."""
        return sum(used for pid, used in self.processes if pid in pids)


@dataclass(frozen=True)
class Reservation:
    """What a running job holds on one device."""

    job: str
    uuid: str
    reserved_bytes: int  # the job's memory on the device (its whole total when it did not say)
    using_bytes: int = 0  # what NVML counts for the job's processes there now
    exclusive: bool = False


@dataclass(frozen=True)
class Request:
    gpus: int
    memory_bytes: int | None = None  # per device; None: whole devices
    exclusive: bool = False

    @property
    def whole(self) -> bool:
        return self.exclusive or self.memory_bytes is None


@dataclass(frozen=True)
class Placement:
    uuids: tuple[str, ...]
    reserved_bytes: tuple[int, ...]  # per device, in the order of uuids
    note: str = ""  # a compromise it made: devices across NUMA nodes or outside one NVLink domain


@dataclass
class Devices:
    """The devices and what the running jobs hold on them: the state placement decides on."""

    slots: list[Slot]
    reservations: list[Reservation] = field(default_factory=list)

    def room(self, slot: Slot) -> int:
        """Bytes a new job may count on: free now, less what running jobs reserved and have not taken yet."""
        pending = sum(max(0, r.reserved_bytes - r.using_bytes) for r in self.reservations if r.uuid == slot.uuid)
        return slot.total_bytes - slot.used_bytes - pending

    def why_not(self, slot: Slot, request: Request) -> str:
        """Why ``request`` cannot have a share of ``slot`` now ("" when it can)."""
        held = [r for r in self.reservations if r.uuid == slot.uuid]
        if slot.drained:
            return f"{slot.label} is drained ({slot.drained})"
        if slot.mig and request.gpus > 1:
            return f"{slot.label} is a MIG instance, and a CUDA process sees one at most"
        if any(r.exclusive for r in held):
            return f"{slot.label} is held whole by job {next(r.job for r in held if r.exclusive)}"
        if request.whole:
            if held:
                return f"{slot.label} runs job {held[0].job}"
            if slot.foreign:
                pid, used = slot.foreign[0]
                return f"{slot.label} has a process the queue did not start (pid {pid}, {fmt_bytes(used)})"
            return ""
        room = self.room(slot)
        assert request.memory_bytes is not None
        if room < request.memory_bytes:
            return f"{slot.label} has {fmt_bytes(max(room, 0))} free of the {fmt_bytes(request.memory_bytes)} asked"
        return ""

    def place(self, request: Request, policy: str = "pack") -> Placement | str:
        """The devices for ``request`` and what it reserves on each, or why there are none now."""
        if request.gpus == 0:
            return Placement((), ())
        fits = [s for s in self.slots if not self.why_not(s, request)]
        if len(fits) < request.gpus:
            reasons = [self.why_not(s, request) for s in self.slots if self.why_not(s, request)]
            if len(self.slots) < request.gpus:
                return more_gpus_than_here(request.gpus, len(self.slots))
            return "; ".join(reasons[:3]) or "no GPU"
        chosen, note = _choose(fits, request.gpus, key=lambda s: self.room(s), pack=policy == "pack")
        reserved = tuple(s.total_bytes if request.whole else request.memory_bytes or 0 for s in chosen)
        return Placement(tuple(s.uuid for s in chosen), reserved, note)

    def with_job(self, job: str, placement: Placement, exclusive: bool) -> Devices:
        """These devices once ``job`` holds ``placement`` (nothing used yet)."""
        added = [
            Reservation(job, uuid, size, 0, exclusive)
            for uuid, size in zip(placement.uuids, placement.reserved_bytes, strict=True)
        ]
        return Devices(self.slots, [*self.reservations, *added])

    def without_job(self, job: str) -> Devices:
        """These devices once ``job`` has ended: its reservations gone and what it used freed."""
        used = {r.uuid: r.using_bytes for r in self.reservations if r.job == job}
        slots = [replace(s, used_bytes=max(0, s.used_bytes - used.get(s.uuid, 0))) for s in self.slots]
        return Devices(slots, [r for r in self.reservations if r.job != job])


def more_gpus_than_here(asked: int, here: int, source: str = "") -> str:
    """Why a job that asks ``asked`` GPUs (``source``: where the number came from, said after it) cannot run on
    a machine of ``here``, and how to ask for fewer: a machine without a GPU runs jobs that ask none, on its
    CPUs."""
    fewer = "`--gpus 0` runs it on the CPU" if here == 0 else f"ask --gpus {here} or fewer (`--gpus 0`: on the CPU)"
    return f"asks {asked} GPU{'s' if asked > 1 else ''}{source}; this machine has {here}: {fewer}"


def _choose(fits: Sequence[Slot], count: int, *, key: Callable[[Slot], int], pack: bool) -> tuple[list[Slot], str]:
    """``count`` of the fitting devices: within one NVLink domain where one has enough, else one NUMA node, else
    any; pack takes the least room first, spread the most (ties by index)."""

    def order(slots: Iterable[Slot]) -> list[Slot]:
        return sorted(slots, key=lambda s: ((key(s) if pack else -key(s)), s.index))

    if count == 1:
        return order(fits)[:1], ""
    for attribute in ("domain", "numa_node"):
        groups: dict[object, list[Slot]] = {}
        for slot in fits:
            value = getattr(slot, attribute)
            if value is not None:
                groups.setdefault(value, []).append(slot)
        enough = [order(group)[:count] for group in groups.values() if len(group) >= count]
        if enough:
            # pack: the group whose chosen devices have the least room; spread: the most
            best = min(enough, key=lambda g: (sum(key(s) for s in g) * (1 if pack else -1), g[0].index))
            return best, ""
    chosen = order(fits)[:count]
    return chosen, "its GPUs share no NVLink domain or NUMA node"


def slots_from(section: GpuSection, ours: set[int]) -> list[Slot]:
    """The devices of a probe's GPU section: each GPU, or, in MIG mode, each of its MIG instances. The processes
    whose pids are in ``ours`` (the queue's jobs and their children) are not foreign. A GPU that fell off the bus,
    or whose NVML calls fail with health errors, is drained, with its instances."""
    domains = _nvlink_domains(section)
    slots = []
    for gpu in section.gpus:
        drained = "lost" if gpu.lost else ""
        if not drained and gpu.health_errors:
            drained = "failing: " + ", ".join(f"{call} {error}" for call, error in sorted(gpu.health_errors.items()))
        whole = Slot(
            uuid=gpu.uuid or f"GPU-index-{gpu.index}",
            index=gpu.index,
            total_bytes=gpu.memory_total_bytes or 0,
            used_bytes=gpu.memory_used_bytes or 0,
            numa_node=gpu.numa_node,
            domain=domains.get(gpu.index),
            processes=_compute(gpu.processes),
            ours=frozenset(ours),
            drained=drained,
            pci_bus_id=gpu.pci_bus_id,
        )
        if not gpu.mig_mode:
            slots.append(whole)
            continue
        for instance in gpu.mig_devices:  # no NVLink between MIG instances: no domain
            profile = (instance.name or "").rpartition(" MIG ")[2] or f"slot {instance.slot}"
            slots.append(
                replace(
                    whole,
                    uuid=instance.uuid or f"MIG-{whole.uuid}-{instance.slot}",
                    total_bytes=instance.memory_total_bytes or 0,
                    used_bytes=instance.memory_used_bytes or 0,
                    domain=None,
                    processes=_compute(instance.processes),
                    mig=profile,
                )
            )
    return slots


def _compute(processes: Iterable[GpuProcess] | None) -> tuple[tuple[int, int], ...]:
    return tuple((p.pid, p.used_memory_bytes or 0) for p in processes or () if p.kind == "compute")


def _nvlink_domains(section: GpuSection) -> dict[int, str]:
    """Each GPU's NVLink domain: GPUs joined by active links, directly or through NVSwitches, share one (its
    lowest member's index, as a name). A GPU without an active link has none."""
    parent = {g.index: g.index for g in section.gpus}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    index_of = {g.pci_bus_id: g.index for g in section.gpus if g.pci_bus_id}
    switches: dict[str, int] = {}
    linked = set()
    for gpu in section.gpus:
        for link in gpu.nvlinks or ():
            if not link.active or not link.peer_pci_bus_id:
                continue
            linked.add(gpu.index)
            peer = index_of.get(link.peer_pci_bus_id)
            if peer is None:  # an NVSwitch: every GPU on a switch reaches every other
                peer = switches.setdefault(link.peer_pci_bus_id, gpu.index)
            linked.add(peer)
            parent[root(gpu.index)] = root(peer)
    return {i: f"nvlink-{min(j for j in parent if root(j) == root(i))}" for i in linked}
