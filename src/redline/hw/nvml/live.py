"""The live GPU reader: ``GpuStateReader``, the one reader of what changes on a GPU while it works.

`redline monitor` reads every GPU through it once a second for days (redline.monitor.sampler); the bench
reads clocks, power and temperature through it ten times a second while a measurement runs
(redline.bench.sampler, with ``groups`` naming only those). Every quantity comes from a ``Device``
(device.py); this module adds what only a reader that asks again and again needs: what never changes is
read once, rates are taken from cumulative counters between two reads, GPM samples are kept, and a
blocking PCIe throughput reading is spread over the GPUs.

Queries are ``LiveQuery``s: an error that says NVML itself went away raises ``NvmlGone`` (the caller
closes the reader and opens another later), and a call answered "not supported" is not asked again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pwd
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from redline.errors import one_line
from redline.hw.kernel_log import device_xids
from redline.hw.nvml.device import Device
from redline.hw.nvml.query import GpuLost, LiveQuery, NvmlGone, describe_error, init_error
from redline.hw.sample import GpuProcess, GpuSample
from redline.hw.sysfs import SysFs

# NVML field ids of cumulative counters read with nvmlDeviceGetFieldValues; the numbers are part of NVML's
# ABI, so they serve where an older binding lacks the name. (counter, constant, fallback id, bytes per unit)
_PCIE_FIELDS = (
    ("pcie_tx", "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", 197, 1),
    ("pcie_rx", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", 198, 1),
)
_NVLINK_FIELDS = (
    ("nvlink_tx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", 138, 1024),  # KiB of payload, all links
    ("nvlink_rx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", 139, 1024),
)
# scopeId for NVLink throughput fields: a link number, or UINT_MAX for the sum over every link
_ALL_LINKS = 0xFFFFFFFF
# nvmlFieldValue_t.valueType -> the member of the value union that holds it
_FIELD_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
# 64-bit value types: a 32-bit byte counter wraps several times a second on a busy PCIe Gen5 link, so rates
# are only taken from counters at least this wide
_WIDE_VALUE_TYPES = frozenset({2, 3, 4})
# Hopper+ GPM metrics: (name in GpuSample, pynvml constant, its value in nvml.h)
_GPM_METRICS = (
    ("sm_activity_ratio", "NVML_GPM_METRIC_SM_UTIL", 2),
    ("tensor_activity_ratio", "NVML_GPM_METRIC_ANY_TENSOR_UTIL", 5),
)
_GPM_CALLS = ("nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlGpmMetricsGet")


def _field_value(nvml: Any, value: Any, wide_only: bool = False) -> float | None:
    """The number in one nvmlFieldValue_t, or None where NVML answered an error for that field."""
    if value.nvmlReturn != getattr(nvml, "NVML_SUCCESS", 0):
        return None
    if wide_only and value.valueType not in _WIDE_VALUE_TYPES:
        return None
    member = _FIELD_VALUE_MEMBERS.get(value.valueType)
    return None if member is None else getattr(value.value, member)


@functools.lru_cache(maxsize=256)
def _user_name(uid: int) -> str:
    """The login name of a uid (cached: a directory lookup through NSS can be slow); the number where the
    name is unknown here, as in a container whose /etc/passwd lacks the host's users."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class _Gpm:
    """Hopper+ GPU Performance Monitoring: SM and tensor-core activity between two GPM samples.

    NVML's utilisation says only that a kernel ran; GPM says how busy the SMs and tensor cores were. A
    metric needs two samples, so the first read gives None; the two NVML sample buffers are reused
    (alternately "previous" and "current") so reading allocates nothing.
    """

    def __init__(self, q: LiveQuery, handle: Any, samples: tuple[Any, Any]) -> None:
        self.q = q
        self.handle = handle
        self.previous, self.current = samples
        self.have_previous = False
        self.request = q.nvml.c_nvmlGpmMetricsGet_t()
        self.metric_ids = [q.const(constant, fallback) for _, constant, fallback in _GPM_METRICS]

    @classmethod
    def open(cls, q: LiveQuery, handle: Any) -> _Gpm | None:
        """GPM for this GPU, or None where the binding, driver or GPU lacks it (anything before Hopper)."""
        nvml = q.nvml
        if not all(hasattr(nvml, name) for name in (*_GPM_CALLS, "c_nvmlGpmMetricsGet_t")):
            return None
        support = q("nvmlGpmQueryDeviceSupport", handle)
        if support is None or not support.isSupportedDevice:
            return None
        first = q("nvmlGpmSampleAlloc")
        second = q("nvmlGpmSampleAlloc") if first is not None else None
        if first is None or second is None:
            _free_gpm_samples(nvml, first)
            return None
        return cls(q, handle, (first, second))

    def read(self) -> dict[str, float | None]:
        """{GpuSample field: ratio or None}; all None on the first read and after a failed one."""
        out: dict[str, float | None] = {name: None for name, _, _ in _GPM_METRICS}
        if self.q("nvmlGpmSampleGet", self.handle, self.current) is None:
            self.have_previous = False
            return out
        if self.have_previous:
            out.update(self._metrics())
        self.previous, self.current = self.current, self.previous
        self.have_previous = True
        return out

    def _metrics(self) -> dict[str, float | None]:
        request = self.request
        request.version = self.q.const("NVML_GPM_METRICS_GET_VERSION", 1)
        request.numMetrics = len(self.metric_ids)
        request.sample1 = self.previous
        request.sample2 = self.current
        for i, metric_id in enumerate(self.metric_ids):
            request.metrics[i].metricId = metric_id
        if self.q("nvmlGpmMetricsGet", request) is None:
            return {}
        success = self.q.const("NVML_SUCCESS", 0)
        out: dict[str, float | None] = {}
        for i, (name, _, _) in enumerate(_GPM_METRICS):
            metric = request.metrics[i]
            # NVML gives percentages; clamp the rounding noise that can land a hair outside 0-100
            out[name] = min(max(metric.value / 100, 0.0), 1.0) if metric.nvmlReturn == success else None
        return out

    def close(self) -> None:
        _free_gpm_samples(self.q.nvml, self.previous, self.current)


