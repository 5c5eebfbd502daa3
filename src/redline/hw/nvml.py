"""The NVML adapter: the only module in redline that talks to the NVIDIA driver (through ``pynvml``).

NVML answers "not supported" for whole families of queries depending on the board (a GeForce has no
ECC, a PCIe card no NVLink, anything before Hopper no fabric state), the driver (an old driver lacks
newer entry points) and the bindings (an old nvidia-ml-py lacks newer functions). Those answers are
data, not failures, so every call goes through ``_Query``, which turns them into ``None`` the way
nvitop's ``nvmlQuery(default=NA)`` does. Only two answers change the flow: NVML failing to start
(reported in ``GpuSection.error`` and ``error_code``) and GPU_IS_LOST (the GPU fell off the bus: mark it
``lost`` and ask it nothing more). Anything else unexpected becomes ``None`` plus a one-line note for
``Snapshot.probe_errors``; an error that says something about the GPU itself (CORRUPTED_INFOROM,
RESET_REQUIRED, TIMEOUT, UNKNOWN, GPU_IS_LOST, a handle NVML cannot give...) is also recorded in that
GPU's ``health_errors``, so the doctor can judge it without parsing notes.

This module never initialises CUDA: NVML is read-only and does not create contexts on the GPUs.
What NVML names but does not describe (the processes on a GPU, the CPUs a mask covers) is read from
/proc and /sys through the ``SysFs`` passed in, so tests can fake it.

PCI bus ids are written the way Linux names the device under /sys/bus/pci/devices ("0000:3b:00.0":
four-digit domain, lower-case hex), not NVML's "00000000:3B:00.0", so they join directly with /sys,
``lspci -D`` and the ``NVRM: Xid (PCI:0000:3b:00)`` lines of the kernel log.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import pwd
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redline.hw.host import parse_cpulist
from redline.hw.snapshot import (
    Gpu,
    GpuClocks,
    GpuEcc,
    GpuPower,
    GpuProcess,
    GpuRetirement,
    GpuSection,
    GpuThermal,
    NvLink,
    PcieLink,
)
from redline.hw.sysfs import SysFs

if TYPE_CHECKING:
    from redline.monitor.sample import GpuSample

# NVML errors that mean "this GPU, driver or binding cannot answer that": the field is simply absent.
_ABSENT_ERRORS = (
    "NVMLError_NotSupported",
    "NVMLError_FunctionNotFound",  # the driver is older than the call
    "NVMLError_NoPermission",  # containers and non-root users are refused some counters
    "NVMLError_InvalidArgument",  # e.g. an NVLink index past the GPU's last link
    "NVMLError_NotFound",
    "NVMLError_NoData",
    "NVMLError_NotReady",
    "NVMLError_ArgumentVersionMismatch",  # a versioned struct newer than the driver
    "NVMLError_Deprecated",
)
# NVML errors that say something about the GPU's health: the field is absent, the error is noted and
# also recorded in Gpu.health_errors. GPU_IS_LOST is one too, handled on its own (it ends the GPU's probe).
# Any other error (a binding or OS problem: Uninitialized, InsufficientSize, OperatingSystem...) is only
# noted.
_HEALTH_ERRORS = (
    "NVMLError_ResetRequired",
    "NVMLError_CorruptedInforom",
    "NVMLError_InsufficientPower",  # an external power cable missing or loose
    "NVMLError_IrqIssue",
    "NVMLError_Timeout",
    "NVMLError_Unknown",  # what a GPU in trouble often answers; never evidence of "not supported"
    "NVMLError_Memory",
    "NVMLError_InsufficientResources",
)
# NVML errors that mean NVML itself went away under a running reader: the kernel module was unloaded or
# reloaded (a driver upgrade, a GPU reset by the operator), or the library and module no longer match.
# Every call on every GPU would fail the same way, so a live reader stops and starts NVML again later.
_GONE_ERRORS = (
    "NVMLError_Uninitialized",
    "NVMLError_DriverNotLoaded",
    "NVMLError_LibRmVersionMismatch",
    "NVMLError_LibraryNotFound",
)
# Absent answers that stay absent while the driver runs: a live reader asks once and then no more.
# (NoData, NotReady... can change from one second to the next, so they are asked again.)
_PERMANENTLY_ABSENT_ERRORS = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound", "NVMLError_NoPermission")

# (pynvml constant, its value where an older binding lacks the name, what redline calls it)
_COMPUTE_MODES = (
    ("NVML_COMPUTEMODE_DEFAULT", 0, "default"),
    ("NVML_COMPUTEMODE_EXCLUSIVE_THREAD", 1, "exclusive_thread"),
    ("NVML_COMPUTEMODE_PROHIBITED", 2, "prohibited"),
    ("NVML_COMPUTEMODE_EXCLUSIVE_PROCESS", 3, "exclusive_process"),
)
_VIRTUALIZATION_MODES = (
    ("NVML_GPU_VIRTUALIZATION_MODE_NONE", 0, "none"),
    ("NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH", 1, "passthrough"),
    ("NVML_GPU_VIRTUALIZATION_MODE_VGPU", 2, "vgpu"),
    ("NVML_GPU_VIRTUALIZATION_MODE_HOST_VGPU", 3, "host_vgpu"),
    ("NVML_GPU_VIRTUALIZATION_MODE_HOST_VSGA", 4, "host_vsga"),
)
_FABRIC_STATES = (
    ("NVML_GPU_FABRIC_STATE_NOT_SUPPORTED", 0, "not_supported"),
    ("NVML_GPU_FABRIC_STATE_NOT_STARTED", 1, "not_started"),
    ("NVML_GPU_FABRIC_STATE_IN_PROGRESS", 2, "in_progress"),
    ("NVML_GPU_FABRIC_STATE_COMPLETED", 3, "completed"),
)
# Each NVML status keeps its own name: "the chipset", "the GPU model", "the topology" and "a registry key"
# each have a different fix, so none is folded into another.
_P2P_STATUSES = (
    ("NVML_P2P_STATUS_OK", 0, "ok"),
    # older bindings only have the misspelt NVML_P2P_STATUS_CHIPSET_NOT_SUPPORED: the fallback value covers them
    ("NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED", 1, "chipset_not_supported"),
    ("NVML_P2P_STATUS_GPU_NOT_SUPPORTED", 2, "gpu_not_supported"),
    ("NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED", 3, "topology_not_supported"),
    ("NVML_P2P_STATUS_DISABLED_BY_REGKEY", 4, "disabled_by_regkey"),
    ("NVML_P2P_STATUS_NOT_SUPPORTED", 5, "not_supported"),
    ("NVML_P2P_STATUS_UNKNOWN", 6, "unknown"),
)
# named as `nvidia-smi topo -m` names them
_TOPOLOGY_LEVELS = (
    ("NVML_TOPOLOGY_INTERNAL", 0, "SELF"),
    ("NVML_TOPOLOGY_SINGLE", 10, "PIX"),
    ("NVML_TOPOLOGY_MULTIPLE", 20, "PXB"),
    ("NVML_TOPOLOGY_HOSTBRIDGE", 30, "PHB"),
    ("NVML_TOPOLOGY_NODE", 40, "NODE"),
    ("NVML_TOPOLOGY_SYSTEM", 50, "SYS"),
)
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

_ULONGLONG_MAX = 2**64 - 1


class _GpuLost(Exception):
    """NVML answered GPU_IS_LOST: the GPU fell off the bus and every further call would say so again."""


class NvmlGone(Exception):
    """NVML would not start, or stopped answering altogether (see ``_GONE_ERRORS``).

    ``code`` is one of ``GpuSection.error_code``'s values where NVML would not start, else "gone".
    """

    def __init__(self, message: str, code: str = "gone") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def probe_gpus(nvml: Any | None = None, errors: list[str] | None = None, fs: SysFs | None = None) -> GpuSection:
    """What NVML can tell about this server's GPUs; never raises.

    ``nvml`` is the ``pynvml`` module, imported here rather than at import time so that ``import redline``
    works on machines without the bindings; tests pass a fake with the same surface. Anything that went
    wrong part-way is appended to ``errors`` (the caller passes ``Snapshot.probe_errors``). ``fs`` reads
    /proc and /sys (process names and owners, the CPU count); tests point it at a fake tree.
    """
    notes = errors if errors is not None else []
    fs = fs or SysFs("/")
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            # the bindings, not the driver, are missing: "other", so no rule tells the user to install a driver
            return GpuSection(nvml_available=False, error="nvidia-ml-py (pynvml) is not installed", error_code="other")

    try:
        nvml.nvmlInit()
    except Exception as exc:
        code, message = _init_error(nvml, exc)
        return GpuSection(nvml_available=False, error=message, error_code=code)
    try:
        return _probe(nvml, notes, fs)
    except Exception as exc:  # a bug in this module must not cost the rest of the snapshot
        notes.append(f"NVML probe failed: {type(exc).__name__}: {exc}")
        return GpuSection(nvml_available=True, error=f"the GPU probe failed part-way ({type(exc).__name__})")
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as exc:
            notes.append(f"nvmlShutdown failed: {_describe(nvml, exc)}")


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
        bit = getattr(nvml, "nvmlClocksEventReason" + suffix, None)
        if bit is None:
            bit = getattr(nvml, "nvmlClocksThrottleReason" + suffix, fallback)
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


# ------------------------------------------------------------------------------------------- plumbing


class _Query:
    """Calls NVML on behalf of one GPU (or the system) and turns every "cannot say" into None.

    ``health`` is the GPU's ``health_errors``, where errors about the GPU's health are recorded; None for
    system-wide and pair queries, which belong to no one GPU (those errors are only noted). ``fs`` reads
    what NVML leaves to /proc and /sys.
    """

    # errors that end the whole reader (NvmlGone); none for the one-shot probe, which reports them as notes
    _gone: tuple[type[BaseException], ...] = ()

    def __init__(
        self, nvml: Any, notes: list[str], where: str, fs: SysFs, health: dict[str, str] | None = None
    ) -> None:
        self.nvml = nvml
        self.notes = notes
        self.where = where
        self.fs = fs
        self.health = health
        self._absent = _error_classes(nvml, _ABSENT_ERRORS)
        self._health = _error_classes(nvml, _HEALTH_ERRORS)

    def __call__(self, fn_name: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:  # the bindings are older than the call
            return None
        try:
            value = fn(*args, **kwargs)
        except self.nvml.NVMLError_GpuIsLost as exc:
            self._unhealthy(fn_name, exc)
            raise _GpuLost from None
        except self._gone as exc:
            raise NvmlGone(f"{fn_name}: {_describe(self.nvml, exc)}") from None
        except self._absent as exc:
            self._absent_answer(fn_name, args, kwargs, exc)
            return None
        except self._health as exc:
            self._unhealthy(fn_name, exc)
            return None
        except Exception as exc:
            self.note(f"{fn_name}: {_describe(self.nvml, exc)}")
            return None
        return _text(value)

    def _absent_answer(self, fn_name: str, args: tuple[Any, ...], kwargs: dict[str, Any], exc: BaseException) -> None:
        """NVML said it cannot answer this call; the probe needs no more than the None it returns."""

    def _unhealthy(self, fn_name: str, exc: BaseException) -> None:
        self.note(f"{fn_name}: {_describe(self.nvml, exc)}")
        if self.health is not None:
            self.health.setdefault(fn_name, error_name(exc))

    def first(self, fn_names: tuple[str, ...], *args: Any) -> Any:
        """The first answer from equivalent calls, newest first (e.g. a _v2 and its original)."""
        for fn_name in fn_names:
            value = self(fn_name, *args)
            if value is not None:
                return value
        return None

    def const(self, name: str, fallback: int) -> int:
        return getattr(self.nvml, name, fallback)

    def enum_name(self, what: str, table: tuple[tuple[str, int, str], ...], value: int | None) -> str | None:
        """redline's name for an NVML enum value; a value newer than this table is noted and read as None."""
        if value is None:
            return None
        for const, fallback, name in table:
            if self.const(const, fallback) == value:
                return name
        self.note(f"{what} {value} is not one redline knows (a newer driver?)")
        return None

    def note(self, text: str) -> None:
        self.notes.append(f"{self.where}: {text}")


