"""The Prometheus face of `redline monitor`: the newest ``Sample`` as metrics, served over HTTP.

Names follow Prometheus's conventions (https://prometheus.io/docs/practices/naming/) so that
``promtool check metrics`` finds nothing to say: a ``redline_`` prefix, base units in the name (``_bytes``,
``_seconds``, ``_watts``, ``_joules``, ``_hertz``, ``_celsius``, ``_ratio`` for a fraction in [0, 1]) and
``_total`` on counters only. NVML and /proc hand us some throughputs as rates, not byte counters (PCIe and
NVLink on the GPU; swap, disk and network on the host, as the sampler computes them), so those are gauges
named ``..._bytes_per_second``. A field that is ``None`` in the sample ("not available here") is left out
of the exposition rather than exported as 0, so a dashboard shows a gap, not a lie.

The sampler thread calls ``Exporter.update(sample)`` every interval; the HTTP server's threads call
``collect()`` on every scrape. ``update`` builds the metric families once and publishes them with a single
reference assignment (atomic in CPython), so a scrape never sees half of one sample and half of the next,
never waits on the sampler, and costs only the text rendering. The freshness series
(``redline_monitor_up``, ``redline_sample_age_seconds``) are computed at scrape time, because the point of
them is to notice a sampler that stopped calling ``update``.
"""

from __future__ import annotations

import errno
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from redline.errors import BadInput
from redline.hw.nvml.device import CLOCK_EVENT_REASON_NAMES
from redline.monitor.metrics_server import start_metrics_server
from redline.monitor.sample import GpuSample, HostSample, Sample, StepSample

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9400  # the port NVIDIA's dcgm-exporter uses too: one GPU exporter per machine is the norm
DEFAULT_STALE_AFTER_S = 10.0

# Every reason NVML can name, so that each GPU exports a 0 for the ones not set: a panel then shows "not
# throttled" as a value, and `== 1` picks out the ones that are.
CLOCK_EVENT_REASONS: tuple[str, ...] = CLOCK_EVENT_REASON_NAMES

GPU_LABELS = ("gpu", "uuid")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_INFO_LABELS = ("gpu", "uuid", "model", "driver")


@dataclass(frozen=True)
class Field:
    """One numeric field of a sample dataclass exported as one metric: the table rows below."""

    metric: str
    attr: str
    help: str
    counter: bool = False


# ---------------------------------------------------------------------------------------------- GPU

