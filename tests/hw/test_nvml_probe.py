"""probe_gpus against the fake NVML (healthy and broken servers) and against this machine's real pynvml."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pynvml
import pytest

from fakes.fake_nvml import (
    HOST_CPUS,
    HW_THERMAL,
    SW_POWER_CAP,
    FakeGpu,
    FakeNvml,
    FakeProcess,
    MiB,
    a100_sxm_80,
    eight_gpu_server,
    h100_sxm,
    rtx_4090,
)
from redline.hw.nvml.device import clock_event_reason_names, normalize_pci_bus_id
from redline.hw.nvml.probe import probe_gpus
from redline.hw.nvml.query import error_name
from redline.hw.snapshot import (
    Gpu,
    GpuClocks,
    GpuEcc,
    GpuPower,
    GpuProcess,
    GpuRetirement,
    GpuThermal,
    NvLink,
    PcieLink,
)
from redline.hw.sysfs import SysFs
from sysroot import SysRoot

NO_SUCH_PID = 2**22 + 4321  # above the kernel's largest pid_max


@pytest.fixture
def host(tmp_path: Path) -> SysRoot:
    """The /proc and /sys of the 224-CPU host the fake boards sit in; NVML's affinity mask is sized by it."""
    root = SysRoot(tmp_path)
    root.write("/sys/devices/system/cpu/possible", f"0-{HOST_CPUS - 1}\n")
    return root


def probe(nvml: FakeNvml, fs: SysFs | None = None) -> tuple[list[Gpu], list[str]]:
    notes: list[str] = []
    section = probe_gpus(nvml, errors=notes, fs=fs)
    assert section.nvml_available
    return section.gpus, notes


# ------------------------------------------------------------------------------------ healthy boards


def test_a_healthy_h100_reads_back_every_field_in_redline_units(host: SysRoot) -> None:
    host.add_process(4242, "python3", uid=1000)
    nvml = FakeNvml(
        [
            h100_sxm(
                0,
                memory_used_mib=1024,
                multiprocessor_count=132,  # what a driver that answers for whole GPUs would say
                utilization_pct=87,
                clock_event_reasons=SW_POWER_CAP | HW_THERMAL,
                power_draw_mw=612_345,
                processes=[FakeProcess(4242, used_memory=1000 * MiB)],
            )
        ]
    )
    notes: list[str] = []
    section = probe_gpus(nvml, errors=notes, fs=host.sysfs())

    assert notes == []
    assert section.nvml_available and section.error is None and section.error_code is None
    assert (section.driver_version, section.cuda_driver_version, section.nvml_version) == (
        "550.54.15",
        "12.4",
        "12.550.54.15",
    )
    switches = ["0000:05:00.0"] * 5 + ["0000:06:00.0"] * 4 + ["0000:07:00.0"] * 4 + ["0000:08:00.0"] * 5
    assert section.gpus == [
        Gpu(
            index=0,
            name="NVIDIA H100 80GB HBM3",
            uuid="GPU-8a0f1c3e-7d42-4b9a-9e61-000000000000",
            pci_bus_id="0000:18:00.0",
            lost=False,
            memory_total_bytes=81559 * MiB,
            memory_used_bytes=1024 * MiB,
            compute_capability="9.0",
            multiprocessor_count=132,
            persistence_mode=True,
            compute_mode="default",
            mig_mode=False,
            virtualization_mode="none",
            utilization_ratio=0.87,
            clocks=GpuClocks(
                sm_mhz=345, sm_max_mhz=1980, memory_mhz=2619, memory_max_mhz=2619, applications_sm_mhz=1980
            ),
            clock_event_reasons=["sw_power_cap", "hw_thermal_slowdown"],
            power=GpuPower(draw_w=612.345, enforced_limit_w=700.0, default_limit_w=700.0, max_limit_w=700.0),
            thermal=GpuThermal(temperature_c=31, slowdown_c=90, shutdown_c=92),
            pcie=PcieLink(gen_current=5, gen_max=5, gen_gpu_max=5, width_current=16, width_max=16, replay_count=0),
            ecc=GpuEcc(
                enabled=True,
                volatile_corrected=0,
                volatile_uncorrected=0,
                aggregate_corrected=0,
                aggregate_uncorrected=0,
            ),
            # Hopper remaps rows; the page-retirement calls are NotSupported there
            retirement=GpuRetirement(
                remapped_rows_correctable=0, remapped_rows_uncorrectable=0, remap_pending=False, remap_failed=False
            ),
            nvlinks=[NvLink(link=i, active=True, peer_pci_bus_id=bus) for i, bus in enumerate(switches)],
            fabric_state="completed",
            fabric_status="success",
            numa_node=None,  # x86: NVML does not say; the caller reads /sys
            cpu_affinity=[*range(0, 56), *range(112, 168)],
            processes=[GpuProcess(pid=4242, name="python3", used_memory_bytes=1000 * MiB, uid=1000)],
            health_errors={},
        )
    ]
    assert section.p2p is None and section.topology is None  # one GPU: no pairs
    assert nvml.active_inits == 0, "nvmlShutdown must balance nvmlInit"