def _free_gpm_samples(nvml: Any, *samples: Any) -> None:
    for sample in samples:
        if sample is None:
            continue
        # where NVML is already gone the driver freed them with everything else
        with contextlib.suppress(Exception):
            nvml.nvmlGpmSampleFree(sample)


@dataclass
class _LiveGpu:
    """One GPU a ``GpuStateReader`` reads: its device, what does not change while the driver runs (read
    once, when the reader opens), and the previous counter readings that rates are taken from."""

    index: int
    q: LiveQuery
    device: Device | None = None  # None: NVML counted the GPU but would not open it
    pci_bus_id: str | None = None
    static: GpuSample | None = None  # the fields in _STATIC, which every sample starts from
    # cumulative counters this GPU answers through nvmlDeviceGetFieldValues: (counter, field id, scope, bytes
    # per unit, 64-bit only)
    fields: tuple[tuple[str, int, int, int, bool], ...] = ()
    counters: dict[str, float] = field(default_factory=dict)  # counter -> last reading (NVML's unit)
    counters_at: float | None = None
    pcie_spot: tuple[float | None, float | None] = (None, None)  # last nvmlDeviceGetPcieThroughput, bytes/s
    gpm: _Gpm | None = None

    @property
    def has_pcie_counters(self) -> bool:
        return any(name == "pcie_tx" for name, *_ in self.fields)

    def lost_sample(self) -> GpuSample:
        if self.static is None:  # lost before its identity was read
            return GpuSample(index=self.index, lost=True)
        return GpuSample(index=self.index, uuid=self.static.uuid, name=self.static.name, lost=True)

    def read_static(self, device: Device) -> None:
        """What does not change while the driver runs, asked once; raises ``GpuLost``."""
        self.pci_bus_id = device.pci_bus_id()
        self.static = GpuSample(index=self.index, **{name: getattr(device, name)() for name in _STATIC})