def error_name(exc: BaseException) -> str:
    """NVML's name for an error, as in its header: NVMLError_CorruptedInforom -> 'CORRUPTED_INFOROM'.

    pynvml names each NVMLError subclass by camel-casing the NVML_ERROR_* constant, so undoing that gives
    the constant back without a table to keep in step with the bindings. An NVMLError with a code the
    bindings do not know reads 'ERROR_<code>'; anything else is its class name ('RuntimeError').
    """
    name = type(exc).__name__
    if name.startswith("NVMLError_"):
        return re.sub(r"(?<!^)(?=[A-Z])", "_", name.removeprefix("NVMLError_")).upper()
    if name == "NVMLError":
        return f"ERROR_{getattr(exc, 'value', '?')}"
    return name


def _error_classes(nvml: Any, names: tuple[str, ...]) -> tuple[type[BaseException], ...]:
    """The binding's exception classes by name; an older binding may lack some."""
    return tuple(getattr(nvml, name) for name in names if hasattr(nvml, name))


def _describe(nvml: Any, exc: BaseException) -> str:
    if isinstance(exc, nvml.NVMLError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _text(value: Any) -> Any:
    """Old bindings (and struct fields in every binding) hand back bytes where we want str."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


def _scaled(value: int | None, divisor: float) -> float | None:
    return None if value is None else value / divisor


def _is_enabled(q: _Query, state: int | None) -> bool | None:
    return None if state is None else state == q.const("NVML_FEATURE_ENABLED", 1)


# Why NVML will not start, for rules (GpuSection.error_code) and for the user: each has a known fix.
_INIT_ERRORS = (
    ("NVMLError_LibraryNotFound", "library_not_found", "NVML library not found (no NVIDIA driver)"),
    (
        "NVMLError_DriverNotLoaded",
        "driver_not_loaded",
        "NVIDIA driver not loaded (the nvidia kernel module is not running)",
    ),
    (
        "NVMLError_LibRmVersionMismatch",
        "driver_mismatch",
        "NVIDIA driver/library version mismatch: the driver was upgraded but the old kernel module "
        "is still loaded; reboot or reload the nvidia kernel modules",
    ),
    (
        "NVMLError_NoPermission",
        "no_permission",
        "no permission to use NVML (cannot open the /dev/nvidia* devices)",
    ),
)


def _init_error(nvml: Any, exc: BaseException) -> tuple[str, str]:
    """(error_code, message) for an nvmlInit that failed."""
    for class_name, code, message in _INIT_ERRORS:
        cls = getattr(nvml, class_name, None)
        if cls is not None and isinstance(exc, cls):
            return code, message
    return "other", f"NVML failed to start: {_describe(nvml, exc)}"


# ---------------------------------------------------------------------------------------- the probe


def _probe(nvml: Any, notes: list[str], fs: SysFs) -> GpuSection:
    q = _Query(nvml, notes, where="NVML", fs=fs)
    section = GpuSection(nvml_available=True)
    section.driver_version = q("nvmlSystemGetDriverVersion")
    section.nvml_version = q("nvmlSystemGetNVMLVersion")
    # NVML encodes CUDA 12.4 as 12040 (major * 1000 + minor * 10)
    cuda = q.first(("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"))
    section.cuda_driver_version = None if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}"

    # NVML numbers GPUs in PCI bus order and ignores CUDA_VISIBLE_DEVICES: these indices are the ones
    # nvidia-smi shows, which need not be CUDA's.
    count = q("nvmlDeviceGetCount")
    if count is None:
        section.error = "NVML started but could not count the GPUs"
        return section

    handles = []
    for index in range(count):
        gpu, handle = _probe_gpu(nvml, notes, fs, index)
        section.gpus.append(gpu)
        handles.append(handle)

    section.p2p = _pair_matrix(section.gpus, handles, "self", lambda a, b: _p2p_status(q, a, b))
    section.topology = _pair_matrix(section.gpus, handles, "SELF", lambda a, b: _topology_level(q, a, b))
    return section


def _probe_gpu(nvml: Any, notes: list[str], fs: SysFs, index: int) -> tuple[Gpu, Any]:
    gpu = Gpu(index=index)
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:
        # What nvidia-smi reports as "Unable to determine the device handle": a GPU NVML counts but cannot
        # open is a GPU in trouble, whatever the error, so it is listed with the error for the doctor.
        gpu.lost = isinstance(exc, nvml.NVMLError_GpuIsLost)
        gpu.health_errors["nvmlDeviceGetHandleByIndex"] = error_name(exc)
        notes.append(f"GPU {index}: no NVML handle ({_describe(nvml, exc)}); nothing else was read")
        return gpu, None

    q = _Query(nvml, notes, where=f"GPU {index}", fs=fs, health=gpu.health_errors)
    for what, read in _GPU_FIELD_GROUPS:
        try:
            read(q, handle, gpu)
        except _GpuLost:
            gpu.lost = True
            break
        except Exception as exc:  # a binding handing back an unexpected shape: lose this group only
            q.note(f"reading {what}: {type(exc).__name__}: {exc}")
    return gpu, handle


def _pair_matrix(
    gpus: list[Gpu], handles: list[Any], diagonal: str, ask: Callable[[Any, Any], str]
) -> list[list[str]] | None:
    """matrix[i][j] for every ordered pair of GPUs; a pair with a lost or unreachable GPU is "unknown"."""
    if len(gpus) < 2:
        return None

    def cell(i: int, j: int) -> str:
        if i == j:
            return diagonal
        if handles[i] is None or handles[j] is None or gpus[i].lost or gpus[j].lost:
            return "unknown"
        try:
            return ask(handles[i], handles[j])
        except _GpuLost:
            return "unknown"

    return [[cell(i, j) for j in range(len(gpus))] for i in range(len(gpus))]


def _p2p_status(q: _Query, a: Any, b: Any) -> str:
    # NVML_P2P_CAPS_INDEX_READ is 0, but nvidia-ml-py 13.615.71 defines it as the tuple (0,) (a stray
    # trailing comma), which ctypes rejects: pass the number.
    status = q("nvmlDeviceGetP2PStatus", a, b, 0)
    return q.enum_name("P2P status", _P2P_STATUSES, status) or "unknown"


def _topology_level(q: _Query, a: Any, b: Any) -> str:
    level = q("nvmlDeviceGetTopologyCommonAncestor", a, b)
    return q.enum_name("topology level", _TOPOLOGY_LEVELS, level) or "unknown"


# ------------------------------------------------------------------------------- one GPU, by group


def _read_identity(q: _Query, h: Any, gpu: Gpu) -> None:
    gpu.name = q("nvmlDeviceGetName", h)
    gpu.uuid = q("nvmlDeviceGetUUID", h)
    pci = q("nvmlDeviceGetPciInfo", h)
    # struct fields are bytes in every binding; busId (not busIdLegacy) is the full 8-digit-domain id
    gpu.pci_bus_id = None if pci is None else normalize_pci_bus_id(_text(pci.busId))
    cc = q("nvmlDeviceGetCudaComputeCapability", h)
    gpu.compute_capability = None if cc is None else f"{cc[0]}.{cc[1]}"
    # NVML documents device attributes for MIG device handles only: a whole GPU usually answers NotSupported,
    # and the SM count then has to come from elsewhere (the spec catalog, CUDA).
    attributes = q.first(("nvmlDeviceGetAttributes_v2", "nvmlDeviceGetAttributes"), h)
    gpu.multiprocessor_count = None if attributes is None else attributes.multiprocessorCount


def _read_memory(q: _Query, h: Any, gpu: Gpu) -> None:
    # v2 leaves the driver's reserved memory out of "used", as nvidia-smi does; drivers before r510 lack it
    memory = None
    if hasattr(q.nvml, "nvmlMemory_v2"):
        memory = q("nvmlDeviceGetMemoryInfo", h, version=q.nvml.nvmlMemory_v2)
    if memory is None:
        memory = q("nvmlDeviceGetMemoryInfo", h)
    if memory is not None:
        gpu.memory_total_bytes = memory.total
        gpu.memory_used_bytes = memory.used


def _read_modes(q: _Query, h: Any, gpu: Gpu) -> None:
    gpu.persistence_mode = _is_enabled(q, q("nvmlDeviceGetPersistenceMode", h))
    gpu.compute_mode = q.enum_name("compute mode", _COMPUTE_MODES, q("nvmlDeviceGetComputeMode", h))
    mig = q("nvmlDeviceGetMigMode", h)  # [current, pending]: a change waits for a GPU reset
    gpu.mig_mode = None if mig is None else mig[0] == q.const("NVML_DEVICE_MIG_ENABLE", 1)
    gpu.virtualization_mode = q.enum_name(
        "virtualization mode", _VIRTUALIZATION_MODES, q("nvmlDeviceGetVirtualizationMode", h)
    )
    # .gpu is the percent of the last sample period (1/6 s to 1 s) in which any kernel ran, not SM occupancy
    utilization = q("nvmlDeviceGetUtilizationRates", h)
    gpu.utilization_ratio = None if utilization is None else utilization.gpu / 100


def _read_clocks(q: _Query, h: Any, gpu: Gpu) -> None:
    sm = q.const("NVML_CLOCK_SM", 1)
    mem = q.const("NVML_CLOCK_MEM", 2)
    gpu.clocks = GpuClocks(
        sm_mhz=q("nvmlDeviceGetClockInfo", h, sm),
        sm_max_mhz=q("nvmlDeviceGetMaxClockInfo", h, sm),
        memory_mhz=q("nvmlDeviceGetClockInfo", h, mem),
        memory_max_mhz=q("nvmlDeviceGetMaxClockInfo", h, mem),
        applications_sm_mhz=q("nvmlDeviceGetApplicationsClock", h, sm),
    )
    # "throttle reasons" were renamed "clocks event reasons" in r535; the old call is deprecated, not gone
    mask = q.first(("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"), h)
    gpu.clock_event_reasons = None if mask is None else clock_event_reason_names(q.nvml, mask)


def _read_power(q: _Query, h: Any, gpu: Gpu) -> None:
    # NVML speaks milliwatts
    constraints = q("nvmlDeviceGetPowerManagementLimitConstraints", h)  # [min, max]
    gpu.power = GpuPower(
        draw_w=_scaled(q("nvmlDeviceGetPowerUsage", h), 1000),
        enforced_limit_w=_scaled(q("nvmlDeviceGetEnforcedPowerLimit", h), 1000),
        default_limit_w=_scaled(q("nvmlDeviceGetPowerManagementDefaultLimit", h), 1000),
        max_limit_w=None if constraints is None else constraints[1] / 1000,
    )


def _read_thermal(q: _Query, h: Any, gpu: Gpu) -> None:
    gpu.thermal = GpuThermal(
        temperature_c=q("nvmlDeviceGetTemperature", h, q.const("NVML_TEMPERATURE_GPU", 0)),
        slowdown_c=q("nvmlDeviceGetTemperatureThreshold", h, q.const("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1)),
        shutdown_c=q("nvmlDeviceGetTemperatureThreshold", h, q.const("NVML_TEMPERATURE_THRESHOLD_SHUTDOWN", 0)),
    )


def _read_pcie(q: _Query, h: Any, gpu: Gpu) -> None:
    # An idle GPU trains its link down to save power (Gen1 on an idle Gen5 card is normal), so the
    # current generation only means something under load. MaxPcieLinkGeneration is what this slot
    # allows; GpuMaxPcieLinkGeneration is what the GPU itself could do.
    gpu.pcie = PcieLink(
        gen_current=q("nvmlDeviceGetCurrPcieLinkGeneration", h),
        gen_max=q("nvmlDeviceGetMaxPcieLinkGeneration", h),
        gen_gpu_max=q("nvmlDeviceGetGpuMaxPcieLinkGeneration", h),
        width_current=q("nvmlDeviceGetCurrPcieLinkWidth", h),
        width_max=q("nvmlDeviceGetMaxPcieLinkWidth", h),
        replay_count=q("nvmlDeviceGetPcieReplayCounter", h),
    )


def _read_ecc(q: _Query, h: Any, gpu: Gpu) -> None:
    mode = q("nvmlDeviceGetEccMode", h)  # [current, pending]: a change waits for a reboot
    corrected = q.const("NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
    uncorrected = q.const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
    volatile = q.const("NVML_VOLATILE_ECC", 0)
    aggregate = q.const("NVML_AGGREGATE_ECC", 1)
    gpu.ecc = GpuEcc(
        enabled=None if mode is None else _is_enabled(q, mode[0]),
        volatile_corrected=q("nvmlDeviceGetTotalEccErrors", h, corrected, volatile),
        volatile_uncorrected=q("nvmlDeviceGetTotalEccErrors", h, uncorrected, volatile),
        aggregate_corrected=q("nvmlDeviceGetTotalEccErrors", h, corrected, aggregate),
        aggregate_uncorrected=q("nvmlDeviceGetTotalEccErrors", h, uncorrected, aggregate),
    )


def _read_retirement(q: _Query, h: Any, gpu: Gpu) -> None:
    # Ampere and later remap rows instead of retiring pages: on them the page calls say NotSupported,
    # and before Ampere the row-remapping call does.
    rows = q("nvmlDeviceGetRemappedRows", h)  # (correctable, uncorrectable, pending, failure occurred)
    single_bit = q.const("NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0)
    double_bit = q.const("NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1)
    single = q("nvmlDeviceGetRetiredPages", h, single_bit)  # NVML lists the retired page addresses
    double = q("nvmlDeviceGetRetiredPages", h, double_bit)
    gpu.retirement = GpuRetirement(
        remapped_rows_correctable=None if rows is None else rows[0],
        remapped_rows_uncorrectable=None if rows is None else rows[1],
        remap_pending=None if rows is None else bool(rows[2]),
        remap_failed=None if rows is None else bool(rows[3]),
        retired_pages_single_bit=None if single is None else len(single),
        retired_pages_double_bit=None if double is None else len(double),
        retired_pages_pending=_is_enabled(q, q("nvmlDeviceGetRetiredPagesPendingStatus", h)),
    )


def _read_nvlinks(q: _Query, h: Any, gpu: Gpu) -> None:
    # NVML_NVLINK_MAX_LINKS grows with the bindings (12, 18, 36...) while a GPU has fewer links: the
    # first link past the GPU's last answers InvalidArgument, and a GPU without NVLink answers
    # NotSupported on link 0. Either way the walk stops there.
    links = []
    for link in range(q.const("NVML_NVLINK_MAX_LINKS", 18)):
        state = q("nvmlDeviceGetNvLinkState", h, link)
        if state is None:
            break
        remote = q("nvmlDeviceGetNvLinkRemotePciInfo", h, link)
        peer = None if remote is None else normalize_pci_bus_id(_text(remote.busId))
        links.append(NvLink(link=link, active=bool(state), peer_pci_bus_id=peer))
    gpu.nvlinks = links or None


def _read_fabric(q: _Query, h: Any, gpu: Gpu) -> None:
    # The fabric calls fill a struct the caller allocates. The versioned call (drivers r550+) needs the
    # version field set, which the binding's struct constructor does; older drivers only have the plain one.
    nvml = q.nvml
    info = None
    if hasattr(nvml, "c_nvmlGpuFabricInfoV_t"):
        info = nvml.c_nvmlGpuFabricInfoV_t()
        if q("nvmlDeviceGetGpuFabricInfoV", h, ctypes.byref(info)) is None:
            info = None
    if info is None and hasattr(nvml, "c_nvmlGpuFabricInfo_t"):
        info = nvml.c_nvmlGpuFabricInfo_t()
        if q("nvmlDeviceGetGpuFabricInfo", h, ctypes.byref(info)) is None:
            info = None
    if info is None:
        return
    gpu.fabric_state = q.enum_name("fabric state", _FABRIC_STATES, info.state)
    # Registration can complete and still fail: `status` is then the fabric manager's error (an NVML
    # return code), and the GPU has no NVLink bandwidth to its peers.
    if gpu.fabric_state == "completed":
        ok = info.status == q.const("NVML_SUCCESS", 0)
        # NVMLError(code) is the subclass named after the code, which error_name turns back into the name
        gpu.fabric_status = "success" if ok else error_name(q.nvml.NVMLError(info.status))


def _read_locality(q: _Query, h: Any, gpu: Gpu) -> None:
    # nvmlDeviceGetNumaNodeId answers only where the GPU's memory is itself a NUMA node (Grace Hopper,
    # coherent platforms) and then names that node, not the CPU node nearest the card. Elsewhere it says
    # NotSupported and the caller takes the node from /sys/bus/pci/devices/<bus id>/numa_node.
    node = q("nvmlDeviceGetNumaNodeId", h)
    gpu.numa_node = node if node is not None and node >= 0 else None
    # The caller sizes the mask: one 64-bit word per 64 CPUs of the whole system.
    words = q("nvmlDeviceGetCpuAffinity", h, math.ceil(_system_cpu_count(q.fs) / 64))
    if words is not None:
        cpus = [64 * w + bit for w, word in enumerate(words) for bit in range(64) if word >> bit & 1]
        gpu.cpu_affinity = cpus or None


def _read_processes(q: _Query, h: Any, gpu: Gpu) -> None:
    compute = q("nvmlDeviceGetComputeRunningProcesses", h)
    graphics = q("nvmlDeviceGetGraphicsRunningProcesses", h)
    if compute is None and graphics is None:
        return
    not_available = getattr(q.nvml, "NVML_VALUE_NOT_AVAILABLE_ulonglong", None)
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
            # name and owner come from /proc, not NVML: None where the pid is not visible here (see _process_uid)
            by_pid[process.pid] = GpuProcess(
                pid=process.pid,
                name=q.fs.read(f"/proc/{process.pid}/comm") or None,
                used_memory_bytes=None if used is None or used >= sentinel else used,
                kind=kind,
                uid=_process_uid(q.fs, process.pid),
            )
    gpu.processes = list(by_pid.values())


_GPU_FIELD_GROUPS: tuple[tuple[str, Callable[[_Query, Any, Gpu], None]], ...] = (
    ("identity", _read_identity),
    ("memory", _read_memory),
    ("modes", _read_modes),
    ("clocks", _read_clocks),
    ("power", _read_power),
    ("thermal", _read_thermal),
    ("pcie", _read_pcie),
    ("ecc", _read_ecc),
    ("retirement", _read_retirement),
    ("nvlinks", _read_nvlinks),
    ("fabric", _read_fabric),
    ("locality", _read_locality),
    ("processes", _read_processes),
)


def _system_cpu_count(fs: SysFs) -> int:
    """How many CPUs the kernel numbers, for sizing NVML's affinity mask.

    /sys/devices/system/cpu/possible ('0-223') covers every CPU id a mask can hold, including CPUs that
    are offline or outside this container's cpuset; os.cpu_count() is the fallback where it is absent.
    A mask sized too small silently drops the high CPUs (the whole second socket on a big host).
    """
    text = fs.read("/sys/devices/system/cpu/possible")
    try:
        cpus = parse_cpulist(text or "")
    except ValueError:
        cpus = []
    return max(cpus) + 1 if cpus else os.cpu_count() or 1


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


class ClockStateReader:
    """The fast-changing state of some GPUs (clocks, power, temperature, clock-event reasons), read many
    times while a benchmark runs: redline.bench.sampler polls it from a thread."""

    def __init__(self, nvml: Any, handles: dict[int, Any]) -> None:
        self.nvml = nvml
        self.handles = handles
        self.notes: list[str] = []
        self._fs = SysFs("/")

    @classmethod
    def open(cls, indices: list[int], nvml: Any | None = None) -> ClockStateReader | None:
        """A reader for these GPUs, or None where NVML cannot start (then nothing is sampled)."""
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                return None
        try:
            nvml.nvmlInit()
        except Exception:
            return None
        try:
            return cls(nvml, {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in indices})
        except Exception:
            nvml.nvmlShutdown()
            return None

    def read(self) -> list[dict[str, Any]]:
        samples = []
        for index, handle in self.handles.items():
            gpu = Gpu(index=index)
            q = _Query(self.nvml, self.notes, f"GPU {index}", self._fs)
            try:
                _read_clocks(q, handle, gpu)
                _read_power(q, handle, gpu)
                _read_thermal(q, handle, gpu)
            except _GpuLost:
                samples.append({"index": index, "lost": True})
                continue
            samples.append(
                {
                    "index": index,
                    "sm_mhz": gpu.clocks.sm_mhz,
                    "power_w": gpu.power.draw_w,
                    "temperature_c": gpu.thermal.temperature_c,
                    "reasons": gpu.clock_event_reasons,
                }
            )
        return samples

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception as exc:
            self.notes.append(f"nvmlShutdown failed: {_describe(self.nvml, exc)}")


# ------------------------------------------------------------------------------------ live reading

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


class _LiveQuery(_Query):
    """A ``_Query`` for a reader that asks the same questions every second for hours.

    Two differences from the probe's: an error that says NVML itself is gone raises ``NvmlGone`` (the
    reader must stop and start NVML again, see ``_GONE_ERRORS``); and a call NVML answered "not supported"
    (or "no permission") is not asked again, since the answer will not change while the driver runs and
    a GeForce card would otherwise spend a third of its calls on ECC and GPM questions.
    """

    def __init__(self, nvml: Any, notes: list[str], where: str, fs: SysFs) -> None:
        super().__init__(nvml, notes, where, fs)
        self._gone = _error_classes(nvml, _GONE_ERRORS)
        self._never = _error_classes(nvml, _PERMANENTLY_ABSENT_ERRORS)
        self._skip: set[tuple[Any, ...]] = set()  # bounded: one entry per distinct call this reader makes

    def __call__(self, fn_name: str, *args: Any, **kwargs: Any) -> Any:
        if self._skip and _call_key(fn_name, args, kwargs) in self._skip:
            return None
        return super().__call__(fn_name, *args, **kwargs)

    def _absent_answer(self, fn_name: str, args: tuple[Any, ...], kwargs: dict[str, Any], exc: BaseException) -> None:
        if isinstance(exc, self._never):
            self._skip.add(_call_key(fn_name, args, kwargs))


def _call_key(fn_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What tells one call from another on the same GPU: its name and plain-number arguments (the clock
    type, the sensor, a memory struct version); the handle is the same for every call of one ``_LiveQuery``."""
    numbers = tuple(a for a in args if isinstance(a, int))
    named = tuple((k, v) for k, v in kwargs.items() if isinstance(v, int))
    return (fn_name, numbers, named)


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

    def __init__(self, q: _LiveQuery, handle: Any, samples: tuple[Any, Any]) -> None:
        self.q = q
        self.handle = handle
        self.previous, self.current = samples
        self.have_previous = False
        self.request = q.nvml.c_nvmlGpmMetricsGet_t()
        self.metric_ids = [q.const(constant, fallback) for _, constant, fallback in _GPM_METRICS]

    @classmethod
    def open(cls, q: _LiveQuery, handle: Any) -> _Gpm | None:
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
    """One GPU a ``GpuStateReader`` reads: its handle, what does not change while the driver runs (read
    once, when the reader opens), and the previous counter readings that rates are taken from."""

    index: int
    q: _LiveQuery
    handle: Any = None  # None: NVML counted the GPU but would not open it
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    sm_clock_max_hertz: float | None = None
    memory_clock_max_hertz: float | None = None
    pcie_link_generation_max: int | None = None
    pcie_link_width_max: int | None = None
    temperature_slowdown_celsius: float | None = None
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
        from redline.monitor.sample import GpuSample  # see _read_gpu

        return GpuSample(index=self.index, uuid=self.uuid, name=self.name, lost=True)