def test_a_geforce_without_ecc_nvlink_or_remapping_reads_as_absent_not_as_errors() -> None:
    [gpu], notes = probe(FakeNvml([rtx_4090(0)]))

    assert notes == []
    assert gpu.name == "NVIDIA GeForce RTX 4090"
    assert gpu.ecc == GpuEcc()
    assert gpu.retirement == GpuRetirement()
    assert gpu.nvlinks is None
    assert gpu.mig_mode is None and gpu.fabric_state is None and gpu.fabric_status is None
    assert gpu.clocks.applications_sm_mhz is None and gpu.clocks.sm_max_mhz == 3120
    assert gpu.power.max_limit_w == 600.0 and gpu.power.default_limit_w == 450.0
    assert gpu.pcie.gen_current == 1 and gpu.pcie.gen_max == 4


def test_an_eight_gpu_a100_server_reports_its_faults_on_the_right_gpu() -> None:
    nvml = eight_gpu_server(
        "a100",
        faults={5: {"ecc_volatile_uncorrected": 2, "remapped_rows": (0, 1, True, False), "pcie_width": 8}},
    )
    gpus, notes = probe(nvml)

    assert notes == []
    assert [g.pci_bus_id for g in gpus][:2] == ["0000:18:00.0", "0000:2a:00.0"]
    assert all(len(g.nvlinks or []) == 12 for g in gpus)
    assert gpus[5].ecc.volatile_uncorrected == 2
    assert (gpus[5].retirement.remapped_rows_uncorrectable, gpus[5].retirement.remap_pending) == (1, True)
    assert gpus[5].pcie.width_current == 8
    assert gpus[4].ecc.volatile_uncorrected == 0 and gpus[4].pcie.width_current == 16
    assert all(g.fabric_state is None for g in gpus)  # fabric state is Hopper and later


@pytest.mark.parametrize(
    ("overrides", "field", "expected"),
    [
        ({"compute_mode": pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS}, "compute_mode", "exclusive_process"),
        ({"compute_mode": pynvml.NVML_COMPUTEMODE_PROHIBITED}, "compute_mode", "prohibited"),
        ({"virt": pynvml.NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH}, "virtualization_mode", "passthrough"),
        ({"virt": pynvml.NVML_GPU_VIRTUALIZATION_MODE_VGPU}, "virtualization_mode", "vgpu"),
        ({"mig": True}, "mig_mode", True),
        ({"persistence": False}, "persistence_mode", False),
        ({"fabric_state": pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS}, "fabric_state", "in_progress"),
        ({"fabric_state": pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED}, "fabric_state", "not_started"),
        ({"numa_node": 2}, "numa_node", 2),
        ({"clock_event_reasons": 0}, "clock_event_reasons", []),
    ],
)
def test_nvml_enums_map_to_redline_names(overrides: dict, field: str, expected: object) -> None:
    [gpu], _ = probe(FakeNvml([h100_sxm(0, **overrides)]))
    assert getattr(gpu, field) == expected


@pytest.mark.parametrize(
    ("state", "status", "expected"),
    [
        (pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, pynvml.NVML_SUCCESS, "success"),
        # registered, but the fabric manager failed it: the GPU has no NVLink bandwidth
        (pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES, "INSUFFICIENT_RESOURCES"),
        (pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, pynvml.NVML_ERROR_UNKNOWN, "UNKNOWN"),
        (pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, 4242, "ERROR_4242"),
        # the status means nothing until registration completes
        (pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, pynvml.NVML_ERROR_NOT_READY, None),
        (pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED, pynvml.NVML_SUCCESS, None),
    ],
)
def test_fabric_status_is_read_once_registration_completes(state: int, status: int, expected: str | None) -> None:
    [gpu], notes = probe(FakeNvml([h100_sxm(0, fabric_state=state, fabric_status=status)]))
    assert gpu.fabric_status == expected
    assert notes == [] and gpu.health_errors == {}  # the fabric manager's verdict is data, not a failed call


