"""A fake of the pynvml surface that redline.hw.nvml uses, driven by plain dataclasses.

    nvml = eight_gpu_server(faults={3: {"temperature_c": 91, "clock_event_reasons": HW_THERMAL}})
    section = probe_gpus(nvml)

Exceptions, constants and structs are pynvml's own, so the adapter sees what real NVML raises and
returns: bytes in struct fields, ctypes arrays, nvmlFriendlyObject process records. A ``FakeGpu`` holds
values in NVML's units (mW, MHz, percent, NVML enum values) and ``None`` in a field makes the call that
reads it answer NOT_SUPPORTED, as naming the call in ``unsupported`` does; ``errors`` makes a call raise
whatever it holds; ``lost`` makes every call on the GPU answer GPU_IS_LOST, as after Xid 79.
``FakeNvml(missing=...)`` hides functions or constants, to play an older nvidia-ml-py, and
``FakeNvml.unload()`` / ``reload()`` play the driver going away under a running process and coming back.

Counters (energy, PCIe and NVLink bytes) only grow when something advances them: a test sets them, or
``FakeGpu.run_for(seconds)`` integrates the current power and throughput over that time, as
tests/fakes/traces.py does tick by tick.

NVML lists processes by pid only; their names and owners come from /proc, so a test that wants them
writes them into its SysRoot (``SysRoot.add_process``) and passes that tree to ``probe_gpus(fs=...)``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pynvml

MiB = 1 << 20

# clock event reason bits, for building masks in tests
GPU_IDLE = pynvml.nvmlClocksEventReasonGpuIdle
SW_POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap
HW_SLOWDOWN = pynvml.nvmlClocksEventReasonHwSlowdown
SW_THERMAL = pynvml.nvmlClocksEventReasonSwThermalSlowdown
HW_THERMAL = pynvml.nvmlClocksEventReasonHwThermalSlowdown
HW_POWER_BRAKE = pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown


@dataclass
class FakeProcess:
    pid: int
    # bytes. Current bindings turn NVML_VALUE_NOT_AVAILABLE into None; older ones pass the raw
    # pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value through. Set whichever the test plays.
    used_memory: int | None = None
    kind: str = "compute"  # compute | graphics


@dataclass
class FakeGpu:
    name: str = "NVIDIA Fake GPU"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    bus_id: str = "00000000:18:00.0"  # as NVML writes it: 8-digit domain, upper-case hex
    memory_total_mib: int | None = None
    memory_used_mib: int = 0
    cc: tuple[int, int] | None = None
    # NVML answers this for MIG device handles only, so the boards below leave it NOT_SUPPORTED
    multiprocessor_count: int | None = None
    persistence: bool | None = None
    compute_mode: int | None = None  # pynvml.NVML_COMPUTEMODE_*
    mig: bool | None = None
    virt: int | None = None  # pynvml.NVML_GPU_VIRTUALIZATION_MODE_*
    utilization_pct: int | None = None
    memory_utilization_pct: int = 0  # NVML's "memory utilisation": share of time device memory was busy
    sm_clock_mhz: int | None = None
    sm_max_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    mem_max_clock_mhz: int | None = None
    app_sm_clock_mhz: int | None = None
    clock_event_reasons: int | None = None  # bitmask, see GPU_IDLE, SW_POWER_CAP...
    power_draw_mw: int | None = None
    power_limit_mw: int | None = None  # enforced
    power_default_mw: int | None = None
    power_min_mw: int | None = None
    power_max_mw: int | None = None
    temperature_c: int | None = None
    slowdown_c: int | None = None
    shutdown_c: int | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None  # what the slot allows
    pcie_gen_gpu_max: int | None = None  # what the GPU can do
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    pcie_replay: int | None = None
    pcie_tx_kbps: int | None = None  # nvmlDeviceGetPcieThroughput: KiB/s over NVML's 20 ms window
    pcie_rx_kbps: int | None = None
    pcie_tx_bytes_total: int | None = None  # NVML_FI_DEV_PCIE_COUNT_TX_BYTES (r550+ drivers); None: unsupported
    pcie_rx_bytes_total: int | None = None
    nvlink_tx_kib_total: int | None = None  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX over all links, KiB
    nvlink_rx_kib_total: int | None = None
    nvlink_tx_kibps: int = 0  # what run_for() adds to the NVLink counters per second
    nvlink_rx_kibps: int = 0
    energy_mj: int | None = None  # nvmlDeviceGetTotalEnergyConsumption: mJ since the driver loaded
    ecc_enabled: bool | None = None
    ecc_volatile_corrected: int | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    remapped_rows: tuple[int, int, bool, bool] | None = None  # correctable, uncorrectable, pending, failed
    retired_pages_single_bit: int | None = None  # how many pages; the fake makes up their addresses
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    nvlinks: list[tuple[bool, str | None]] | None = None  # per link: (active, remote bus id); None: no NVLink
    fabric_state: int | None = None  # pynvml.NVML_GPU_FABRIC_STATE_*
    fabric_status: int = pynvml.NVML_SUCCESS  # what the fabric manager said once the state is COMPLETED
    numa_node: int | None = None  # NVML answers only where GPU memory is a NUMA node (Grace Hopper)
    cpu_affinity: list[int] | None = None
    # Hopper+ GPM metrics in percent; None: not a GPM device (nvmlGpmQueryDeviceSupport says so)
    gpm_sm_util_pct: float | None = None
    gpm_tensor_util_pct: float | None = None
    processes: list[FakeProcess] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)  # NVML function names answering NOT_SUPPORTED
    errors: dict[str, BaseException] = field(default_factory=dict)  # NVML function name -> what it raises
    lost: bool = False
    # MIG mode: the instances by slot (nvmlDeviceGetMigDeviceHandleByIndex), None for an empty slot; each a
    # FakeGpu answering for the instance (its UUID "MIG-...", its memory, its processes, its ids)
    mig_devices: list[FakeGpu | None] = field(default_factory=list)
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    def run_for(self, seconds: float) -> None:
        """Advance the counters by ``seconds`` at the current power draw and PCIe/NVLink throughput."""
        if self.energy_mj is not None and self.power_draw_mw is not None:
            self.energy_mj += round(self.power_draw_mw * seconds)  # mW x s = mJ
        for total, kbps in (("pcie_tx_bytes_total", self.pcie_tx_kbps), ("pcie_rx_bytes_total", self.pcie_rx_kbps)):
            if getattr(self, total) is not None and kbps is not None:
                setattr(self, total, getattr(self, total) + round(kbps * 1024 * seconds))
        if self.nvlink_tx_kib_total is not None:
            self.nvlink_tx_kib_total += round(self.nvlink_tx_kibps * seconds)
        if self.nvlink_rx_kib_total is not None:
            self.nvlink_rx_kib_total += round(self.nvlink_rx_kibps * seconds)


@dataclass(frozen=True)
class FakeHandle:
    index: int
    mig: int | None = None  # a MIG device's slot on the GPU ``index``: the handle is that instance's


PairTable = list[list[int]] | Callable[[int, int], int] | None


def _device_call(method: Callable[..., Any]) -> Callable[..., Any]:
    """Look the handle's FakeGpu up, apply its failure switches, and answer NOT_SUPPORTED for None."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: FakeNvml, handle: FakeHandle, *args: Any, **kwargs: Any) -> Any:
        value = method(self, self._gpu(name, handle), *args, **kwargs)
        if value is None:
            raise pynvml.NVMLError_NotSupported()
        return value

    return call