class GpuStateReader:
    """Everything ``redline monitor`` records about each GPU, read once per sample for as long as it runs.

    ``open`` starts NVML and reads, once, what does not change while the driver runs (identity, maximum
    clocks and link, slowdown temperature, which counters and GPM the GPU supports); each ``read`` then
    makes about twenty NVML calls per GPU, and none for what the GPU said it does not support. Rates
    (PCIe and NVLink bytes per second, GPM activity) come from counters read on successive calls, so
    they are None on the first.

    PCIe throughput comes from the cumulative byte counters (NVML_FI_DEV_PCIE_COUNT_*_BYTES, r550+
    drivers) where the GPU has them; elsewhere from nvmlDeviceGetPcieThroughput, which blocks about 20 ms
    per direction while it measures, so it is refreshed for one such GPU per ``read`` (round robin) and
    each GPU repeats its last figure in between: on 8 GPUs read every second a figure is up to 8 s old.

    Errors go into ``notes`` ("GPU 3: nvmlDeviceGetPowerUsage: Unknown Error"), which the caller drains;
    ``read`` raises ``NvmlGone`` when NVML as a whole stops answering (the reader is then finished:
    ``close`` it and ``open`` another later). A GPU that answers GPU_IS_LOST is read as ``lost``.
    """

    def __init__(self, nvml: Any, fs: SysFs) -> None:
        self.nvml = nvml
        self.fs = fs
        self.notes: list[str] = []
        self.gpus: list[_LiveGpu] = []
        self.driver_version: str | None = None  # "550.54.15"
        self._pcie_turn = 0
        self._closed = False
        self._consts = {
            "sm": getattr(nvml, "NVML_CLOCK_SM", 1),
            "mem": getattr(nvml, "NVML_CLOCK_MEM", 2),
            "sensor": getattr(nvml, "NVML_TEMPERATURE_GPU", 0),
            "tx": getattr(nvml, "NVML_PCIE_UTIL_TX_BYTES", 0),
            "rx": getattr(nvml, "NVML_PCIE_UTIL_RX_BYTES", 1),
            "corrected": getattr(nvml, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0),
            "uncorrected": getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
            "volatile": getattr(nvml, "NVML_VOLATILE_ECC", 0),
        }

    @classmethod
    def open(cls, nvml: Any, indices: Iterable[int] | None = None, fs: SysFs | None = None) -> GpuStateReader:
        """Start NVML and look up the GPUs (all, or those ``indices`` name, by NVML index).

        Raises ``NvmlGone`` where NVML will not start or cannot count the GPUs; its ``code`` is the
        probe's ``error_code`` ("driver_not_loaded"...), its ``message`` says why in words.
        """
        try:
            nvml.nvmlInit()
        except Exception as exc:
            code, message = _init_error(nvml, exc)
            raise NvmlGone(message, code) from None
        reader = cls(nvml, fs or SysFs("/"))
        try:
            reader._discover(indices)
        except BaseException:
            reader.close()
            raise
        return reader

    def _discover(self, indices: Iterable[int] | None) -> None:
        system = _LiveQuery(self.nvml, self.notes, "NVML", self.fs)
        self.driver_version = system("nvmlSystemGetDriverVersion")
        try:
            count = system("nvmlDeviceGetCount")
        except _GpuLost:
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
        q = _LiveQuery(self.nvml, self.notes, f"GPU {index}", self.fs)
        gpu = _LiveGpu(index=index, q=q)
        try:
            gpu.handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:
            if isinstance(exc, q._gone):
                raise NvmlGone(f"nvmlDeviceGetHandleByIndex: {_describe(self.nvml, exc)}") from None
            q.note(f"no NVML handle ({_describe(self.nvml, exc)}); read as lost")
            return gpu
        static = Gpu(index=index)
        try:
            for read in (_read_identity, _read_clocks, _read_thermal, _read_pcie, _read_nvlinks):
                read(q, gpu.handle, static)
        except _GpuLost:
            return gpu  # read as lost from the first sample on
        gpu.uuid, gpu.name, gpu.pci_bus_id = static.uuid, static.name, static.pci_bus_id
        gpu.sm_clock_max_hertz = _hertz(static.clocks.sm_max_mhz)
        gpu.memory_clock_max_hertz = _hertz(static.clocks.memory_max_mhz)
        gpu.pcie_link_generation_max = static.pcie.gen_max
        gpu.pcie_link_width_max = static.pcie.width_max
        slowdown = static.thermal.slowdown_c
        gpu.temperature_slowdown_celsius = None if slowdown is None else float(slowdown)
        gpu.fields = self._supported_fields(q, gpu.handle, has_nvlink=bool(static.nvlinks))
        try:
            gpu.gpm = _Gpm.open(q, gpu.handle)
        except _GpuLost:
            gpu.gpm = None
        return gpu

    def _supported_fields(self, q: _LiveQuery, handle: Any, has_nvlink: bool) -> tuple[Any, ...]:
        """The counter fields this GPU answers, each tried alone: a driver that lacks one answers an error
        for that field only, and a binding that cannot pass a scope fails only the NVLink ones."""
        candidates = [(name, q.const(const, fid), 0, unit, True) for name, const, fid, unit in _PCIE_FIELDS]
        if has_nvlink:
            candidates += [(name, q.const(c, fid), _ALL_LINKS, unit, False) for name, c, fid, unit in _NVLINK_FIELDS]
        supported = []
        for candidate in candidates:
            _, field_id, scope, _, wide_only = candidate
            try:
                values = q("nvmlDeviceGetFieldValues", handle, [(field_id, scope) if scope else field_id])
            except _GpuLost:
                return ()
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
        without = [g for g in self.gpus if g.handle is not None and not g.has_pcie_counters]
        if not without:
            return None
        self._pcie_turn %= len(without)
        gpu = without[self._pcie_turn]
        self._pcie_turn += 1
        return gpu

    def _read_gpu(self, gpu: _LiveGpu, now: float, refresh_pcie_spot: bool) -> GpuSample:
        # imported here, not with the module: redline.monitor's modules import this one, and the probe
        # (which never needs monitor) must not depend on what the monitor package imports when it loads
        from redline.monitor.sample import GpuSample

        if gpu.handle is None:
            return gpu.lost_sample()
        sample = GpuSample(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            sm_clock_max_hertz=gpu.sm_clock_max_hertz,
            memory_clock_max_hertz=gpu.memory_clock_max_hertz,
            pcie_link_generation_max=gpu.pcie_link_generation_max,
            pcie_link_width_max=gpu.pcie_link_width_max,
            temperature_slowdown_celsius=gpu.temperature_slowdown_celsius,
        )
        for what, read in _LIVE_GROUPS:
            try:
                read(self, gpu, sample, now)
            except _GpuLost:
                return gpu.lost_sample()
            except NvmlGone:
                raise
            except Exception as exc:  # a binding handing back an unexpected shape: lose this group only
                gpu.q.note(f"reading {what}: {type(exc).__name__}: {exc}")
        if refresh_pcie_spot:
            self._read_pcie_spot(gpu)
        if not gpu.has_pcie_counters:
            sample.pcie_tx_bytes_per_second, sample.pcie_rx_bytes_per_second = gpu.pcie_spot
        return sample

    def _read_pcie_spot(self, gpu: _LiveGpu) -> None:
        try:
            tx = gpu.q("nvmlDeviceGetPcieThroughput", gpu.handle, self._consts["tx"])
            rx = gpu.q("nvmlDeviceGetPcieThroughput", gpu.handle, self._consts["rx"])
        except _GpuLost:
            return
        # NVML measures over 20 ms and answers in KiB/s
        gpu.pcie_spot = (_times(tx, 1024), _times(rx, 1024))

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