@pytest.mark.parametrize(("cuda", "expected"), [(12040, "12.4"), (11080, "11.8"), (12080, "12.8"), (13000, "13.0")])
def test_cuda_driver_version_is_decoded(cuda: int, expected: str) -> None:
    assert probe_gpus(FakeNvml([], cuda=cuda)).cuda_driver_version == expected


# --------------------------------------------------------------------------------- NVML not starting


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (pynvml.NVMLError_LibraryNotFound, "library_not_found", "NVML library not found (no NVIDIA driver)"),
        (pynvml.NVMLError_DriverNotLoaded, "driver_not_loaded", "NVIDIA driver not loaded"),
        (pynvml.NVMLError_LibRmVersionMismatch, "driver_mismatch", "driver/library version mismatch"),
        (pynvml.NVMLError_NoPermission, "no_permission", "no permission"),
        (pynvml.NVMLError_Unknown, "other", "NVML failed to start: Unknown Error"),
        (OSError("libnvidia-ml.so.1: cannot open shared object file"), "other", "NVML failed to start: OSError"),
    ],
)
def test_nvml_that_will_not_start_is_a_value_not_an_exception(error: object, code: str, message: str) -> None:
    nvml = FakeNvml([h100_sxm(0)], init_error=error)
    section = probe_gpus(nvml)

    assert not section.nvml_available
    assert section.error_code == code
    assert section.error is not None and message in section.error
    assert section.gpus == []
    assert "nvmlShutdown" not in nvml.calls  # nothing to shut down


def test_the_version_mismatch_message_says_what_to_do() -> None:
    section = probe_gpus(FakeNvml([], init_error=pynvml.NVMLError_LibRmVersionMismatch))
    assert "reboot or reload the nvidia kernel modules" in (section.error or "")


def test_a_failing_gpu_count_still_shuts_nvml_down() -> None:
    nvml = FakeNvml([h100_sxm(0)], errors={"nvmlDeviceGetCount": pynvml.NVMLError_Unknown()})
    notes: list[str] = []
    section = probe_gpus(nvml, errors=notes)

    assert section.nvml_available and section.error and section.gpus == []
    assert section.error_code is None  # NVML started; error_code is for NVML that did not
    assert notes == ["NVML: nvmlDeviceGetCount: Unknown Error"]
    assert nvml.active_inits == 0


def test_a_failing_shutdown_is_noted() -> None:
    nvml = FakeNvml([h100_sxm(0)], errors={"nvmlShutdown": pynvml.NVMLError_Unknown()})
    notes: list[str] = []
    section = probe_gpus(nvml, errors=notes)
    assert section.gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert notes == ["nvmlShutdown failed: Unknown Error"]


# ----------------------------------------------------------------------------------- broken GPUs


def test_a_lost_gpu_is_marked_and_the_others_are_still_probed() -> None:
    gpus, notes = probe(eight_gpu_server(faults={3: {"lost": True}}))

    assert notes == ["GPU 3: nvmlDeviceGetName: GPU is lost"]
    assert gpus[3] == Gpu(index=3, lost=True, health_errors={"nvmlDeviceGetName": "GPU_IS_LOST"})
    assert all(not g.lost and g.name == "NVIDIA H100 80GB HBM3" for i, g in enumerate(gpus) if i != 3)
    assert gpus[4].power.enforced_limit_w == 700.0


def test_a_gpu_lost_part_way_keeps_what_was_read_and_is_asked_nothing_more() -> None:
    nvml = FakeNvml([h100_sxm(0, errors={"nvmlDeviceGetPowerUsage": pynvml.NVMLError_GpuIsLost()}), h100_sxm(1)])
    gpus, notes = probe(nvml)

    assert notes == ["GPU 0: nvmlDeviceGetPowerUsage: GPU is lost"]
    assert gpus[0].health_errors == {"nvmlDeviceGetPowerUsage": "GPU_IS_LOST"}
    assert gpus[0].lost and gpus[0].name == "NVIDIA H100 80GB HBM3" and gpus[0].clocks.sm_max_mhz == 1980
    assert gpus[0].power == GpuPower() and gpus[0].thermal == GpuThermal() and gpus[0].nvlinks is None
    assert nvml.calls.count("nvmlDeviceGetTemperature") == 1  # GPU 1 only
    assert not gpus[1].lost and gpus[1].thermal.temperature_c == 31