class GpuStateReader:
    """Everything ``redline monitor`` records about each GPU, read once per sample for as long as it runs.

    ``open`` starts NVML and reads, once, what does not change while the driver runs (identity, maximum
    clocks and link, slowdown temperature, which counters and GPM the GPU supports); each ``read`` then
    makes about twenty NVML calls per GPU, and none for what the GPU said it does not support. Rates
    (PCIe and NVLink bytes per second, GPM activity) come from counters read on successive calls, so
    they are None on the first. ``groups`` names the parts of a ``GpuSample`` to read (``LIVE_GROUPS``;
    None: all of them), for a caller that needs a few of them often.

    PCIe throughput comes from the cumulative byte counters (NVML_FI_DEV_PCIE_COUNT_*_BYTES, r550+
    drivers) where the GPU has them; elsewhere from nvmlDeviceGetPcieThroughput, which blocks about 20 ms
    per direction while it measures, so it is refreshed for one such GPU per ``read`` (round robin) and
    each GPU repeats its last figure in between: on 8 GPUs read every second a figure is up to 8 s old.

    Errors go into ``notes`` ("GPU 3: nvmlDeviceGetPowerUsage: Unknown Error"), which the caller drains;
    ``read`` raises ``NvmlGone`` when NVML as a whole stops answering (the reader is then finished:
    ``close`` it and ``open`` another later). A GPU that answers GPU_IS_LOST is read as ``lost``.
    """

    def __init__(self, nvml: Any, fs: SysFs, groups: Iterable[str] | None = None) -> None:
        self.nvml = nvml
        self.fs = fs
        self.notes: list[str] = []
        self.gpus: list[_LiveGpu] = []
        self.driver_version: str | None = None  # "550.54.15"
        wanted = LIVE_GROUPS if groups is None else frozenset(groups)
        self._groups = tuple((name, read) for name, read in _LIVE_GROUPS if name in wanted)
        self._pcie_turn = 0
        self._closed = False

    @classmethod
    def open(
        cls,
        nvml: Any,
        indices: Iterable[int] | None = None,
        fs: SysFs | None = None,
        groups: Iterable[str] | None = None,
    ) -> GpuStateReader:
        """Start NVML and look up the GPUs (all, or those ``indices`` name, by NVML index).

        Raises ``NvmlGone`` where NVML will not start or cannot count the GPUs; its ``code`` is the
        probe's ``error_code`` ("driver_not_loaded"...), its ``message`` says why in words.
        """
        try:
            nvml.nvmlInit()
        except Exception as exc:
            code, message = init_error(nvml, exc)
            raise NvmlGone(message, code) from None
        reader = cls(nvml, fs or SysFs("/"), groups)
        try:
            reader._discover(indices)
        except BaseException:
            reader.close()
            raise
        return reader

    def _reads(self, group: str) -> bool:
        return any(name == group for name, _ in self._groups)

    def _discover(self, indices: Iterable[int] | None) -> None:
        system = LiveQuery(self.nvml, self.notes, "NVML", self.fs)
        self.driver_version = system("nvmlSystemGetDriverVersion")
        try:
            count = system("nvmlDeviceGetCount")
        except GpuLost:
            count = None
        if count is None:
            raise NvmlGone("NVML started but could not count the GPUs")
        wanted = list(range(count)) if indices is None else sorted(set(indices))
        for index in wanted:
            if not 0 <= index < count:
                self.notes.append(f"GPU {index}: not there (NVML counts {count} GPUs)")
                continue
            self.gpus.append(self._open_gpu(index))

    def _open_gpu(self, index: int) -> _LiveGpu:
        q = LiveQuery(self.nvml, self.notes, f"GPU {index}", self.fs)
        gpu = _LiveGpu(index=index, q=q)
        try:
            handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:
            if isinstance(exc, q.gone):
                raise NvmlGone(f"nvmlDeviceGetHandleByIndex: {describe_error(self.nvml, exc)}") from None
            q.note(f"no NVML handle ({describe_error(self.nvml, exc)}); read as lost")
            return gpu
        gpu.device = Device(q, handle)
        try:
            gpu.read_static(gpu.device)
            if self._reads("counters"):
                gpu.fields = self._supported_fields(q, handle, has_nvlink=gpu.device.nvlink_active(0) is not None)
        except GpuLost:
            return gpu  # read as lost from the first sample on
        if self._reads("gpm"):
            try:
                gpu.gpm = _Gpm.open(q, handle)
            except GpuLost:
                gpu.gpm = None
        return gpu

    def _supported_fields(self, q: LiveQuery, handle: Any, has_nvlink: bool) -> tuple[Any, ...]:
        """The counter fields this GPU answers, each tried alone: a driver that lacks one answers an error
        for that field only, and a binding that cannot pass a scope fails only the NVLink ones."""
        candidates = [(name, q.const(const, fid), 0, unit, True) for name, const, fid, unit in _PCIE_FIELDS]
        if has_nvlink:
            candidates += [(name, q.const(c, fid), _ALL_LINKS, unit, False) for name, c, fid, unit in _NVLINK_FIELDS]
        supported = []
        for candidate in candidates:
            _, field_id, scope, _, wide_only = candidate
            values = q("nvmlDeviceGetFieldValues", handle, [(field_id, scope) if scope else field_id])
            if values is not None and _field_value(self.nvml, values[0], wide_only) is not None:
                supported.append(candidate)
        # a PCIe direction without the other is no use: fall back to the throughput call for both
        if sum(name.startswith("pcie") for name, *_ in supported) == 1:
            supported = [c for c in supported if not c[0].startswith("pcie")]
        return tuple(supported)

    # ---------------------------------------------------------------------------------------- read

    def read(self, now: float, xids: dict[str, dict[str, int]] | None = None) -> list[GpuSample]:
        """One ``GpuSample`` per GPU. ``now``: a monotonic clock in seconds, for rates. ``xids``: Xid counts
        per PCI device as ``kernel_log.count_xids_by_device`` gives them, or None where the log is
        unreadable (then ``xid_total`` is None). Raises ``NvmlGone`` (see the class docstring)."""
        spot = self._pcie_spot_gpu()
        samples = []
        for gpu in self.gpus:
            sample = self._read_gpu(gpu, now, gpu is spot)
            if not sample.lost:
                sample.xid_total = _xid_total(gpu.pci_bus_id, xids)
            samples.append(sample)
        return samples

    def _pcie_spot_gpu(self) -> _LiveGpu | None:
        """The GPU whose blocking PCIe throughput reading is refreshed this time (see the class docstring)."""
        if not self._reads("counters"):
            return None
        without = [g for g in self.gpus if g.device is not None and not g.has_pcie_counters]
        if not without:
            return None
        self._pcie_turn %= len(without)
        gpu = without[self._pcie_turn]
        self._pcie_turn += 1
        return gpu

    def _read_gpu(self, gpu: _LiveGpu, now: float, refresh_pcie_spot: bool) -> GpuSample:
        if gpu.device is None or gpu.static is None:
            return gpu.lost_sample()
        sample = dataclasses.replace(gpu.static, processes=[])
        for what, read in self._groups:
            try:
                read(gpu, gpu.device, sample, now)
            except GpuLost:
                return gpu.lost_sample()
            except NvmlGone:
                raise
            except Exception as exc:  # a binding handing back an unexpected shape: lose this group only
                gpu.q.note(f"reading {what}: {one_line(exc)}")
        if refresh_pcie_spot:
            with contextlib.suppress(GpuLost):  # the next read reports the GPU lost
                gpu.pcie_spot = gpu.device.pcie_throughput_bytes_per_second()
        if self._reads("counters") and not gpu.has_pcie_counters:
            sample.pcie_tx_bytes_per_second, sample.pcie_rx_bytes_per_second = gpu.pcie_spot
        return sample

    def close(self) -> None:
        """Free GPM buffers and shut NVML down; quiet where NVML is already gone."""
        if self._closed:
            return
        self._closed = True
        for gpu in self.gpus:
            if gpu.gpm is not None:
                gpu.gpm.close()
        with contextlib.suppress(Exception):  # NVML gone: nothing left to shut down
            self.nvml.nvmlShutdown()


