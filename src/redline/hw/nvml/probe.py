"""The static GPU probe: what NVML can tell about this server's GPUs, read once into the snapshot.

Each GPU is read through a ``Device`` (device.py), group by group, so that a binding handing back an
unexpected shape costs one group only. Only two answers change the flow (see query.py): NVML failing to
start (reported in ``GpuSection.error`` and ``error_code``) and GPU_IS_LOST (mark the GPU ``lost`` and
ask it nothing more). Anything else unexpected becomes ``None`` plus a one-line note for
``Snapshot.probe_errors``, and an error about the GPU's health is also recorded in its ``health_errors``.

The snapshot keeps its own units (MHz, watts, whole degrees Celsius; see hw/snapshot.py, a versioned
format), converted here from the Device's base units.

This module never initialises CUDA: NVML is read-only and does not create contexts on the GPUs.
What NVML names but does not describe (the processes on a GPU, the CPUs a mask covers) is read from
/proc and /sys through the ``SysFs`` passed in, so tests can fake it.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Callable
from typing import Any

from redline.errors import one_line
from redline.hw.host import parse_cpulist
from redline.hw.nvml.device import Device
from redline.hw.nvml.query import GpuLost, Query, describe_error, error_name, init_error, load_bindings
from redline.hw.snapshot import (
    Gpu,
    GpuClocks,
    GpuEcc,
    GpuPower,
    GpuRetirement,
    GpuSection,
    GpuThermal,
    MigDevice,
    NvLink,
    PcieLink,
)
from redline.hw.sysfs import SysFs

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


def probe_gpus(nvml: Any | None = None, errors: list[str] | None = None, fs: SysFs | None = None) -> GpuSection:
    """What NVML can tell about this server's GPUs; never raises.

    ``nvml`` is the ``pynvml`` module, imported here rather than at import time so that ``import redline``
    works on machines without the bindings; tests pass a fake with the same surface. Anything that went
    wrong part-way is appended to ``errors`` (the caller passes ``Snapshot.probe_errors``). ``fs`` reads
    /proc and /sys (process names and owners, the CPU count); tests point it at a fake tree.
    """
    notes = errors if errors is not None else []
    fs = fs or SysFs("/")
    nvml = nvml or load_bindings()
    if nvml is None:
        # the bindings, not the driver, are missing: "other", so no rule tells the user to install a driver
        return GpuSection(nvml_available=False, error="nvidia-ml-py (pynvml) is not installed", error_code="other")

    try:
        nvml.nvmlInit()
    except Exception as exc:
        code, message = init_error(nvml, exc)
        return GpuSection(nvml_available=False, error=message, error_code=code)
    try:
        return _probe(nvml, notes, fs)
    except Exception as exc:  # a bug in this module must not cost the rest of the snapshot
        notes.append(f"NVML probe failed: {one_line(exc)}")
        return GpuSection(nvml_available=True, error=f"the GPU probe failed part-way ({type(exc).__name__})")
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as exc:
            notes.append(f"nvmlShutdown failed: {describe_error(nvml, exc)}")


# ---------------------------------------------------------------------------------------- the probe


def _probe(nvml: Any, notes: list[str], fs: SysFs) -> GpuSection:
    q = Query(nvml, notes, where="NVML", fs=fs)
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
        notes.append(f"GPU {index}: no NVML handle ({describe_error(nvml, exc)}); nothing else was read")
        return gpu, None

    device = Device(Query(nvml, notes, where=f"GPU {index}", fs=fs, health=gpu.health_errors), handle)
    for what, read in _GPU_FIELD_GROUPS:
        try:
            read(device, gpu)
        except GpuLost:
            gpu.lost = True
            break
        except Exception as exc:  # a binding handing back an unexpected shape: lose this group only
            device.q.note(f"reading {what}: {one_line(exc)}")
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
        except GpuLost:
            return "unknown"

    return [[cell(i, j) for j in range(len(gpus))] for i in range(len(gpus))]


def _p2p_status(q: Query, a: Any, b: Any) -> str:
    # NVML_P2P_CAPS_INDEX_READ is 0, but nvidia-ml-py 13.615.71 defines it as the tuple (0,) (a stray
    # trailing comma), which ctypes rejects: pass the number.
    status = q("nvmlDeviceGetP2PStatus", a, b, 0)
    return q.enum_name("P2P status", _P2P_STATUSES, status) or "unknown"


def _topology_level(q: Query, a: Any, b: Any) -> str:
    level = q("nvmlDeviceGetTopologyCommonAncestor", a, b)
    return q.enum_name("topology level", _TOPOLOGY_LEVELS, level) or "unknown"


# ------------------------------------------------------------------------------- one GPU, by group


def _read_identity(d: Device, gpu: Gpu) -> None:
    gpu.name = d.name()
    gpu.uuid = d.uuid()
    gpu.pci_bus_id = d.pci_bus_id()
    gpu.compute_capability = d.compute_capability()
    gpu.multiprocessor_count = d.multiprocessor_count()


def _read_memory(d: Device, gpu: Gpu) -> None:
    memory = d.memory()
    if memory is not None:
        gpu.memory_total_bytes = memory.total_bytes
        gpu.memory_used_bytes = memory.used_bytes


def _read_modes(d: Device, gpu: Gpu) -> None:
    q, h = d.q, d.handle
    gpu.persistence_mode = _is_enabled(q, q("nvmlDeviceGetPersistenceMode", h))
    gpu.compute_mode = q.enum_name("compute mode", _COMPUTE_MODES, q("nvmlDeviceGetComputeMode", h))
    mig = q("nvmlDeviceGetMigMode", h)  # [current, pending]: a change waits for a GPU reset
    gpu.mig_mode = None if mig is None else mig[0] == q.const("NVML_DEVICE_MIG_ENABLE", 1)
    gpu.virtualization_mode = q.enum_name(
        "virtualization mode", _VIRTUALIZATION_MODES, q("nvmlDeviceGetVirtualizationMode", h)
    )
    utilization = d.utilization()
    gpu.utilization_ratio = None if utilization is None else utilization.kernel_ratio


def _read_clocks(d: Device, gpu: Gpu) -> None:
    gpu.clocks = GpuClocks(
        sm_mhz=_mhz(d.sm_clock_hertz()),
        sm_max_mhz=_mhz(d.sm_clock_max_hertz()),
        memory_mhz=_mhz(d.memory_clock_hertz()),
        memory_max_mhz=_mhz(d.memory_clock_max_hertz()),
        applications_sm_mhz=_mhz(d.applications_sm_clock_hertz()),
    )
    gpu.clock_event_reasons = d.clock_event_reasons()


def _read_power(d: Device, gpu: Gpu) -> None:
    gpu.power = GpuPower(
        draw_w=d.power_watts(),
        enforced_limit_w=d.power_limit_watts(),
        default_limit_w=d.power_default_limit_watts(),
        max_limit_w=d.power_max_limit_watts(),
    )


def _read_thermal(d: Device, gpu: Gpu) -> None:
    gpu.thermal = GpuThermal(
        temperature_c=_whole(d.temperature_celsius()),
        slowdown_c=_whole(d.temperature_slowdown_celsius()),
        shutdown_c=_whole(d.temperature_shutdown_celsius()),
    )


def _read_pcie(d: Device, gpu: Gpu) -> None:
    gpu.pcie = PcieLink(
        gen_current=d.pcie_link_generation(),
        gen_max=d.pcie_link_generation_max(),
        gen_gpu_max=d.pcie_link_generation_gpu_max(),
        width_current=d.pcie_link_width(),
        width_max=d.pcie_link_width_max(),
        replay_count=d.pcie_replay_total(),
    )


def _read_ecc(d: Device, gpu: Gpu) -> None:
    mode = d.q("nvmlDeviceGetEccMode", d.handle)  # [current, pending]: a change waits for a reboot
    gpu.ecc = GpuEcc(
        enabled=None if mode is None else _is_enabled(d.q, mode[0]),
        volatile_corrected=d.ecc_corrected_total(),
        volatile_uncorrected=d.ecc_uncorrected_total(),
        aggregate_corrected=d.ecc_corrected_total(volatile=False),
        aggregate_uncorrected=d.ecc_uncorrected_total(volatile=False),
    )


def _read_retirement(d: Device, gpu: Gpu) -> None:
    q, h = d.q, d.handle
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


def _read_nvlinks(d: Device, gpu: Gpu) -> None:
    # NVML_NVLINK_MAX_LINKS grows with the bindings (12, 18, 36...) while a GPU has fewer links: the
    # first link past the GPU's last answers InvalidArgument, and a GPU without NVLink answers
    # NotSupported on link 0. Either way the walk stops there.
    links = []
    for link in range(d.q.const("NVML_NVLINK_MAX_LINKS", 18)):
        active = d.nvlink_active(link)
        if active is None:
            break
        links.append(NvLink(link=link, active=active, peer_pci_bus_id=d.nvlink_peer_pci_bus_id(link)))
    gpu.nvlinks = links or None


def _read_fabric(d: Device, gpu: Gpu) -> None:
    q, h = d.q, d.handle
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


def _read_locality(d: Device, gpu: Gpu) -> None:
    q, h = d.q, d.handle
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


def _read_processes(d: Device, gpu: Gpu) -> None:
    gpu.processes = d.processes()


def _read_mig(d: Device, gpu: Gpu) -> None:
    """In MIG mode, each instance: a device of its own, with its memory and processes."""
    if not gpu.mig_mode:
        return
    q = d.q
    for slot in range(q("nvmlDeviceGetMaxMigDeviceCount", d.handle) or 0):
        handle = q("nvmlDeviceGetMigDeviceHandleByIndex", d.handle, slot)
        if handle is None:  # an empty slot (NOT_FOUND)
            continue
        instance = Device(q, handle)
        memory = instance.memory()
        gpu.mig_devices.append(
            MigDevice(
                slot=slot,
                uuid=instance.uuid(),
                name=instance.name(),
                memory_total_bytes=None if memory is None else memory.total_bytes,
                memory_used_bytes=None if memory is None else memory.used_bytes,
                multiprocessor_count=instance.multiprocessor_count(),
                gpu_instance_id=q("nvmlDeviceGetGpuInstanceId", handle),
                compute_instance_id=q("nvmlDeviceGetComputeInstanceId", handle),
                processes=instance.processes(),
            )
        )


_GPU_FIELD_GROUPS: tuple[tuple[str, Callable[[Device, Gpu], None]], ...] = (
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
    ("mig", _read_mig),
)


def _mhz(hertz: float | None) -> int | None:
    return None if hertz is None else round(hertz / 1e6)


def _whole(celsius: float | None) -> int | None:
    return None if celsius is None else round(celsius)


def _is_enabled(q: Query, state: int | None) -> bool | None:
    return None if state is None else state == q.const("NVML_FEATURE_ENABLED", 1)


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