def test_a_lost_gpu_reads_unknown_in_the_pair_matrices() -> None:
    section = probe_gpus(eight_gpu_server(faults={2: {"lost": True}}))
    assert section.p2p is not None and section.topology is not None
    assert section.p2p[2] == ["unknown", "unknown", "self", *["unknown"] * 5]
    assert [row[2] for row in section.p2p] == ["unknown", "unknown", "self", *["unknown"] * 5]
    assert section.p2p[0][1] == "ok"
    assert section.topology[2][2] == "SELF" and section.topology[2][0] == "unknown"


def test_a_gpu_without_a_handle_is_listed_empty_with_a_note() -> None:
    nvml = FakeNvml([h100_sxm(0), h100_sxm(1, errors={"nvmlDeviceGetHandleByIndex": pynvml.NVMLError_Unknown()})])
    notes: list[str] = []
    section = probe_gpus(nvml, errors=notes)

    # still listed, with the error, so the doctor sees a GPU that NVML counts but cannot open
    assert section.gpus[1] == Gpu(index=1, health_errors={"nvmlDeviceGetHandleByIndex": "UNKNOWN"})
    assert notes == ["GPU 1: no NVML handle (Unknown Error); nothing else was read"]
    assert section.p2p == [["self", "unknown"], ["unknown", "self"]]


def test_a_gpu_lost_before_its_handle_is_marked_lost() -> None:
    nvml = FakeNvml([h100_sxm(0, errors={"nvmlDeviceGetHandleByIndex": pynvml.NVMLError_GpuIsLost()})])
    [gpu], notes = probe(nvml)

    assert gpu == Gpu(index=0, lost=True, health_errors={"nvmlDeviceGetHandleByIndex": "GPU_IS_LOST"})
    assert notes == ["GPU 0: no NVML handle (GPU is lost); nothing else was read"]


def test_an_unexpected_exception_from_a_call_becomes_none_and_a_note() -> None:
    gpu = h100_sxm(0, errors={"nvmlDeviceGetPowerUsage": RuntimeError("SMBus read timed out")})
    [read], notes = probe(FakeNvml([gpu]))

    assert read.power == GpuPower(draw_w=None, enforced_limit_w=700.0, default_limit_w=700.0, max_limit_w=700.0)
    assert read.thermal.temperature_c == 31  # the rest of the GPU is still read
    assert notes == ["GPU 0: nvmlDeviceGetPowerUsage: RuntimeError: SMBus read timed out"]
    assert read.health_errors == {}  # a binding's surprise, not the GPU's health


def test_an_nvml_error_that_says_something_about_health_is_noted_but_not_support_errors() -> None:
    gpu = h100_sxm(
        0,
        errors={
            "nvmlDeviceGetTotalEccErrors": pynvml.NVMLError_CorruptedInforom(),
            "nvmlDeviceGetPcieReplayCounter": pynvml.NVMLError_NoPermission(),
            "nvmlDeviceGetPowerUsage": pynvml.NVMLError_FunctionNotFound(),
        },
    )
    [read], notes = probe(FakeNvml([gpu]))

    assert read.ecc == GpuEcc(enabled=True)
    assert read.pcie.replay_count is None and read.power.draw_w is None
    assert notes == ["GPU 0: nvmlDeviceGetTotalEccErrors: Corrupted infoROM"] * 4
    assert read.health_errors == {"nvmlDeviceGetTotalEccErrors": "CORRUPTED_INFOROM"}


@pytest.mark.parametrize(
    ("error", "name"),
    [
        (pynvml.NVMLError_ResetRequired, "RESET_REQUIRED"),
        (pynvml.NVMLError_CorruptedInforom, "CORRUPTED_INFOROM"),
        (pynvml.NVMLError_InsufficientPower, "INSUFFICIENT_POWER"),
        (pynvml.NVMLError_IrqIssue, "IRQ_ISSUE"),
        (pynvml.NVMLError_Timeout, "TIMEOUT"),
        (pynvml.NVMLError_Unknown, "UNKNOWN"),
        (pynvml.NVMLError_Memory, "MEMORY"),
        (pynvml.NVMLError_InsufficientResources, "INSUFFICIENT_RESOURCES"),
    ],
)
def test_health_errors_are_recorded_per_gpu_and_noted(error: type[Exception], name: str) -> None:
    nvml = FakeNvml([h100_sxm(0), h100_sxm(1, errors={"nvmlDeviceGetTemperature": error()})])
    gpus, notes = probe(nvml)

    assert gpus[1].health_errors == {"nvmlDeviceGetTemperature": name}
    assert gpus[1].thermal.temperature_c is None and gpus[1].thermal.slowdown_c == 90
    assert notes == [f"GPU 1: nvmlDeviceGetTemperature: {error()}"]
    assert gpus[0].health_errors == {}


