"""One GPU as NVML answers for it: a method per quantity, in base units, with absence as None.

The layering is nvitop's: the bindings (``pynvml``) -> ``Query`` (every answer classified) -> ``Device``
(one quantity per method) -> the readers (the static probe in ``probe.py``, the live reader in
``live.py``, which the monitor and the bench share). NVML's own units (milliwatts, MHz, KiB/s,
millijoules, percent) become watts, hertz, bytes per second, joules and ratios here and nowhere else.

A method returns None where NVML cannot say (see ``Query``); it raises ``GpuLost`` where the GPU fell
off the bus and, on a live query, ``NvmlGone`` where NVML itself went away.

PCI bus ids are written the way Linux names the device under /sys/bus/pci/devices ("0000:3b:00.0":
four-digit domain, lower-case hex), not NVML's "00000000:3B:00.0", so they join directly with /sys,
``lspci -D`` and the ``NVRM: Xid (PCI:0000:3b:00)`` lines of the kernel log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redline.hw.nvml.query import Query, as_text
from redline.hw.snapshot import GpuProcess
from redline.hw.sysfs import SysFs

# Bits of the clock event (formerly "throttle") reasons mask, low to high. nvidia-ml-py 12.535+ names them
# nvmlClocksEventReason*, older bindings nvmlClocksThrottleReason*; the two bit-for-bit agree.
_CLOCK_EVENT_REASONS = (
    ("GpuIdle", 0x1, "gpu_idle"),
    ("ApplicationsClocksSetting", 0x2, "applications_clocks_setting"),
    ("SwPowerCap", 0x4, "sw_power_cap"),
    ("HwSlowdown", 0x8, "hw_slowdown"),
    ("SyncBoost", 0x10, "sync_boost"),
    ("SwThermalSlowdown", 0x20, "sw_thermal_slowdown"),
    ("HwThermalSlowdown", 0x40, "hw_thermal_slowdown"),
    ("HwPowerBrakeSlowdown", 0x80, "hw_power_brake_slowdown"),
    ("DisplayClockSetting", 0x100, "display_clock_setting"),
    # only in recent bindings, and only as nvmlClocksThrottleReason*
    ("BoardLimit", 0x200, "board_limit"),
    ("Reliability", 0x400, "reliability"),
)
# every reason redline can name, low bit first
CLOCK_EVENT_REASON_NAMES: tuple[str, ...] = tuple(name for _, _, name in _CLOCK_EVENT_REASONS)

_ULONGLONG_MAX = 2**64 - 1


@dataclass(frozen=True)
class Memory:
    used_bytes: int  # nvmlMemory_v2 leaves the driver's reserved memory out, as nvidia-smi does
    total_bytes: int


@dataclass(frozen=True)
class Utilization:
    kernel_ratio: float  # share of the last period (1/6 s to 1 s) in which any kernel ran; not SM occupancy
    memory_bandwidth_ratio: float  # share of it in which device memory was read or written


class Device:
    """One GPU's NVML handle and the query that asks on its behalf (its notes, its health errors)."""

    def __init__(self, q: Query, handle: Any) -> None:
        self.q = q
        self.handle = handle

    def _ask(self, fn_name: str, *args: Any, **kwargs: Any) -> Any:
        return self.q(fn_name, self.handle, *args, **kwargs)

    def _clock(self, fn_name: str, clock: str) -> float | None:
        constant = {"sm": ("NVML_CLOCK_SM", 1), "memory": ("NVML_CLOCK_MEM", 2)}[clock]
        return _times(self._ask(fn_name, self.q.const(*constant)), 1e6)  # NVML speaks MHz

    # ------------------------------------------------------------------------------------ identity

    def name(self) -> str | None:
        return self._ask("nvmlDeviceGetName")

    def uuid(self) -> str | None:
        return self._ask("nvmlDeviceGetUUID")

    def pci_bus_id(self) -> str | None:
        pci = self._ask("nvmlDeviceGetPciInfo")
        # struct fields are bytes in every binding; busId (not busIdLegacy) is the full 8-digit-domain id
        return None if pci is None else normalize_pci_bus_id(as_text(pci.busId))

    def compute_capability(self) -> str | None:
        cc = self._ask("nvmlDeviceGetCudaComputeCapability")
        return None if cc is None else f"{cc[0]}.{cc[1]}"

    def multiprocessor_count(self) -> int | None:
        # NVML documents device attributes for MIG device handles only: a whole GPU usually answers
        # NotSupported, and the SM count then has to come from elsewhere (the spec catalog, CUDA).
        attributes = self.q.first(("nvmlDeviceGetAttributes_v2", "nvmlDeviceGetAttributes"), self.handle)
        return None if attributes is None else attributes.multiprocessorCount

    # ------------------------------------------------------------------------------ memory, load

    def memory(self) -> Memory | None:
        # v2 leaves the driver's reserved memory out of "used", as nvidia-smi does; drivers before r510 lack it
        memory = None
        if hasattr(self.q.nvml, "nvmlMemory_v2"):
            memory = self._ask("nvmlDeviceGetMemoryInfo", version=self.q.nvml.nvmlMemory_v2)
        if memory is None:
            memory = self._ask("nvmlDeviceGetMemoryInfo")
        return None if memory is None else Memory(used_bytes=memory.used, total_bytes=memory.total)

    def utilization(self) -> Utilization | None:
        rates = self._ask("nvmlDeviceGetUtilizationRates")  # percent
        return None if rates is None else Utilization(rates.gpu / 100, rates.memory / 100)

    # ------------------------------------------------------------------------------------- clocks

    def sm_clock_hertz(self) -> float | None:
        return self._clock("nvmlDeviceGetClockInfo", "sm")

    def sm_clock_max_hertz(self) -> float | None:
        return self._clock("nvmlDeviceGetMaxClockInfo", "sm")

    def memory_clock_hertz(self) -> float | None:
        return self._clock("nvmlDeviceGetClockInfo", "memory")

    def memory_clock_max_hertz(self) -> float | None:
        return self._clock("nvmlDeviceGetMaxClockInfo", "memory")

    def applications_sm_clock_hertz(self) -> float | None:
        """The SM clock set by `nvidia-smi -ac`; None where the GPU does not support application clocks."""
        return self._clock("nvmlDeviceGetApplicationsClock", "sm")

    def clock_event_reasons(self) -> list[str] | None:
        """Why the clocks are below their maximum (["sw_power_cap", ...]); [] where nothing holds them."""
        # "throttle reasons" were renamed "clocks event reasons" in r535; the old call is deprecated, not gone
        calls = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
        mask = self.q.first(calls, self.handle)
        return None if mask is None else clock_event_reason_names(self.q.nvml, mask)

    # -------------------------------------------------------------------------------------- power

    def power_watts(self) -> float | None:
        return _divided(self._ask("nvmlDeviceGetPowerUsage"), 1000)  # NVML speaks milliwatts

    def power_limit_watts(self) -> float | None:
        """The enforced limit: `nvidia-smi -pl` changes it at run time, so a live reader asks every time."""
        return _divided(self._ask("nvmlDeviceGetEnforcedPowerLimit"), 1000)

    def power_default_limit_watts(self) -> float | None:
        return _divided(self._ask("nvmlDeviceGetPowerManagementDefaultLimit"), 1000)

    def power_max_limit_watts(self) -> float | None:
        constraints = self._ask("nvmlDeviceGetPowerManagementLimitConstraints")  # [min, max]
        return None if constraints is None else constraints[1] / 1000

    def energy_joules_total(self) -> float | None:
        """Energy since the driver loaded (Volta and later)."""
        return _divided(self._ask("nvmlDeviceGetTotalEnergyConsumption"), 1000)  # millijoules

    # ---------------------------------------------------------------------------------- thermal

    def temperature_celsius(self) -> float | None:
        return _number(self._ask("nvmlDeviceGetTemperature", self.q.const("NVML_TEMPERATURE_GPU", 0)))

    def temperature_slowdown_celsius(self) -> float | None:
        threshold = self.q.const("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1)
        return _number(self._ask("nvmlDeviceGetTemperatureThreshold", threshold))

    def temperature_shutdown_celsius(self) -> float | None:
        threshold = self.q.const("NVML_TEMPERATURE_THRESHOLD_SHUTDOWN", 0)
        return _number(self._ask("nvmlDeviceGetTemperatureThreshold", threshold))

    # ------------------------------------------------------------------------------------- PCIe

    # An idle GPU trains its link down to save power (Gen1 on an idle Gen5 card is normal), so the current
    # generation only means something under load.

    def pcie_link_generation(self) -> int | None:
        return self._ask("nvmlDeviceGetCurrPcieLinkGeneration")

    def pcie_link_generation_max(self) -> int | None:
        """The generation this GPU can reach in this slot (the lower of the GPU's and the slot's)."""
        return self._ask("nvmlDeviceGetMaxPcieLinkGeneration")

    def pcie_link_generation_gpu_max(self) -> int | None:
        """The generation the GPU itself supports, whatever slot it sits in."""
        return self._ask("nvmlDeviceGetGpuMaxPcieLinkGeneration")

    def pcie_link_width(self) -> int | None:
        return self._ask("nvmlDeviceGetCurrPcieLinkWidth")

    def pcie_link_width_max(self) -> int | None:
        return self._ask("nvmlDeviceGetMaxPcieLinkWidth")

    def pcie_replay_total(self) -> int | None:
        return self._ask("nvmlDeviceGetPcieReplayCounter")

    def pcie_throughput_bytes_per_second(self) -> tuple[float | None, float | None]:
        """(tx, rx) as NVML measures them over 20 ms, blocking that long per direction."""
        tx = self._ask("nvmlDeviceGetPcieThroughput", self.q.const("NVML_PCIE_UTIL_TX_BYTES", 0))
        rx = self._ask("nvmlDeviceGetPcieThroughput", self.q.const("NVML_PCIE_UTIL_RX_BYTES", 1))
        return _times(tx, 1024), _times(rx, 1024)  # KiB/s

    def nvlink_active(self, link: int) -> bool | None:
        """Whether NVLink ``link`` is up; None past the GPU's last link, or on a GPU without NVLink."""
        state = self._ask("nvmlDeviceGetNvLinkState", link)
        return None if state is None else bool(state)

    def nvlink_peer_pci_bus_id(self, link: int) -> str | None:
        """The PCI bus id of whatever sits at the other end of ``link`` (a GPU or an NVSwitch)."""
        remote = self._ask("nvmlDeviceGetNvLinkRemotePciInfo", link)
        return None if remote is None else normalize_pci_bus_id(as_text(remote.busId))

    # -------------------------------------------------------------------------------------- ECC

    def ecc_corrected_total(self, volatile: bool = True) -> int | None:
        """Corrected ECC errors since the driver loaded (``volatile``) or over the GPU's lifetime."""
        return self._ecc_errors(self.q.const("NVML_MEMORY_ERROR_TYPE_CORRECTED", 0), volatile)

    def ecc_uncorrected_total(self, volatile: bool = True) -> int | None:
        """Uncorrected ECC errors since the driver loaded (``volatile``) or over the GPU's lifetime."""
        return self._ecc_errors(self.q.const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1), volatile)

    def _ecc_errors(self, error_type: int, volatile: bool) -> int | None:
        counter = self.q.const("NVML_VOLATILE_ECC", 0) if volatile else self.q.const("NVML_AGGREGATE_ECC", 1)
        return self._ask("nvmlDeviceGetTotalEccErrors", error_type, counter)

    # -------------------------------------------------------------------------------- processes

    def processes(self) -> list[GpuProcess] | None:
        """The processes with a context on this GPU, each once; None where NVML will not list them."""
        compute = self._ask("nvmlDeviceGetComputeRunningProcesses")
        graphics = self._ask("nvmlDeviceGetGraphicsRunningProcesses")
        if compute is None and graphics is None:
            return None
        not_available = getattr(self.q.nvml, "NVML_VALUE_NOT_AVAILABLE_ulonglong", None)
        sentinel = _ULONGLONG_MAX if not_available is None else not_available.value
        by_pid: dict[int, GpuProcess] = {}
        for kind, processes in (("compute", compute or []), ("graphics", graphics or [])):
            for process in processes:
                # a process with both a compute and a graphics context is listed twice: keep it once
                if process.pid in by_pid:
                    continue
                # recent bindings turn NVML_VALUE_NOT_AVAILABLE (no per-process accounting: WDDM, some
                # vGPU and container setups) into None, older ones hand back the raw 2**64 - 1
                used = process.usedGpuMemory
                # name and owner come from /proc, not NVML: None where the pid is not visible here
                by_pid[process.pid] = GpuProcess(
                    pid=process.pid,
                    name=self.q.fs.read(f"/proc/{process.pid}/comm") or None,
                    used_memory_bytes=None if used is None or used >= sentinel else used,
                    kind=kind,
                    uid=_process_uid(self.q.fs, process.pid),
                )
        return list(by_pid.values())