def _times(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _xid_total(pci_bus_id: str | None, xids: dict[str, dict[str, int]] | None) -> int | None:
    """Xids of this GPU in the kernel log (None where either is unknown)."""
    if pci_bus_id is None or xids is None:
        return None
    return sum(device_xids(pci_bus_id, xids).values())


# Each group fills its part of a GpuSample from the GPU's Device (and, for rates, what it kept from before).
# A GpuSample field and the Device method that reads it have the same name, so most groups are just names.

# read once, when the reader opens
_STATIC = (
    "uuid",
    "name",
    "sm_clock_max_hertz",
    "memory_clock_max_hertz",
    "pcie_link_generation_max",
    "pcie_link_width_max",
    "temperature_slowdown_celsius",
)


def _quantities(*names: str) -> Callable[[_LiveGpu, Device, GpuSample, float], None]:
    """A group that sets each GpuSample field ``names`` lists from the Device method of the same name."""

    def read(gpu: _LiveGpu, d: Device, sample: GpuSample, now: float) -> None:
        for name in names:
            setattr(sample, name, getattr(d, name)())

    return read


def _live_utilization(gpu: _LiveGpu, d: Device, sample: GpuSample, now: float) -> None:
    utilization = d.utilization()
    if utilization is not None:
        sample.utilization_ratio = utilization.kernel_ratio
        sample.memory_bandwidth_ratio = utilization.memory_bandwidth_ratio


def _live_memory(gpu: _LiveGpu, d: Device, sample: GpuSample, now: float) -> None:
    memory = d.memory()
    if memory is not None:
        sample.memory_used_bytes = memory.used_bytes
        sample.memory_total_bytes = memory.total_bytes


def _live_counters(gpu: _LiveGpu, d: Device, sample: GpuSample, now: float) -> None:
    """PCIe and NVLink bytes per second from cumulative counters, all in one nvmlDeviceGetFieldValues."""
    if not gpu.fields:
        return
    request = [(field_id, scope) if scope else field_id for _, field_id, scope, _, _ in gpu.fields]
    values = gpu.q("nvmlDeviceGetFieldValues", d.handle, request)
    readings: dict[str, float] = {}
    if values is not None:
        for (name, _, _, _, wide_only), value in zip(gpu.fields, values, strict=True):
            number = _field_value(gpu.q.nvml, value, wide_only)
            if number is not None:
                readings[name] = number
    rates = _rates(gpu.counters, gpu.counters_at, readings, now)
    gpu.counters, gpu.counters_at = readings, now
    units = {name: unit for name, _, _, unit, _ in gpu.fields}
    if gpu.has_pcie_counters:
        sample.pcie_tx_bytes_per_second = _times(rates.get("pcie_tx"), units["pcie_tx"])
        sample.pcie_rx_bytes_per_second = _times(rates.get("pcie_rx"), units["pcie_rx"])
    if "nvlink_tx" in units:
        sample.nvlink_tx_bytes_per_second = _times(rates.get("nvlink_tx"), units["nvlink_tx"])
    if "nvlink_rx" in units:
        sample.nvlink_rx_bytes_per_second = _times(rates.get("nvlink_rx"), units["nvlink_rx"])


def _rates(
    previous: dict[str, float], previous_at: float | None, current: dict[str, float], now: float
) -> dict[str, float]:
    """Per-second increase of each counter read both times. A counter that went down was reset (a
    driver reload) or wrapped: no rate for that interval rather than a huge or negative one."""
    if previous_at is None or now <= previous_at:
        return {}
    elapsed = now - previous_at
    return {
        name: (value - previous[name]) / elapsed
        for name, value in current.items()
        if name in previous and value >= previous[name]
    }


def _live_gpm(gpu: _LiveGpu, d: Device, sample: GpuSample, now: float) -> None:
    if gpu.gpm is None:
        return
    metrics = gpu.gpm.read()
    sample.sm_activity_ratio = metrics.get("sm_activity_ratio")
    sample.tensor_activity_ratio = metrics.get("tensor_activity_ratio")


def _live_processes(gpu: _LiveGpu, d: Device, sample: GpuSample, now: float) -> None:
    sample.processes = [
        GpuProcess(
            pid=p.pid,
            name=p.name,
            user=None if p.uid is None else _user_name(p.uid),
            used_memory_bytes=p.used_memory_bytes,
            kind=p.kind,
        )
        for p in d.processes() or []
    ]


_LIVE_GROUPS: tuple[tuple[str, Callable[[_LiveGpu, Device, GpuSample, float], None]], ...] = (
    ("utilization", _live_utilization),
    ("memory", _live_memory),
    ("clocks", _quantities("sm_clock_hertz", "memory_clock_hertz", "clock_event_reasons")),
    # the enforced limit is read every time: `nvidia-smi -pl` changes it at run time
    ("power", _quantities("power_watts", "power_limit_watts", "energy_joules_total")),
    ("thermal", _quantities("temperature_celsius")),
    ("pcie", _quantities("pcie_link_generation", "pcie_link_width", "pcie_replay_total")),
    ("counters", _live_counters),
    # volatile: since the driver loaded, so the count that moves while a job runs
    ("ecc", _quantities("ecc_corrected_total", "ecc_uncorrected_total")),
    ("gpm", _live_gpm),
    ("processes", _live_processes),
)
# the parts of a GpuSample a reader can be asked for
LIVE_GROUPS = frozenset(name for name, _ in _LIVE_GROUPS)