def _hertz(mhz: float | None) -> float | None:
    return _times(mhz, 1e6)


def _xid_total(pci_bus_id: str | None, xids: dict[str, dict[str, int]] | None) -> int | None:
    """Xids of this GPU: the log names a device without its function ('0000:3b:00'), old drivers
    without the domain either ('3b:00')."""
    if pci_bus_id is None or xids is None:
        return None
    device = pci_bus_id.rpartition(".")[0] or pci_bus_id  # '0000:3b:00'
    without_domain = device.partition(":")[2]
    total = 0
    for pci, counts in xids.items():
        key = normalize_pci_bus_id(pci) if pci.count(":") == 2 else pci
        if key in (device, without_domain):
            total += sum(counts.values())
    return total


def _live_utilization(reader: GpuStateReader, gpu: _LiveGpu, sample: GpuSample, now: float) -> None:
    # .gpu: the share of the last period in which any kernel ran; .memory: the share device memory was busy
    utilization = gpu.q("nvmlDeviceGetUtilizationRates", gpu.handle)
    if utilization is not None:
        sample.utilization_ratio = utilization.gpu / 100
        sample.memory_bandwidth_ratio = utilization.memory / 100


def _live_memory(reader: GpuStateReader, gpu: _LiveGpu, sample: GpuSample, now: float) -> None:
    scratch = Gpu(index=gpu.index)
    _read_memory(gpu.q, gpu.handle, scratch)
    sample.memory_used_bytes = scratch.memory_used_bytes
    sample.memory_total_bytes = scratch.memory_total_bytes