@pytest.mark.parametrize(
    "error",
    [
        pynvml.NVMLError_NotSupported,
        pynvml.NVMLError_FunctionNotFound,
        pynvml.NVMLError_NoPermission,
        pynvml.NVMLError_InvalidArgument,
        pynvml.NVMLError_NotFound,
        pynvml.NVMLError_NoData,
        pynvml.NVMLError_NotReady,
        pynvml.NVMLError_ArgumentVersionMismatch,
        pynvml.NVMLError_Deprecated,
    ],
)
def test_cannot_answer_errors_are_silent(error: type[Exception]) -> None:
    [gpu], notes = probe(FakeNvml([h100_sxm(0, errors={"nvmlDeviceGetTemperature": error()})]))
    assert gpu.thermal.temperature_c is None
    assert (notes, gpu.health_errors) == ([], {})


def test_an_nvml_error_about_the_system_not_the_gpu_is_only_noted() -> None:
    [gpu], notes = probe(
        FakeNvml([h100_sxm(0, errors={"nvmlDeviceGetTemperature": pynvml.NVMLError_OperatingSystem()})])
    )
    assert notes == ["GPU 0: nvmlDeviceGetTemperature: The operating system has blocked the request."]
    assert gpu.health_errors == {}


@pytest.mark.parametrize(
    ("error", "name"),
    [
        (pynvml.NVMLError_CorruptedInforom(), "CORRUPTED_INFOROM"),
        (pynvml.NVMLError_LibRmVersionMismatch(), "LIB_RM_VERSION_MISMATCH"),
        (pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST), "GPU_IS_LOST"),  # the binding picks the subclass
        (pynvml.NVMLError(12345), "ERROR_12345"),  # a code newer than the binding
        (RuntimeError("boom"), "RuntimeError"),
    ],
)
def test_error_names_are_nvml_constants(error: BaseException, name: str) -> None:
    assert error_name(error) == name


def test_every_nvml_error_name_round_trips_to_its_constant() -> None:
    for constant in (name for name in dir(pynvml) if name.startswith("NVML_ERROR_")):
        assert "NVML_ERROR_" + error_name(pynvml.NVMLError(getattr(pynvml, constant))) == constant


def test_a_value_of_an_unexpected_shape_loses_its_group_only() -> None:
    [gpu], notes = probe(FakeNvml([h100_sxm(0, cc=(9,))]))  # a binding returning a 1-tuple

    assert gpu.name == "NVIDIA H100 80GB HBM3" and gpu.compute_capability is None
    assert gpu.memory_total_bytes == 81559 * MiB
    assert notes == ["GPU 0: reading identity: IndexError: tuple index out of range"]


def test_an_enum_value_newer_than_redline_is_none_and_noted() -> None:
    [gpu], notes = probe(FakeNvml([h100_sxm(0, compute_mode=7)]))
    assert gpu.compute_mode is None
    assert notes == ["GPU 0: compute mode 7 is not one redline knows (a newer driver?)"]


# ------------------------------------------------------------------------------- pairs of GPUs


def test_p2p_matrix_has_self_on_the_diagonal_and_the_disabled_pair() -> None:
    def p2p(i: int, j: int) -> int:
        disabled = {i, j} == {1, 5}
        return pynvml.NVML_P2P_STATUS_DISABLED_BY_REGKEY if disabled else pynvml.NVML_P2P_STATUS_OK

    section = probe_gpus(eight_gpu_server(p2p=p2p))

    assert section.p2p is not None
    assert [section.p2p[i][i] for i in range(8)] == ["self"] * 8
    assert section.p2p[1][5] == section.p2p[5][1] == "disabled_by_regkey"
    assert sum(cell == "ok" for row in section.p2p for cell in row) == 8 * 7 - 2


@pytest.mark.parametrize(
    ("status", "name"),
    [
        (pynvml.NVML_P2P_STATUS_OK, "ok"),
        (pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED, "chipset_not_supported"),
        (pynvml.NVML_P2P_STATUS_GPU_NOT_SUPPORTED, "gpu_not_supported"),
        (pynvml.NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED, "topology_not_supported"),
        (pynvml.NVML_P2P_STATUS_DISABLED_BY_REGKEY, "disabled_by_regkey"),
        (pynvml.NVML_P2P_STATUS_NOT_SUPPORTED, "not_supported"),
        (pynvml.NVML_P2P_STATUS_UNKNOWN, "unknown"),
    ],
)
def test_p2p_statuses_map_to_redline_names(status: int, name: str) -> None:
    section = probe_gpus(FakeNvml([h100_sxm(0), h100_sxm(1)], p2p=lambda i, j: status))
    assert section.p2p == [["self", name], [name, "self"]]