GPU_FIELDS: tuple[Field, ...] = (
    Field("redline_gpu_utilization_ratio", "utilization_ratio", "Fraction of time a kernel was running (NVML)."),
    Field(
        "redline_gpu_memory_bandwidth_ratio",
        "memory_bandwidth_ratio",
        "Fraction of time device memory was being read or written (NVML).",
    ),
    Field("redline_gpu_memory_used_bytes", "memory_used_bytes", "Device memory in use."),
    Field("redline_gpu_memory_total_bytes", "memory_total_bytes", "Device memory in all."),
    Field("redline_gpu_sm_clock_hertz", "sm_clock_hertz", "Current SM clock."),
    Field("redline_gpu_sm_clock_max_hertz", "sm_clock_max_hertz", "Highest SM clock the GPU supports."),
    Field("redline_gpu_memory_clock_hertz", "memory_clock_hertz", "Current memory clock."),
    Field("redline_gpu_memory_clock_max_hertz", "memory_clock_max_hertz", "Highest memory clock."),
    Field("redline_gpu_power_watts", "power_watts", "Power draw."),
    Field("redline_gpu_power_limit_watts", "power_limit_watts", "Enforced power limit."),
    Field("redline_gpu_energy_joules_total", "energy_joules_total", "Energy used since the driver loaded.", True),
    Field("redline_gpu_temperature_celsius", "temperature_celsius", "GPU core temperature."),
    Field(
        "redline_gpu_temperature_slowdown_celsius",
        "temperature_slowdown_celsius",
        "Temperature at which the GPU starts slowing its clocks.",
    ),
    Field("redline_gpu_pcie_tx_bytes_per_second", "pcie_tx_bytes_per_second", "PCIe transmit throughput (NVML)."),
    Field("redline_gpu_pcie_rx_bytes_per_second", "pcie_rx_bytes_per_second", "PCIe receive throughput (NVML)."),
    Field("redline_gpu_pcie_link_generation", "pcie_link_generation", "Current PCIe link generation."),
    Field("redline_gpu_pcie_link_generation_max", "pcie_link_generation_max", "Highest PCIe link generation."),
    Field("redline_gpu_pcie_link_width", "pcie_link_width", "Current PCIe link width (lanes)."),
    Field("redline_gpu_pcie_link_width_max", "pcie_link_width_max", "Widest PCIe link (lanes)."),
    Field("redline_gpu_pcie_replays_total", "pcie_replay_total", "PCIe replays (link-level retransmissions).", True),
    Field(
        "redline_gpu_nvlink_tx_bytes_per_second", "nvlink_tx_bytes_per_second", "NVLink transmit throughput, all links."
    ),
    Field(
        "redline_gpu_nvlink_rx_bytes_per_second", "nvlink_rx_bytes_per_second", "NVLink receive throughput, all links."
    ),
    Field("redline_gpu_ecc_corrected_errors_total", "ecc_corrected_total", "Corrected ECC errors (volatile).", True),
    Field(
        "redline_gpu_ecc_uncorrected_errors_total", "ecc_uncorrected_total", "Uncorrected ECC errors (volatile).", True
    ),
    Field("redline_gpu_xid_errors_total", "xid_total", "Xid events of this GPU in the kernel log.", True),
    Field("redline_gpu_sm_activity_ratio", "sm_activity_ratio", "Fraction of SM cycles busy (Hopper+ GPM)."),
    Field("redline_gpu_tensor_activity_ratio", "tensor_activity_ratio", "Tensor-core pipe activity (Hopper+ GPM)."),
)

# ---------------------------------------------------------------------------------------------- host

HOST_FIELDS: tuple[Field, ...] = (
    Field("redline_host_cpu_utilization_ratio", "cpu_ratio", "Fraction of all CPU time busy."),
    Field("redline_host_cpus", "cpu_count", "Logical CPUs."),
    Field("redline_host_cpu_iowait_ratio", "cpu_iowait_ratio", "Fraction of all CPU time idle waiting on I/O."),
    Field("redline_host_load1", "load_1m", "1-minute load average."),
    Field("redline_host_memory_used_bytes", "memory_used_bytes", "Host memory in use."),
    Field("redline_host_memory_total_bytes", "memory_total_bytes", "Host memory in all."),
    Field("redline_host_swap_used_bytes", "swap_used_bytes", "Swap in use."),
    Field("redline_host_swap_in_bytes_per_second", "swap_in_bytes_per_second", "Swap-in throughput."),
    Field("redline_host_swap_out_bytes_per_second", "swap_out_bytes_per_second", "Swap-out throughput."),
    Field("redline_host_disk_read_bytes_per_second", "disk_read_bytes_per_second", "Disk read throughput."),
    Field("redline_host_disk_write_bytes_per_second", "disk_write_bytes_per_second", "Disk write throughput."),
    Field("redline_host_network_rx_bytes_per_second", "network_rx_bytes_per_second", "Network receive throughput."),
    Field("redline_host_network_tx_bytes_per_second", "network_tx_bytes_per_second", "Network transmit throughput."),
)

# ------------------------------------------------------------------------------------------ training