def _live_clocks(reader: GpuStateReader, gpu: _LiveGpu, sample: GpuSample, now: float) -> None:
    q, h = gpu.q, gpu.handle
    sample.sm_clock_hertz = _hertz(q("nvmlDeviceGetClockInfo", h, reader._consts["sm"]))
    sample.memory_clock_hertz = _hertz(q("nvmlDeviceGetClockInfo", h, reader._consts["mem"]))
    mask = q.first(("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"), h)
    sample.clock_event_reasons = None if mask is None else clock_event_reason_names(q.nvml, mask)


def _live_power(reader: GpuStateReader, gpu: _LiveGpu, sample: GpuSample, now: float) -> None:
    q, h = gpu.q, gpu.handle
    # milliwatts; the enforced limit is read every time because `nvidia-smi -pl` changes it at run time
    sample.power_watts = _scaled(q("nvmlDeviceGetPowerUsage", h), 1000)
    sample.power_limit_watts = _scaled(q("nvmlDeviceGetEnforcedPowerLimit", h), 1000)
    # millijoules since the driver loaded (Volta and later)
    sample.energy_joules_total = _scaled(q("nvmlDeviceGetTotalEnergyConsumption", h), 1000)


def _live_thermal(reader: GpuStateReader, gpu: _LiveGpu, sample: GpuSample, now: float) -> None:
    temperature = gpu.q("nvmlDeviceGetTemperature", gpu.handle, reader._consts["sensor"])
    sample.temperature_celsius = None if temperature is None else float(temperature)