class FakeNvml:
    """Stands in for the pynvml module: pass it as ``probe_gpus(nvml=...)``."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        driver: str = "550.54.15",
        cuda: int = 12040,
        nvml_version: str = "12.550.54.15",
        p2p: PairTable = None,
        topology: PairTable = None,
        init_error: BaseException | type[BaseException] | None = None,
        errors: dict[str, BaseException] | None = None,
        missing: Iterable[str] = (),
    ) -> None:
        self.gpus = gpus
        self.driver = driver
        self.cuda = cuda
        self.nvml_version = nvml_version
        self.p2p = p2p
        self.topology = topology
        self.init_error = init_error
        self.errors = errors or {}  # system-level calls (nvmlInit, nvmlDeviceGetCount...) -> what they raise
        self.missing = frozenset(missing)  # attributes this "older binding" lacks
        self.active_inits = 0
        self.calls: list[str] = []
        self.unloaded: BaseException | None = None  # set by unload(): what nvmlInit answers meanwhile
        self._gpm_samples: dict[int, tuple[Any, tuple[int, float, float] | None]] = {}  # address -> buffer, data

        if self.missing:
            # only an "older binding" pays for checking every attribute lookup (a monitor test makes many)
            self.__class__ = _OlderBinding

    # ----------------------------------------------------------------------- module-like behaviour

    def __getattr__(self, name: str) -> Any:
        """pynvml's exceptions, constants and structs; functions the fake lacks stay missing."""
        if name.startswith("__") or name in self.__dict__.get("missing", ()):
            raise AttributeError(name)
        value = getattr(pynvml, name)
        if inspect.isfunction(value):
            raise AttributeError(f"the fake NVML does not implement {name}")
        self.__dict__[name] = value  # pynvml's constants and classes never change: later lookups skip this
        return value

    def _system(self, name: str) -> None:
        self.calls.append(name)
        if name in self.errors:
            raise self.errors[name]
        if not self.active_inits:
            raise pynvml.NVMLError_Uninitialized()

    def _gpu(self, name: str, handle: FakeHandle) -> FakeGpu:
        self._system(name)
        gpu = self.gpus[handle.index]
        if handle.mig is not None:
            if gpu.lost:
                raise pynvml.NVMLError_GpuIsLost()
            gpu = gpu.mig_devices[handle.mig]
            assert gpu is not None
        if name in gpu.errors:
            raise gpu.errors[name]
        if gpu.lost:
            raise pynvml.NVMLError_GpuIsLost()
        if name in gpu.unsupported:
            raise pynvml.NVMLError_NotSupported()
        return gpu

    # --------------------------------------------------------------------------------- system

    def unload(self, error: BaseException | None = None) -> None:
        """The driver goes away under the running process (rmmod, an upgrade, a crash): NVML forgets it was
        initialised, so every call answers UNINITIALIZED and nvmlInit answers ``error`` (DRIVER_NOT_LOADED)."""
        self.unloaded = error or pynvml.NVMLError_DriverNotLoaded()
        self.active_inits = 0
        self._gpm_samples.clear()

    def reload(self) -> None:
        """The driver is back: nvmlInit works again (the process has to call it)."""
        self.unloaded = None

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise self.init_error
        if self.unloaded is not None:
            raise self.unloaded
        self.active_inits += 1

    def nvmlShutdown(self) -> None:
        self._system("nvmlShutdown")
        self.active_inits -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._system("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._system("nvmlSystemGetNVMLVersion")
        return self.nvml_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._system("nvmlSystemGetCudaDriverVersion")
        return self.cuda

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._system("nvmlSystemGetCudaDriverVersion_v2")
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        self._system("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._system("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        error = self.gpus[index].errors.get("nvmlDeviceGetHandleByIndex")
        if error is not None:
            raise error
        return FakeHandle(index)

    def nvmlDeviceGetP2PStatus(self, handle1: FakeHandle, handle2: FakeHandle, p2p_index: int) -> int:
        if not isinstance(p2p_index, int):  # what ctypes says when handed pynvml's tuple constant
            raise ctypes.ArgumentError("argument 3: TypeError: Don't know how to convert parameter 3")
        self._gpu("nvmlDeviceGetP2PStatus", handle1)
        self._gpu("nvmlDeviceGetP2PStatus", handle2)
        return self._pair(self.p2p, handle1.index, handle2.index, lambda i, j: pynvml.NVML_P2P_STATUS_OK)

    def nvmlDeviceGetTopologyCommonAncestor(self, handle1: FakeHandle, handle2: FakeHandle) -> int:
        self._gpu("nvmlDeviceGetTopologyCommonAncestor", handle1)
        self._gpu("nvmlDeviceGetTopologyCommonAncestor", handle2)
        return self._pair(self.topology, handle1.index, handle2.index, self._same_cpus_topology)

    @staticmethod
    def _pair(table: PairTable, i: int, j: int, default: Callable[[int, int], int]) -> int:
        if table is None:
            return default(i, j)
        if callable(table):
            return table(i, j)
        return table[i][j]

    def _same_cpus_topology(self, i: int, j: int) -> int:
        """GPUs near the same CPUs meet at that socket's root complex (NODE); others cross sockets (SYS)."""
        same = self.gpus[i].cpu_affinity == self.gpus[j].cpu_affinity
        return pynvml.NVML_TOPOLOGY_NODE if same else pynvml.NVML_TOPOLOGY_SYSTEM

    # --------------------------------------------------------------------------------- per GPU

    @_device_call
    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        return gpu.name

    @_device_call
    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        return gpu.uuid

    @_device_call
    def nvmlDeviceGetPciInfo(self, gpu: FakeGpu) -> pynvml.nvmlPciInfo_t:
        return _pci_info(gpu.bus_id)

    @_device_call
    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu, version: int | None = None) -> Any:
        if gpu.memory_total_mib is None:
            return None
        total, used = gpu.memory_total_mib * MiB, gpu.memory_used_mib * MiB
        if not version:
            return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)
        if "nvmlDeviceGetMemoryInfo_v2" in gpu.unsupported:
            raise pynvml.NVMLError_FunctionNotFound()  # a driver older than r510
        if version != pynvml.nvmlMemory_v2:
            raise pynvml.NVMLError_ArgumentVersionMismatch()
        return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=0, free=total - used, used=used)

    @_device_call
    def nvmlDeviceGetCudaComputeCapability(self, gpu: FakeGpu) -> tuple[int, int] | None:
        return gpu.cc

    @_device_call
    def nvmlDeviceGetAttributes_v2(self, gpu: FakeGpu) -> Any:
        if gpu.multiprocessor_count is None:
            return None
        return pynvml.c_nvmlDeviceAttributes(multiprocessorCount=gpu.multiprocessor_count)

    @_device_call
    def nvmlDeviceGetAttributes(self, gpu: FakeGpu) -> Any:
        if gpu.multiprocessor_count is None:
            return None
        return pynvml.c_nvmlDeviceAttributes(multiprocessorCount=gpu.multiprocessor_count)

    @_device_call
    def nvmlDeviceGetPersistenceMode(self, gpu: FakeGpu) -> int | None:
        return _feature(gpu.persistence)

    @_device_call
    def nvmlDeviceGetComputeMode(self, gpu: FakeGpu) -> int | None:
        return gpu.compute_mode

    @_device_call
    def nvmlDeviceGetMigMode(self, gpu: FakeGpu) -> list[int] | None:
        if gpu.mig is None:
            return None
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.mig else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    @_device_call
    def nvmlDeviceGetMaxMigDeviceCount(self, gpu: FakeGpu) -> int | None:
        return 7 if gpu.mig else None  # an A100's or H100's most instances

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeHandle, index: int) -> FakeHandle:
        gpu = self._gpu("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if not gpu.mig:
            raise pynvml.NVMLError_NotSupported()
        if not 0 <= index < 7:
            raise pynvml.NVMLError_InvalidArgument()
        if index >= len(gpu.mig_devices) or gpu.mig_devices[index] is None:
            raise pynvml.NVMLError_NotFound()  # no instance in that slot
        return FakeHandle(handle.index, index)

    @_device_call
    def nvmlDeviceGetGpuInstanceId(self, gpu: FakeGpu) -> int | None:
        return gpu.gpu_instance_id

    @_device_call
    def nvmlDeviceGetComputeInstanceId(self, gpu: FakeGpu) -> int | None:
        return gpu.compute_instance_id

    @_device_call
    def nvmlDeviceGetVirtualizationMode(self, gpu: FakeGpu) -> int | None:
        return gpu.virt

    @_device_call
    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> Any:
        if gpu.utilization_pct is None:
            return None
        return pynvml.c_nvmlUtilization_t(gpu=gpu.utilization_pct, memory=gpu.memory_utilization_pct)

    @_device_call
    def nvmlDeviceGetClockInfo(self, gpu: FakeGpu, clock_type: int) -> int | None:
        return _clock(gpu.sm_clock_mhz, gpu.mem_clock_mhz, clock_type)

    @_device_call
    def nvmlDeviceGetMaxClockInfo(self, gpu: FakeGpu, clock_type: int) -> int | None:
        return _clock(gpu.sm_max_clock_mhz, gpu.mem_max_clock_mhz, clock_type)

    @_device_call
    def nvmlDeviceGetApplicationsClock(self, gpu: FakeGpu, clock_type: int) -> int | None:
        return _clock(gpu.app_sm_clock_mhz, gpu.mem_max_clock_mhz, clock_type)

    @_device_call
    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGpu) -> int | None:
        return gpu.clock_event_reasons

    @_device_call
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, gpu: FakeGpu) -> int | None:
        return gpu.clock_event_reasons

    @_device_call
    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int | None:
        return gpu.power_draw_mw

    @_device_call
    def nvmlDeviceGetEnforcedPowerLimit(self, gpu: FakeGpu) -> int | None:
        return gpu.power_limit_mw

    @_device_call
    def nvmlDeviceGetPowerManagementDefaultLimit(self, gpu: FakeGpu) -> int | None:
        return gpu.power_default_mw

    @_device_call
    def nvmlDeviceGetPowerManagementLimitConstraints(self, gpu: FakeGpu) -> list[int] | None:
        if gpu.power_min_mw is None or gpu.power_max_mw is None:
            return None
        return [gpu.power_min_mw, gpu.power_max_mw]

    @_device_call
    def nvmlDeviceGetTotalEnergyConsumption(self, gpu: FakeGpu) -> int | None:
        return gpu.energy_mj

    @_device_call
    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int | None:
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError_InvalidArgument()
        return gpu.temperature_c

    @_device_call
    def nvmlDeviceGetTemperatureThreshold(self, gpu: FakeGpu, threshold: int) -> int | None:
        if threshold == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            return gpu.slowdown_c
        if threshold == pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
            return gpu.shutdown_c
        return None

    @_device_call
    def nvmlDeviceGetCurrPcieLinkGeneration(self, gpu: FakeGpu) -> int | None:
        return gpu.pcie_gen

    @_device_call
    def nvmlDeviceGetMaxPcieLinkGeneration(self, gpu: FakeGpu) -> int | None:
        return gpu.pcie_gen_max

    @_device_call
    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, gpu: FakeGpu) -> int | None:
        return gpu.pcie_gen_gpu_max

    @_device_call
    def nvmlDeviceGetCurrPcieLinkWidth(self, gpu: FakeGpu) -> int | None:
        return gpu.pcie_width

    @_device_call
    def nvmlDeviceGetMaxPcieLinkWidth(self, gpu: FakeGpu) -> int | None:
        return gpu.pcie_width_max

    @_device_call
    def nvmlDeviceGetPcieReplayCounter(self, gpu: FakeGpu) -> int | None:
        return gpu.pcie_replay

    @_device_call
    def nvmlDeviceGetPcieThroughput(self, gpu: FakeGpu, counter: int) -> int | None:
        if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES:
            return gpu.pcie_tx_kbps
        if counter == pynvml.NVML_PCIE_UTIL_RX_BYTES:
            return gpu.pcie_rx_kbps
        raise pynvml.NVMLError_InvalidArgument()

    @_device_call
    def nvmlDeviceGetFieldValues(self, gpu: FakeGpu, field_ids: list[int | tuple[int, int]]) -> Any:
        """As NVML fills them: one nvmlFieldValue_t per id, each with its own nvmlReturn."""
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for value, requested in zip(values, field_ids, strict=True):
            field_id, scope = requested if isinstance(requested, tuple) else (requested, 0)
            value.fieldId, value.scopeId = field_id, scope
            number = _field_number(gpu, field_id, scope)
            if number is None:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            value.nvmlReturn = pynvml.NVML_SUCCESS
            value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            value.value.ullVal = number
        return values

    @_device_call
    def nvmlDeviceGetEccMode(self, gpu: FakeGpu) -> list[int] | None:
        mode = _feature(gpu.ecc_enabled)
        return None if mode is None else [mode, mode]

    @_device_call
    def nvmlDeviceGetTotalEccErrors(self, gpu: FakeGpu, error_type: int, counter_type: int) -> int | None:
        counts = {
            (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC): gpu.ecc_volatile_corrected,
            (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC): gpu.ecc_volatile_uncorrected,
            (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC): gpu.ecc_aggregate_corrected,
            (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC): gpu.ecc_aggregate_uncorrected,
        }
        if (error_type, counter_type) not in counts:
            raise pynvml.NVMLError_InvalidArgument()
        return counts[error_type, counter_type]

    @_device_call
    def nvmlDeviceGetRemappedRows(self, gpu: FakeGpu) -> tuple[int, int, int, int] | None:
        if gpu.remapped_rows is None:
            return None
        correctable, uncorrectable, pending, failed = gpu.remapped_rows
        return (correctable, uncorrectable, int(pending), int(failed))

    @_device_call
    def nvmlDeviceGetRetiredPages(self, gpu: FakeGpu, cause: int) -> list[int] | None:
        if cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS:
            count = gpu.retired_pages_single_bit
        elif cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR:
            count = gpu.retired_pages_double_bit
        else:
            raise pynvml.NVMLError_InvalidArgument()
        return None if count is None else [0x1000 * (page + 1) for page in range(count)]

    @_device_call
    def nvmlDeviceGetRetiredPagesPendingStatus(self, gpu: FakeGpu) -> int | None:
        return _feature(gpu.retired_pages_pending)

    @_device_call
    def nvmlDeviceGetNvLinkState(self, gpu: FakeGpu, link: int) -> int | None:
        if gpu.nvlinks is None:
            return None
        if not 0 <= link < len(gpu.nvlinks):
            raise pynvml.NVMLError_InvalidArgument()
        return int(gpu.nvlinks[link][0])

    @_device_call
    def nvmlDeviceGetNvLinkRemotePciInfo(self, gpu: FakeGpu, link: int) -> pynvml.nvmlPciInfo_t | None:
        if gpu.nvlinks is None:
            return None
        if not 0 <= link < len(gpu.nvlinks):
            raise pynvml.NVMLError_InvalidArgument()
        remote = gpu.nvlinks[link][1]
        return None if remote is None else _pci_info(remote)

    @_device_call
    def nvmlDeviceGetGpuFabricInfoV(self, gpu: FakeGpu, info_ref: Any) -> int | None:
        info = info_ref._obj  # the struct behind ctypes.byref(...)
        if info.version != pynvml.nvmlGpuFabricInfo_v2:
            raise pynvml.NVMLError_ArgumentVersionMismatch()
        return self._fill_fabric(gpu, info)

    @_device_call
    def nvmlDeviceGetGpuFabricInfo(self, gpu: FakeGpu, info_ref: Any) -> int | None:
        return self._fill_fabric(gpu, info_ref._obj)

    @staticmethod
    def _fill_fabric(gpu: FakeGpu, info: Any) -> int | None:
        if gpu.fabric_state is None:
            return None
        info.state = gpu.fabric_state
        info.status = gpu.fabric_status
        return pynvml.NVML_SUCCESS

    @_device_call
    def nvmlDeviceGetNumaNodeId(self, gpu: FakeGpu) -> int | None:
        return gpu.numa_node

    @_device_call
    def nvmlDeviceGetCpuAffinity(self, gpu: FakeGpu, cpu_set_size: int) -> Any:
        if gpu.cpu_affinity is None:
            return None
        words = (ctypes.c_ulonglong * cpu_set_size)()  # NVML fills only the words the caller asked for
        for cpu in gpu.cpu_affinity:
            if cpu < 64 * cpu_set_size:
                words[cpu // 64] |= 1 << (cpu % 64)
        return words

    @_device_call
    def nvmlDeviceGetComputeRunningProcesses(self, gpu: FakeGpu) -> list[Any]:
        return _processes(gpu, "compute")

    @_device_call
    def nvmlDeviceGetGraphicsRunningProcesses(self, gpu: FakeGpu) -> list[Any]:
        return _processes(gpu, "graphics")

    # ------------------------------------------------------------------ GPM (Hopper+ performance monitoring)
    # NVML's sample buffers are opaque pointers the caller allocates and frees; the fake keeps each buffer's
    # struct alive and remembers, by address, what the GPU was doing when it was taken.

    @_device_call
    def nvmlGpmQueryDeviceSupport(self, gpu: FakeGpu) -> Any:
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(gpu.gpm_sm_util_pct is not None)
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        self._system("nvmlGpmSampleAlloc")
        buffer = pynvml.struct_c_nvmlGpmSample_t()
        self._gpm_samples[ctypes.addressof(buffer)] = (buffer, None)
        return ctypes.pointer(buffer)

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._system("nvmlGpmSampleFree")
        if self._gpm_samples.pop(_address(sample), None) is None:
            raise pynvml.NVMLError_InvalidArgument()

    @_device_call
    def nvmlGpmSampleGet(self, gpu: FakeGpu, sample: Any) -> Any:
        address = _address(sample)
        if address not in self._gpm_samples:
            raise pynvml.NVMLError_InvalidArgument()
        if gpu.gpm_sm_util_pct is None:
            return None
        index = next(i for i, candidate in enumerate(self.gpus) if candidate is gpu)
        reading = (index, gpu.gpm_sm_util_pct, gpu.gpm_tensor_util_pct or 0.0)
        self._gpm_samples[address] = (self._gpm_samples[address][0], reading)
        return sample

    def nvmlGpmMetricsGet(self, metrics_get: Any) -> Any:
        """Each metric over the interval between the two samples; the fake's GPU is steady within a tick, so
        that is what it was doing when the second sample was taken."""
        self._system("nvmlGpmMetricsGet")
        if metrics_get.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise pynvml.NVMLError_ArgumentVersionMismatch()
        first = self._gpm_samples.get(_address(metrics_get.sample1), (None, None))[1]
        second = self._gpm_samples.get(_address(metrics_get.sample2), (None, None))[1]
        if first is None or second is None or first[0] != second[0]:
            raise pynvml.NVMLError_InvalidArgument()
        values = {pynvml.NVML_GPM_METRIC_SM_UTIL: second[1], pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: second[2]}
        for i in range(metrics_get.numMetrics):
            metric = metrics_get.metrics[i]
            value = values.get(metric.metricId)
            metric.nvmlReturn = pynvml.NVML_SUCCESS if value is not None else pynvml.NVML_ERROR_NOT_SUPPORTED
            metric.value = value or 0.0
        return metrics_get


def _address(sample: Any) -> int | None:
    """Where a GPM sample pointer points (None for a null one)."""
    return ctypes.cast(sample, ctypes.c_void_p).value


def _field_number(gpu: FakeGpu, field_id: int, scope: int) -> int | None:
    """A field's value as NVML would give it; None where this GPU or driver does not answer it."""
    if field_id == pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES:
        return gpu.pcie_tx_bytes_total
    if field_id == pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES:
        return gpu.pcie_rx_bytes_total
    if field_id == pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
        return gpu.energy_mj
    nvlink = {
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: gpu.nvlink_tx_kib_total,
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: gpu.nvlink_rx_kib_total,
    }
    if field_id not in nvlink or nvlink[field_id] is None or not gpu.nvlinks:
        return None
    if scope == 0xFFFFFFFF:  # UINT_MAX: the sum over every link
        return nvlink[field_id]
    if scope >= len(gpu.nvlinks):
        return None
    return nvlink[field_id] // len(gpu.nvlinks)  # the fake spreads traffic evenly over the links


class _OlderBinding(FakeNvml):
    """A FakeNvml with ``missing`` attributes: every lookup checks them first."""

    def __getattribute__(self, name: str) -> Any:
        if name in object.__getattribute__(self, "__dict__").get("missing", ()):
            raise AttributeError(name)
        return object.__getattribute__(self, name)


def _feature(enabled: bool | None) -> int | None:
    if enabled is None:
        return None
    return pynvml.NVML_FEATURE_ENABLED if enabled else pynvml.NVML_FEATURE_DISABLED


def _clock(sm: int | None, mem: int | None, clock_type: int) -> int | None:
    if clock_type == pynvml.NVML_CLOCK_SM:
        return sm
    if clock_type == pynvml.NVML_CLOCK_MEM:
        return mem
    raise pynvml.NVMLError_InvalidArgument()


def _pci_info(bus_id: str) -> pynvml.nvmlPciInfo_t:
    """The struct NVML fills: bytes fields, the 8-digit-domain busId and the 4-digit busIdLegacy."""
    domain, bus, device_function = bus_id.split(":")
    info = pynvml.nvmlPciInfo_t()
    info.busId = bus_id.encode()
    info.busIdLegacy = f"{int(domain, 16):04X}:{bus}:{device_function}".encode()
    info.domain = int(domain, 16)
    info.bus = int(bus, 16)
    info.device = int(device_function.split(".")[0], 16)
    return info


def _processes(gpu: FakeGpu, kind: str) -> list[Any]:
    return [
        pynvml.nvmlFriendlyObject(
            {"pid": p.pid, "usedGpuMemory": p.used_memory, "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF}
        )
        for p in gpu.processes
        if p.kind == kind
    ]


# ----------------------------------------------------------------------------------- real boards

# A two-socket host with 56 cores and SMT per socket: GPUs 0-3 hang off socket 0, 4-7 off socket 1.
_SOCKET_CPUS = (
    [*range(0, 56), *range(112, 168)],
    [*range(56, 112), *range(168, 224)],
)
HOST_CPUS = 224

# PCI bus numbers of the eight GPUs on an HGX baseboard, as a typical Xeon host enumerates them
_HGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
# four NVSwitches on an HGX H100 baseboard, six on an HGX A100
_H100_NVSWITCHES = ("00000000:05:00.0", "00000000:06:00.0", "00000000:07:00.0", "00000000:08:00.0")
_A100_NVSWITCHES = tuple(f"00000000:{bus:02X}:00.0" for bus in range(0xC4, 0xCA))


def _hgx_placement(index: int) -> dict[str, Any]:
    bus = _HGX_BUSES[index % 8] + index // 8
    return {"bus_id": f"00000000:{bus:02X}:00.0", "cpu_affinity": list(_SOCKET_CPUS[index // 4 % 2])}


def _with(gpu: FakeGpu, overrides: dict[str, Any]) -> FakeGpu:
    return dataclasses.replace(gpu, **overrides)


def h100_sxm(index: int = 0, **overrides: Any) -> FakeGpu:
    """An idle, healthy H100 SXM5 80GB on an HGX baseboard: 18 NVLinks to 4 NVSwitches, fabric up."""
    switch_of_link = [0] * 5 + [1] * 4 + [2] * 4 + [3] * 5
    gpu = FakeGpu(
        name="NVIDIA H100 80GB HBM3",
        uuid=f"GPU-8a0f1c3e-7d42-4b9a-9e61-{index:012x}",
        memory_total_mib=81559,
        memory_used_mib=0,
        cc=(9, 0),
        persistence=True,
        compute_mode=pynvml.NVML_COMPUTEMODE_DEFAULT,
        mig=False,
        virt=pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE,
        utilization_pct=0,
        sm_clock_mhz=345,
        sm_max_clock_mhz=1980,
        mem_clock_mhz=2619,
        mem_max_clock_mhz=2619,
        app_sm_clock_mhz=1980,
        clock_event_reasons=GPU_IDLE,
        power_draw_mw=71_000,
        power_limit_mw=700_000,
        power_default_mw=700_000,
        power_min_mw=200_000,
        power_max_mw=700_000,
        temperature_c=31,
        slowdown_c=90,
        shutdown_c=92,
        pcie_gen=5,
        pcie_gen_max=5,
        pcie_gen_gpu_max=5,
        pcie_width=16,
        pcie_width_max=16,
        pcie_replay=0,
        pcie_tx_kbps=0,
        pcie_rx_kbps=0,
        pcie_tx_bytes_total=7_340_032_000,
        pcie_rx_bytes_total=48_234_496_000,
        nvlink_tx_kib_total=912_680_550,
        nvlink_rx_kib_total=912_680_550,
        energy_mj=3_125_000_000,  # about 870 Wh since the driver loaded
        gpm_sm_util_pct=0.0,
        gpm_tensor_util_pct=0.0,
        ecc_enabled=True,
        ecc_volatile_corrected=0,
        ecc_volatile_uncorrected=0,
        ecc_aggregate_corrected=0,
        ecc_aggregate_uncorrected=0,
        remapped_rows=(0, 0, False, False),
        # Hopper remaps rows instead of retiring pages: the page calls answer NOT_SUPPORTED (None here)
        nvlinks=[(True, _H100_NVSWITCHES[switch]) for switch in switch_of_link],
        fabric_state=pynvml.NVML_GPU_FABRIC_STATE_COMPLETED,
        **_hgx_placement(index),
    )
    return _with(gpu, overrides)


def a100_sxm_80(index: int = 0, **overrides: Any) -> FakeGpu:
    """An idle, healthy A100 SXM4 80GB on an HGX baseboard: 12 NVLinks to 6 NVSwitches, no fabric state."""
    gpu = FakeGpu(
        name="NVIDIA A100-SXM4-80GB",
        uuid=f"GPU-3c5e9b21-04d8-4f6a-b2c7-{index:012x}",
        memory_total_mib=81920,
        memory_used_mib=0,
        cc=(8, 0),
        persistence=True,
        compute_mode=pynvml.NVML_COMPUTEMODE_DEFAULT,
        mig=False,
        virt=pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE,
        utilization_pct=0,
        sm_clock_mhz=210,
        sm_max_clock_mhz=1410,
        mem_clock_mhz=1593,
        mem_max_clock_mhz=1593,
        app_sm_clock_mhz=1275,
        clock_event_reasons=GPU_IDLE,
        power_draw_mw=62_000,
        power_limit_mw=400_000,
        power_default_mw=400_000,
        power_min_mw=100_000,
        power_max_mw=400_000,
        temperature_c=29,
        slowdown_c=89,
        shutdown_c=92,
        pcie_gen=4,
        pcie_gen_max=4,
        pcie_gen_gpu_max=4,
        pcie_width=16,
        pcie_width_max=16,
        pcie_replay=0,
        pcie_tx_kbps=0,
        pcie_rx_kbps=0,
        pcie_tx_bytes_total=5_242_880_000,
        pcie_rx_bytes_total=31_457_280_000,
        nvlink_tx_kib_total=402_653_184,
        nvlink_rx_kib_total=402_653_184,
        energy_mj=1_840_000_000,
        # Ampere has no GPM: gpm_* stay None
        ecc_enabled=True,
        ecc_volatile_corrected=0,
        ecc_volatile_uncorrected=0,
        ecc_aggregate_corrected=0,
        ecc_aggregate_uncorrected=0,
        remapped_rows=(0, 0, False, False),
        nvlinks=[(True, _A100_NVSWITCHES[link // 2]) for link in range(12)],
        # fabric state is Hopper and later: NOT_SUPPORTED here
        **_hgx_placement(index),
    )
    return _with(gpu, overrides)


def rtx_4090(index: int = 0, **overrides: Any) -> FakeGpu:
    """A GeForce RTX 4090 in a workstation: no ECC, no NVLink, no row remapping, no MIG, no fabric."""
    gpu = FakeGpu(
        name="NVIDIA GeForce RTX 4090",
        uuid=f"GPU-e1b7a9d4-5c2f-4e08-8a3b-{index:012x}",
        bus_id=f"00000000:{0x01 + index * 0x40:02X}:00.0",
        memory_total_mib=24564,
        memory_used_mib=412,
        cc=(8, 9),
        persistence=False,
        compute_mode=pynvml.NVML_COMPUTEMODE_DEFAULT,
        mig=False,
        virt=pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE,
        utilization_pct=3,
        sm_clock_mhz=210,
        sm_max_clock_mhz=3120,
        mem_clock_mhz=405,
        mem_max_clock_mhz=10501,
        clock_event_reasons=GPU_IDLE,
        power_draw_mw=21_500,
        power_limit_mw=450_000,
        power_default_mw=450_000,
        power_min_mw=150_000,
        power_max_mw=600_000,
        temperature_c=38,
        slowdown_c=87,
        shutdown_c=92,
        pcie_gen=1,  # trained down at idle
        pcie_gen_max=4,
        pcie_gen_gpu_max=4,
        pcie_width=16,
        pcie_width_max=16,
        pcie_replay=0,
        # a driver before r550: no PCIe byte counters, only the 20 ms throughput reading
        pcie_tx_kbps=12,
        pcie_rx_kbps=40,
        energy_mj=96_500_000,
        cpu_affinity=list(range(32)),
        unsupported={
            "nvmlDeviceGetEccMode",
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetRemappedRows",
            "nvmlDeviceGetRetiredPages",
            "nvmlDeviceGetRetiredPagesPendingStatus",
            "nvmlDeviceGetNvLinkState",
            "nvmlDeviceGetMigMode",
            "nvmlDeviceGetApplicationsClock",
            "nvmlDeviceGetGpuFabricInfoV",
            "nvmlDeviceGetGpuFabricInfo",
        },
    )
    return _with(gpu, overrides)


_BOARDS: dict[str, Callable[..., FakeGpu]] = {"h100": h100_sxm, "a100": a100_sxm_80, "4090": rtx_4090}


def eight_gpu_server(kind: str = "h100", faults: dict[int, dict[str, Any]] | None = None, **nvml: Any) -> FakeNvml:
    """Eight GPUs of one kind, healthy unless ``faults`` overrides fields of some (by GPU index).

    Further keywords go to FakeNvml (driver, cuda, p2p, topology, missing...).
    """
    faults = faults or {}
    board = _BOARDS[kind]
    return FakeNvml([board(index, **faults.get(index, {})) for index in range(8)], **nvml)