def test_no_two_p2p_statuses_share_a_name() -> None:
    """Each status has its own fix (BIOS ACS, a GPU model without P2P, the topology, a registry key)."""
    statuses = [getattr(pynvml, name) for name in dir(pynvml) if name.startswith("NVML_P2P_STATUS_")]
    statuses = sorted(set(statuses))  # the misspelt CHIPSET_NOT_SUPPORED alias has the same value
    gpus = [h100_sxm(i) for i in range(len(statuses) + 1)]
    section = probe_gpus(FakeNvml(gpus, p2p=lambda i, j: statuses[max(i, j) - 1]))
    assert section.p2p is not None
    names = section.p2p[0][1:]
    assert len(set(names)) == len(statuses) == 7
    assert "unknown" in names and "self" not in names


def test_topology_levels_map_to_nvidia_smi_names() -> None:
    levels = [
        pynvml.NVML_TOPOLOGY_INTERNAL,
        pynvml.NVML_TOPOLOGY_SINGLE,
        pynvml.NVML_TOPOLOGY_MULTIPLE,
        pynvml.NVML_TOPOLOGY_HOSTBRIDGE,
        pynvml.NVML_TOPOLOGY_NODE,
        pynvml.NVML_TOPOLOGY_SYSTEM,
    ]
    section = probe_gpus(FakeNvml([rtx_4090(i) for i in range(7)], topology=lambda i, j: levels[max(i, j) - 1]))

    assert section.topology is not None
    assert section.topology[0] == ["SELF", "SELF", "PIX", "PXB", "PHB", "NODE", "SYS"]
    assert [section.topology[i][i] for i in range(7)] == ["SELF"] * 7


def test_the_default_server_topology_splits_at_the_socket() -> None:
    section = probe_gpus(eight_gpu_server())
    assert section.topology is not None
    assert section.topology[0] == ["SELF", "NODE", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]


def test_no_pair_matrices_for_fewer_than_two_gpus() -> None:
    for gpus in ([], [h100_sxm(0)]):
        section = probe_gpus(FakeNvml(gpus))
        assert section.p2p is None and section.topology is None


# ----------------------------------------------------------------------------- NVLink, processes


def test_nvlink_walk_stops_at_the_first_link_nvml_rejects() -> None:
    links = [(True, "00000000:06:00.0"), (True, "00000000:06:00.0"), (False, None), (True, "00000000:07:00.0")]
    nvml = FakeNvml([h100_sxm(0, nvlinks=links)])
    [gpu], notes = probe(nvml)

    assert notes == []
    assert gpu.nvlinks == [
        NvLink(link=0, active=True, peer_pci_bus_id="0000:06:00.0"),
        NvLink(link=1, active=True, peer_pci_bus_id="0000:06:00.0"),
        NvLink(link=2, active=False, peer_pci_bus_id=None),
        NvLink(link=3, active=True, peer_pci_bus_id="0000:07:00.0"),
    ]
    assert nvml.calls.count("nvmlDeviceGetNvLinkState") == 5  # links 0-3, then link 4's InvalidArgument


def test_processes_with_unavailable_memory_and_unknown_pids(host: SysRoot) -> None:
    not_available = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value  # what older bindings pass through
    host.add_process(4242, "python3", uid=0)
    host.add_process(5151, "Xorg", uid=1001)
    processes = [
        FakeProcess(4242, used_memory=not_available),
        FakeProcess(NO_SUCH_PID, used_memory=None),  # a host PID seen from inside a container
        FakeProcess(5151, used_memory=512 * MiB, kind="graphics"),
        FakeProcess(4242, used_memory=not_available, kind="graphics"),  # also has a graphics context
    ]
    fs = host.sysfs()
    [gpu], notes = probe(FakeNvml([h100_sxm(0, processes=processes)]), fs)

    assert notes == [] and fs.errors == []
    assert gpu.processes == [
        GpuProcess(pid=4242, name="python3", used_memory_bytes=None, kind="compute", uid=0),
        GpuProcess(pid=NO_SUCH_PID, name=None, used_memory_bytes=None, kind="compute", uid=None),
        GpuProcess(pid=5151, name="Xorg", used_memory_bytes=512 * MiB, kind="graphics", uid=1001),
    ]