def _live_pcie(reader: GpuStateReader, gpu: _LiveGpu, sample: GpuSample, now: float) -> None:
    q, h = gpu.q, gpu.handle
    sample.pcie_link_generation = q("nvmlDeviceGetCurrPcieLinkGeneration", h)
    sample.pcie_link_width = q("nvmlDeviceGetCurrPcieLinkWidth", h)
    sample.pcie_replay_total = q("nvmlDeviceGetPcieReplayCounter", h)


def _live_counters(reader: GpuStateReader, gpu: _LiveGpu, sample: GpuSample, now: float) -> None:
    """PCIe and NVLink bytes per second from cumulative counters, all in one nvmlDeviceGetFieldValues."""
    if not gpu.fields:
        return
    request = [(field_id, scope) if scope else field_id for _, field_id, scope, _, _ in gpu.fields]
    values = gpu.q("nvmlDeviceGetFieldValues", gpu.handle, request)
    readings: dict[str, float] = {}
    if values is not None:
        for (name, _, _, _, wide_only), value in zip(gpu.fields, values, strict=True):
            number = _field_value(reader.nvml, value, wide_only)
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


def _live_ecc(reader: GpuStateReader, gpu: _LiveGpu, sample: GpuSample, now: float) -> None:
    q, h, c = gpu.q, gpu.handle, reader._consts
    # volatile: since the driver loaded, so the count that moves while a job runs
    sample.ecc_corrected_total = q("nvmlDeviceGetTotalEccErrors", h, c["corrected"], c["volatile"])
    sample.ecc_uncorrected_total = q("nvmlDeviceGetTotalEccErrors", h, c["uncorrected"], c["volatile"])