TRAIN_FIELDS: tuple[Field, ...] = (
    Field("redline_train_step", "step", "Number of the newest optimizer step of this rank."),
    Field("redline_train_step_time_seconds", "time_s", "Wall time of the newest step."),
    Field("redline_train_data_wait_seconds", "data_s", "Time the newest step waited for its input batch."),
    Field("redline_train_compute_seconds", "compute_s", "Forward and backward time of the newest step."),
    Field("redline_train_optimizer_seconds", "optimizer_s", "Optimizer time of the newest step."),
    Field("redline_train_comm_seconds", "comm_s", "Exposed communication time of the newest step."),
    Field("redline_train_samples_per_second", "samples_per_s", "Training throughput of the newest step, samples."),
    Field("redline_train_tokens_per_second", "tokens_per_s", "Training throughput of the newest step, tokens."),
    Field("redline_train_mfu_ratio", "mfu_catalog", "Model FLOPs utilisation against the catalog's peak."),
    Field("redline_train_peak_memory_bytes", "peak_memory_bytes", "Peak GPU memory allocated during the step."),
    Field("redline_train_loss", "loss", "Loss of the newest step."),
)


@dataclass(frozen=True)
class _Snapshot:
    """What a scrape reads: built whole by ``update`` and replaced whole, never modified."""

    time: float | None = None  # the newest sample's time; None before the first
    families: tuple[Metric, ...] = ()
    updates: int = 0
    steps: Mapping[int, tuple[StepSample, float]] = field(default_factory=dict)  # rank -> (step, sample time)