def normalize_pci_bus_id(bus_id: str) -> str:
    """NVML's '00000000:3B:00.0' as Linux writes it: '0000:3b:00.0' (see the module docstring)."""
    text = bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep:
        return text
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return text


def clock_event_reason_names(nvml: Any, mask: int) -> list[str]:
    """The names of the bits set in a clock event reasons mask; bits NVML added later read 'unknown_0x...'."""
    names = []
    known = 0
    for suffix, fallback, name in _CLOCK_EVENT_REASONS:
        # the constants' names changed in newer bindings; a binding with neither name has the documented bit
        bit: int = getattr(nvml, "nvmlClocksEventReason" + suffix, 0) or getattr(
            nvml, "nvmlClocksThrottleReason" + suffix, fallback
        )
        known |= bit
        if mask & bit:
            names.append(name)
    unknown = mask & ~known
    bit = 1
    while unknown:
        if unknown & bit:
            names.append(f"unknown_{bit:#x}")
            unknown &= ~bit
        bit <<= 1
    return names


def _times(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _divided(value: float | None, divisor: float) -> float | None:
    return None if value is None else value / divisor


def _number(value: float | None) -> float | None:
    return None if value is None else float(value)


def _process_uid(fs: SysFs, pid: int) -> int | None:
    """The real uid of a process (first number of the 'Uid:' line of /proc/<pid>/status).

    None where the pid is not visible here: inside a container NVML reports host PIDs, which name nothing
    (or, rarely, an unrelated process) in this PID namespace.
    """
    path = f"/proc/{pid}/status"
    uids = fs.read_kv(path, sep=":").get("Uid", "").split()
    if not uids:
        return None
    try:
        return int(uids[0])
    except ValueError:
        fs.errors.append(f"{path}: Uid {uids[0][:40]!r} is not a number")
        return None