def _live_gpm(reader: GpuStateReader, gpu: _LiveGpu, sample: GpuSample, now: float) -> None:
    if gpu.gpm is None:
        return
    metrics = gpu.gpm.read()
    sample.sm_activity_ratio = metrics.get("sm_activity_ratio")
    sample.tensor_activity_ratio = metrics.get("tensor_activity_ratio")


def _live_processes(reader: GpuStateReader, gpu: _LiveGpu, sample: GpuSample, now: float) -> None:
    from redline.monitor.sample import GpuProcess as ProcessSample  # see GpuStateReader._read_gpu

    scratch = Gpu(index=gpu.index)
    _read_processes(gpu.q, gpu.handle, scratch)
    sample.processes = [
        ProcessSample(
            pid=p.pid,
            name=p.name,
            user=None if p.uid is None else _user_name(p.uid),
            used_memory_bytes=p.used_memory_bytes,
            kind=p.kind,
        )
        for p in scratch.processes or []
    ]


_LIVE_GROUPS: tuple[tuple[str, Callable[[GpuStateReader, _LiveGpu, GpuSample, float], None]], ...] = (
    ("utilization", _live_utilization),
    ("memory", _live_memory),
    ("clocks", _live_clocks),
    ("power", _live_power),
    ("thermal", _live_thermal),
    ("pcie", _live_pcie),
    ("counters", _live_counters),
    ("ecc", _live_ecc),
    ("gpm", _live_gpm),
    ("processes", _live_processes),
)