class Exporter(Collector):
    """A Prometheus collector over the newest ``Sample``, with a registry of its own.

    Its own registry, rather than prometheus_client's global one, so that embedding redline in a process
    that already exports metrics neither duplicates nor mixes series. ``process_metrics`` adds
    prometheus_client's process collector (``process_resident_memory_bytes``, ``process_cpu_seconds_total``
    ...) for the process the exporter runs in: `redline monitor` promises to be cheap, and this is how a
    user checks that claim on the same dashboard.

    ``driver_version`` and ``info_labels`` (e.g. ``{"cuda": "12.4", "host": "gpu-07"}``) are constant for the
    life of the process and not part of a ``Sample``; they go on ``redline_gpu_info``.
    ``stale_after_s``: ``redline_monitor_up`` drops to 0 when the newest sample is older than this (pass
    about three sampling intervals). ``clock`` is there for tests.
    """

    def __init__(
        self,
        *,
        driver_version: str | None = None,
        info_labels: Mapping[str, str] | None = None,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        process_metrics: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._driver_version = driver_version or ""
        self._info_labels = _checked_info_labels(info_labels or {})
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._snapshot = _Snapshot()
        self._write_lock = threading.Lock()  # writers only: a scrape never takes it
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        if process_metrics:
            ProcessCollector(registry=self.registry)

    def update(self, sample: Sample) -> None:
        """Publish ``sample`` as the newest: the next scrape reports it.

        The training series keep each rank's newest step across samples, because a sample only carries
        the steps finished since the previous one and a slow step would otherwise blink out of the graph.
        """
        with self._write_lock:
            steps = dict(self._snapshot.steps)
            for step in sample.steps:  # in the order the runtime wrote them: the last one of a rank wins
                steps[step.rank] = (step, sample.time)
            families = (*_sample_families(sample, self._driver_version, self._info_labels), *_train_families(steps))
            self._snapshot = _Snapshot(sample.time, families, self._snapshot.updates + 1, steps)

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot  # one read: everything below is from the same sample
        yield from _freshness_families(snapshot, self._clock(), self._stale_after_s)
        yield from snapshot.families


def _checked_info_labels(labels: Mapping[str, str]) -> dict[str, str]:
    for name in labels:
        if not _LABEL_NAME.match(name) or name.startswith("__"):
            raise BadInput(f"bad Prometheus label name {name!r}: letters, digits and '_', not starting with a digit")
        if name in _INFO_LABELS:
            raise BadInput(f"label {name!r} is already set by redline on redline_gpu_info: pick another name")
    return {name: str(value) for name, value in labels.items()}


# ------------------------------------------------------------------------------------- building families


def _family(spec: Field, labels: Sequence[str]) -> GaugeMetricFamily | CounterMetricFamily:
    kind = CounterMetricFamily if spec.counter else GaugeMetricFamily
    return kind(spec.metric, spec.help, labels=list(labels))


def _add_fields(
    families: dict[str, GaugeMetricFamily | CounterMetricFamily],
    specs: Sequence[Field],
    obj: Any,
    label_values: list[str],
) -> None:
    """One series per field of ``obj`` that is not None; ``families`` is keyed by metric name."""
    for spec in specs:
        value = getattr(obj, spec.attr)
        if value is not None:
            families[spec.metric].add_metric(label_values, float(value))


def _nonempty(families: Iterable[Metric]) -> list[Metric]:
    """A family without samples would still print HELP/TYPE lines; leave it out like its series."""
    return [family for family in families if family.samples]


def _sample_families(sample: Sample, driver: str, info_labels: Mapping[str, str]) -> list[Metric]:
    families: list[Metric] = [
        GaugeMetricFamily(
            "redline_sample_timestamp_seconds", "Unix time at which the newest sample was taken.", value=sample.time
        )
    ]
    families += _gpu_families(sample.gpus, driver, info_labels)
    if sample.host is not None:
        families += _host_families(sample.host)
    return families


def _gpu_families(gpus: Sequence[GpuSample], driver: str, info_labels: Mapping[str, str]) -> list[Metric]:
    info = InfoMetricFamily(
        "redline_gpu", "Identity of each GPU: model, UUID, driver.", labels=[*_INFO_LABELS, *info_labels]
    )
    lost = GaugeMetricFamily(
        "redline_gpu_lost", "1 when the GPU fell off the bus (Xid 79) or vanished.", labels=GPU_LABELS
    )
    fields = {spec.metric: _family(spec, GPU_LABELS) for spec in GPU_FIELDS}
    reasons = GaugeMetricFamily(
        "redline_gpu_clock_event_reason",
        "1 while NVML reports this reason for clocks below their maximum (throttling, idle, settings), else 0.",
        labels=[*GPU_LABELS, "reason"],
    )
    processes = GaugeMetricFamily(
        "redline_gpu_process_memory_used_bytes",
        "GPU memory used by each process on the GPU.",
        labels=[*GPU_LABELS, "pid", "name", "kind"],
    )
    for gpu in gpus:
        labels = [str(gpu.index), gpu.uuid or ""]
        info.add_metric([*labels, gpu.name or "", driver, *info_labels.values()], {})
        lost.add_metric(labels, 1.0 if gpu.lost else 0.0)
        _add_fields(fields, GPU_FIELDS, gpu, labels)
        _add_reasons(reasons, labels, gpu.clock_event_reasons)
        _add_processes(processes, labels, gpu)
    return _nonempty([info, lost, *fields.values(), reasons, processes])


def _add_reasons(family: GaugeMetricFamily, labels: list[str], reasons: list[str] | None) -> None:
    if reasons is None:  # not readable: no series, rather than "no reason"
        return
    active = set(reasons)
    for reason in CLOCK_EVENT_REASONS:
        family.add_metric([*labels, reason], 1.0 if reason in active else 0.0)
    for reason in sorted(active.difference(CLOCK_EVENT_REASONS)):  # bits newer than our table: unknown_0x...
        family.add_metric([*labels, reason], 1.0)


def _add_processes(family: GaugeMetricFamily, labels: list[str], gpu: GpuSample) -> None:
    """Summed per (pid, name, kind): NVML can list a process twice, and a repeated label set is an invalid
    exposition that Prometheus rejects whole."""
    used: dict[tuple[str, str, str], float] = {}
    for proc in gpu.processes:
        if proc.used_memory_bytes is not None:
            key = (str(proc.pid), proc.name or "", proc.kind)
            used[key] = used.get(key, 0.0) + float(proc.used_memory_bytes)
    for key, value in used.items():
        family.add_metric([*labels, *key], value)


def _host_families(host: HostSample) -> list[Metric]:
    fields = {spec.metric: _family(spec, ()) for spec in HOST_FIELDS}
    _add_fields(fields, HOST_FIELDS, host, [])
    return _nonempty(fields.values())


def _train_families(steps: Mapping[int, tuple[StepSample, float]]) -> list[Metric]:
    fields = {spec.metric: _family(spec, ("rank",)) for spec in TRAIN_FIELDS}
    seen = GaugeMetricFamily(
        "redline_train_step_timestamp_seconds",
        "Unix time of the sample that brought this rank's newest step: a stalled rank stops moving.",
        labels=["rank"],
    )
    for rank in sorted(steps):
        step, seen_at = steps[rank]
        _add_fields(fields, TRAIN_FIELDS, step, [str(rank)])
        seen.add_metric([str(rank)], seen_at)
    return _nonempty([*fields.values(), seen])


def _freshness_families(snapshot: _Snapshot, now: float, stale_after_s: float) -> Iterator[Metric]:
    """Whether the sampler is alive, from the scrape's point of view. Prometheus's own ``up`` only says the
    HTTP server answered; a sampler thread stuck on a hung NVML call would leave it at 1 forever."""
    fresh = snapshot.time is not None and now - snapshot.time <= stale_after_s
    yield GaugeMetricFamily(
        "redline_monitor_up",
        f"1 while the newest sample is at most {stale_after_s:g} s old, 0 before the first and when sampling stalls.",
        value=1.0 if fresh else 0.0,
    )
    yield CounterMetricFamily("redline_samples_total", "Samples published to the exporter.", value=snapshot.updates)
    if snapshot.time is not None:
        yield GaugeMetricFamily(
            "redline_sample_age_seconds", "Age of the newest sample when scraped.", value=max(0.0, now - snapshot.time)
        )


# --------------------------------------------------------------------------------------------- serving


@dataclass
class ExporterServer:
    """The running HTTP endpoint: where it listens, and how to stop it."""

    host: str
    port: int
    _httpd: Any = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop serving and free the port; safe to call twice."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout)
        self._httpd.server_close()

    close = shutdown

    def __enter__(self) -> ExporterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def serve(exporter: Exporter, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> ExporterServer:
    """Serve ``exporter``'s registry at ``http://HOST:PORT/metrics`` from a daemon thread.

    Loopback by default: the metrics name the processes on the GPUs and the machine's load, which is not
    for every host on the network; the CLI's ``--listen ADDR`` is the explicit way out. ``port=0`` picks
    a free port (the bound one is ``.port``). A port or address we cannot use is BadInput, one line. It holds
    ``metrics_server.LISTEN_BACKLOG`` connections pending, so a crowd of scrapers landing at once is answered.
    """
    if not 0 <= port <= 65535:
        raise BadInput(f"port {port} is not a TCP port (0-65535): pick another with --port")
    try:
        httpd, thread = start_metrics_server(port, addr=host, registry=exporter.registry)
    except OSError as exc:
        raise BadInput(_listen_error(exc, host, port)) from None
    bound_host, bound_port = httpd.server_address[:2]  # what the socket really got: the port when 0 was asked
    return ExporterServer(host=str(bound_host), port=int(bound_port), _httpd=httpd, _thread=thread)


def _listen_error(exc: OSError, host: str, port: int) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use: pick another with --port"
    if exc.errno == errno.EACCES:
        return f"not allowed to listen on port {port} on {host} (ports below 1024 need root): pick another with --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine: pick one it has with --listen"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve {host!r} to an address to listen on: pass an IP address with --listen"
    return f"cannot listen on {host} port {port}: {exc.strerror or exc}"