def test_a_process_status_without_a_number_for_uid_is_none_and_noted(host: SysRoot) -> None:
    host.write("/proc/4242/comm", "python3\n")
    host.write("/proc/4242/status", "Name:\tpython3\nUid:\tnobody\n")
    fs = host.sysfs()
    [gpu], _ = probe(FakeNvml([h100_sxm(0, processes=[FakeProcess(4242)])]), fs)

    assert gpu.processes == [GpuProcess(pid=4242, name="python3", uid=None)]
    assert fs.errors == ["/proc/4242/status: Uid 'nobody' is not a number"]


def test_processes_on_this_machine_are_read_from_the_real_proc() -> None:
    """The default SysFs is the real root: this test's own process is found with its name and owner."""
    [gpu], _ = probe(FakeNvml([h100_sxm(0, processes=[FakeProcess(os.getpid())])]))
    assert gpu.processes is not None
    [process] = gpu.processes
    assert process.uid == os.getuid()
    assert process.name == Path(f"/proc/{os.getpid()}/comm").read_text().strip()


def test_processes_are_none_when_nvml_cannot_list_them() -> None:
    unsupported = {"nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"}
    [gpu], _ = probe(FakeNvml([h100_sxm(0, unsupported=unsupported)]))
    assert gpu.processes is None


def test_cpu_affinity_mask_is_expanded_to_cpu_ids(host: SysRoot) -> None:
    [gpu], _ = probe(FakeNvml([h100_sxm(0, cpu_affinity=[0, 63, 64, 130, 223])]), host.sysfs())
    assert gpu.cpu_affinity == [0, 63, 64, 130, 223]


def test_the_affinity_mask_is_sized_by_the_possible_cpus_not_the_visible_ones(
    host: SysRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a container limited to 8 CPUs, the mask must still cover CPU 223 on the host's second socket."""
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    [gpu], _ = probe(FakeNvml([h100_sxm(4)]), host.sysfs())
    assert gpu.cpu_affinity == [*range(56, 112), *range(168, 224)]


def test_without_sys_possible_the_affinity_mask_is_sized_by_os_cpu_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: HOST_CPUS)
    [gpu], _ = probe(FakeNvml([h100_sxm(4)]), SysFs(tmp_path))
    assert gpu.cpu_affinity == [*range(56, 112), *range(168, 224)]


# ----------------------------------------------------------------- older drivers and bindings


def test_older_bindings_without_the_newer_calls_and_constants_still_read_everything() -> None:
    missing = {
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlClocksEventReasonSwPowerCap",
        "nvmlSystemGetCudaDriverVersion_v2",
        "nvmlDeviceGetAttributes_v2",
        "nvmlMemory_v2",
        "c_nvmlGpuFabricInfoV_t",
        "NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED",  # older bindings only had the misspelt name
    }
    nvml = FakeNvml(
        [
            h100_sxm(0, clock_event_reasons=SW_POWER_CAP, name=b"NVIDIA H100 80GB HBM3", multiprocessor_count=132),
            h100_sxm(1),
        ],
        missing=missing,
        cuda=12020,
        p2p=lambda i, j: pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED,
    )
    section = probe_gpus(nvml)
    gpu = section.gpus[0]

    assert gpu.name == "NVIDIA H100 80GB HBM3"  # bytes decoded
    assert gpu.clock_event_reasons == ["sw_power_cap"]
    assert section.cuda_driver_version == "12.2"
    assert gpu.multiprocessor_count == 132
    assert gpu.memory_total_bytes == 81559 * MiB
    assert (gpu.fabric_state, gpu.fabric_status) == ("completed", "success")
    assert section.p2p == [["self", "chipset_not_supported"], ["chipset_not_supported", "self"]]
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in nvml.calls


def test_a_driver_without_memory_info_v2_falls_back_to_v1() -> None:
    [gpu], notes = probe(FakeNvml([h100_sxm(0, memory_used_mib=2048, unsupported={"nvmlDeviceGetMemoryInfo_v2"})]))
    assert (gpu.memory_total_bytes, gpu.memory_used_bytes) == (81559 * MiB, 2048 * MiB)
    assert notes == []


def test_the_fake_only_offers_calls_that_real_pynvml_has_with_the_same_arguments() -> None:
    for name, method in inspect.getmembers(FakeNvml, inspect.isfunction):
        if not name.startswith("nvml"):
            continue
        real = getattr(pynvml, name)
        fake_params = list(inspect.signature(method).parameters)[1:]  # drop self
        assert len(fake_params) == len(inspect.signature(real).parameters), name


# ------------------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(
    ("mask", "names"),
    [
        (0, []),
        (0x1, ["gpu_idle"]),
        (0x4 | 0x40, ["sw_power_cap", "hw_thermal_slowdown"]),
        (
            0x2 | 0x8 | 0x10 | 0x20 | 0x80 | 0x100,
            [
                "applications_clocks_setting",
                "hw_slowdown",
                "sync_boost",
                "sw_thermal_slowdown",
                "hw_power_brake_slowdown",
                "display_clock_setting",
            ],
        ),
        (0x4 | 0x8000, ["sw_power_cap", "unknown_0x8000"]),
    ],
)
def test_clock_event_reason_names(mask: int, names: list[str]) -> None:
    assert clock_event_reason_names(pynvml, mask) == names


@pytest.mark.parametrize(
    ("nvml_id", "linux_id"),
    [
        ("00000000:3B:00.0", "0000:3b:00.0"),
        ("0000:3B:00.0", "0000:3b:00.0"),
        ("00000001:AB:00.1", "0001:ab:00.1"),
        ("0000C001:01:00.0", "c001:01:00.0"),
    ],
)
def test_pci_bus_ids_are_written_as_linux_names_them(nvml_id: str, linux_id: str) -> None:
    assert normalize_pci_bus_id(nvml_id) == linux_id


def test_a_fake_gpu_with_nothing_set_answers_not_supported_everywhere() -> None:
    [gpu], notes = probe(FakeNvml([FakeGpu()]))
    assert notes == []
    assert gpu == Gpu(index=0, name="NVIDIA Fake GPU", uuid=gpu.uuid, pci_bus_id="0000:18:00.0", processes=[])


def test_the_boards_differ_where_the_real_ones_do() -> None:
    gpus, _ = probe(FakeNvml([h100_sxm(0), a100_sxm_80(1), rtx_4090(2)]))
    assert [g.compute_capability for g in gpus] == ["9.0", "8.0", "8.9"]
    assert [len(g.nvlinks or []) for g in gpus] == [18, 12, 0]
    assert [g.ecc.enabled for g in gpus] == [True, True, None]
    assert [g.multiprocessor_count for g in gpus] == [None, None, None]  # NVML says it for MIG devices only


# ---------------------------------------------------------------------------------- real pynvml


def test_the_real_pynvml_on_this_machine_never_raises() -> None:
    """The product path: no fake, whatever this machine has (on CI: no driver at all)."""
    notes: list[str] = []
    section = probe_gpus(errors=notes)
    if section.nvml_available:
        assert section.error is None and section.driver_version
    else:
        assert section.error and section.gpus == []


def test_a_gpu_in_mig_mode_lists_its_instances_and_they_survive_json() -> None:
    """Each MIG instance NVML has in a slot (an empty slot answers NOT_FOUND, and is no note), with its UUID,
    profile, memory, processes and instance ids; the snapshot reads back the same."""
    from fakes.fake_nvml import FakeProcess
    from redline.hw.snapshot import GpuSection, MigDevice, Snapshot, snapshot_from_dict

    gpu = h100_sxm(0, mig=True)
    gpu.mig_devices = [
        None,
        h100_sxm(
            0,
            uuid="MIG-1",
            name="NVIDIA H100 80GB HBM3 MIG 3g.40gb",
            memory_total_mib=40 * 1024,
            memory_used_mib=1024,
            gpu_instance_id=2,
            compute_instance_id=0,
            processes=[FakeProcess(77, 2**30)],
        ),
    ]
    [mig, whole], notes = probe(FakeNvml([gpu, h100_sxm(1)]))
    assert mig.mig_mode and whole.mig_devices == [] and notes == []
    [instance] = mig.mig_devices
    assert isinstance(instance, MigDevice) and (instance.slot, instance.uuid) == (1, "MIG-1")
    assert instance.name.endswith("MIG 3g.40gb") and instance.memory_total_bytes == 40 * 2**30
    assert (instance.gpu_instance_id, instance.compute_instance_id) == (2, 0)
    assert [(p.pid, p.used_memory_bytes) for p in instance.processes] == [(77, 2**30)]
    snapshot = Snapshot(gpu=GpuSection(nvml_available=True, gpus=[mig, whole]))
    again = snapshot_from_dict(json.loads(json.dumps(snapshot.to_dict())))
    assert again.gpu.gpus[0].mig_devices == mig.mig_devices
