"""The cloud GPU instance catalog: what each rentable GPU machine holds and what it costs per hour.

A plan ("8 x H100 for 40 hours, or 16 x A100?") needs more than a GPU model: the machine around it decides
whether multi-GPU jobs scale (NVSwitch, NVLink or plain PCIe between the GPUs), whether multi-node jobs scale
(an RDMA fabric such as EFA or InfiniBand, or ordinary Ethernet) and what an hour costs. Those facts live in
``data/instances.csv``, one row per instance type, each row naming where its figures came from.

Conventions of the CSV:

- Units are in the column names. ``gpu_memory_gb`` is the memory of one GPU as the VM sees it, in the
  marketing unit of ``gpus.csv`` ("80GB"): a whole GPU shows its catalog memory, a partition its share of it.
  ``gpu_link_gbs`` is the GPU-to-GPU bandwidth per GPU inside the instance, both directions together, like
  ``gpus.csv``'s ``nvlink_gbs``; for GPUs that only meet over PCIe it is the PCIe slot's figure (Gen3 x16: 32,
  Gen4 x16: 64). ``network_gbps`` is the instance's network in Gbit/s: the RDMA fabric where there is one
  (p5.48xlarge: 3200 EFA; ND96isr_H100_v5: 3200 InfiniBand), else the Ethernet figure (AWS's "up to" burst
  rates included, said so in ``notes``); empty when it was not verified.
- ``gpu_count`` may be a fraction of one GPU (0.125 .. 0.5) for partitioned GPUs such as Azure NVv4 (AMD MI25
  MxGPU) or AWS g6f (L4): such a VM cannot run a multi-GPU job. ``gpu_interconnect`` is ``nvswitch``
  (all-to-all at full rate), ``nvlink`` (direct links, not necessarily all-to-all), ``pcie``, or ``none`` for
  a VM with at most one GPU, which has nothing to link.
- ``price_usd_per_hour`` is the on-demand Linux price of the whole instance in one region per provider
  (AWS us-east-1, GCP us-central1, Azure eastus; Lambda has one price everywhere: region ``any``). For GCP it
  is the sum of the catalog's machine-type row and its accelerator row, because Google bills the GPUs of
  A2/A3/G2 machines separately (SkyPilot keeps them apart for the same reason: skypilot-catalog issue 31);
  ``notes`` shows both terms.

Sources. Prices, vCPUs, RAM, GPU models and counts come from the SkyPilot catalog (github.com/skypilot-org/
skypilot-catalog), which SkyPilot refreshes from each provider's pricing API; network and GPU-link figures come
from the providers' instance documentation. The snapshots read:

- AWS: ``catalogs/v8/aws/vms.csv`` @ e385a0d348eda9cefd9806423e7725944dc249e4
- GCP: ``catalogs/v7/gcp/vms.csv`` @ 6f65ab58724c0a5b17dbb81ee124e7d7dee0d4a5
- Azure: ``catalogs/v6/azure/vms.csv`` @ 098741e70562f65d7af1cceb81e33b284f742604
- Lambda: ``catalogs/v8/lambda/vms.csv`` @ 0f4070387edc953d7004cff197940e1918a1d6aa

Dating. The commit dates of those snapshots were not available where they were read, so ``price_date`` is the
earliest date each snapshot can be from, established from its content (each row's ``notes`` repeats why):
AWS 2025-06-01 (it carries the June 2025 cut of P4/P5 on-demand prices: p5.48xlarge 55.04, where the older v7
snapshot @ 27f67dd4 has 98.32), GCP 2024-12-13 (it lists a3-highgpu-1g/2g/4g, which SkyPilot's fetcher gained
in PR 4456), Azure 2023-12-06 (it prices Standard_NC40ads_H100_v5, still unpriced in skypilot-catalog PR 50 of
that day), Lambda 2025-08-22 (it lists B200 instances, which the fetcher could read after SkyPilot PR 6816).
Prices move; treat them as a ranking of options, and check the provider before committing money.

The CSV is checked when it is loaded (a bad cell names its line and column; a GPU key must exist in
``gpus.csv``; a partition's memory must be its share of the GPU's) because a silent typo in a price or a GPU
count would skew every plan built on it.
"""

from __future__ import annotations

import csv
import difflib
import functools
import io
import math
import re
from dataclasses import asdict, dataclass
from datetime import date
from importlib import resources
from typing import Any

from redline.errors import BadInput
from redline.specs.catalog import CatalogError, CsvRow, GpuSpec, find_gpu, gpu_catalog

COLUMNS: tuple[str, ...] = (
    "provider",
    "name",
    "gpu_key",
    "gpu_count",
    "gpu_memory_gb",
    "gpu_interconnect",
    "gpu_link_gbs",
    "vcpus",
    "ram_gib",
    "network_gbps",
    "network_kind",
    "price_usd_per_hour",
    "region",
    "price_date",
    "source",
    "notes",
)

# a new provider or fabric is a deliberate addition here, so a typo in the CSV ("asw", "infiniband ") fails loudly
PROVIDERS: tuple[str, ...] = ("aws", "gcp", "azure", "lambda")
INTERCONNECTS: tuple[str, ...] = ("nvswitch", "nvlink", "pcie", "none")
NETWORK_KINDS: tuple[str, ...] = ("efa", "infiniband", "ethernet", "gpudirect-tcpx", "gpudirect-tcpxo")

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


@dataclass(frozen=True)
class InstanceSpec:
    """One rentable instance type as its provider sells it. ``None`` means not verified (see ``notes``)."""

    provider: str  # "aws" | "gcp" | "azure" | "lambda"
    name: str  # the provider's instance type: "p5.48xlarge", "Standard_ND96isr_H100_v5"
    gpu_key: str  # a key in gpus.csv
    gpu_count: float  # GPUs the VM sees; a fraction of one for partitioned GPUs (0.125 .. 0.5)
    gpu_memory_gb: float  # per GPU as the VM sees it (a partition: its share)
    gpu_interconnect: str  # "nvswitch" | "nvlink" | "pcie" | "none" (at most one GPU)
    gpu_link_gbs: float | None  # GPU-to-GPU per GPU, both directions; the PCIe figure for PCIe-only GPUs
    vcpus: int
    ram_gib: float
    network_gbps: float | None  # the RDMA fabric where there is one, else Ethernet
    network_kind: str  # "efa" | "infiniband" | "ethernet" | "gpudirect-tcpx" | "gpudirect-tcpxo"
    price_usd_per_hour: float  # on-demand, Linux, whole instance, in ``region``
    region: str  # "any" where the provider has one price everywhere
    price_date: str  # YYYY-MM-DD: the earliest date the price snapshot can be from (module docstring)
    source: str
    notes: str = ""

    @property
    def gpu(self) -> GpuSpec:
        """The GPU model, from the GPU catalog."""
        return find_gpu(self.gpu_key)

    @property
    def whole_gpus(self) -> int:
        """GPUs a job can use one by one: ``gpu_count`` when whole, else 0 (a partition runs no multi-GPU job)."""
        return int(self.gpu_count) if float(self.gpu_count).is_integer() else 0

    @property
    def price_verified(self) -> bool:
        """False where the catalog row's notes flag the price as UNVERIFIED (it disagrees with other sources)."""
        return "UNVERIFIED" not in self.notes.upper()

    @property
    def price_per_gpu_hour(self) -> float:
        """Price of one whole GPU's worth per hour; for a partition, what a whole GPU would cost at its rate."""
        return self.price_usd_per_hour / self.gpu_count

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field plus the GPU's name, ``whole_gpus`` and ``price_per_gpu_hour``."""
        data = asdict(self)
        data["gpu_name"] = self.gpu.name
        data["whole_gpus"] = self.whole_gpus
        data["price_per_gpu_hour"] = round(self.price_per_gpu_hour, 6)
        return data


# ------------------------------------------------------------------------------------------ loading


def parse_instance_csv(text: str, origin: str = "instances.csv") -> list[InstanceSpec]:
    """Parse and check instance CSV text; raise CatalogError naming the line and column of any bad cell."""
    reader = csv.DictReader(io.StringIO(text))
    if tuple(reader.fieldnames or ()) != COLUMNS:
        raise CatalogError(f"{origin}: header is {reader.fieldnames}, expected {list(COLUMNS)}")
    gpus = {spec.key: spec for spec in gpu_catalog()}
    specs: list[InstanceSpec] = []
    seen: set[tuple[str, str]] = set()
    for row in reader:
        where = f"{origin} line {reader.line_num}"
        spec = _parse_row(row, where, gpus)
        ident = (spec.provider, spec.name.lower())
        if ident in seen:
            raise CatalogError(f"{where}: duplicate instance '{spec.provider}:{spec.name}'")
        seen.add(ident)
        specs.append(spec)
    return specs


def _parse_row(raw: dict[str, str | None], where: str, gpus: dict[str, GpuSpec]) -> InstanceSpec:
    row = CsvRow(raw, where)
    cell, text, choice, number, required = row.cell, row.text, row.choice, row.number, row.required

    provider = choice("provider", PROVIDERS)
    gpu_key = text("gpu_key")
    gpu = gpus.get(gpu_key)
    if gpu is None:
        raise CatalogError(f"{where}: column 'gpu_key': '{gpu_key}' is not a key in gpus.csv")

    gpu_count = required("gpu_count")
    if not gpu_count.is_integer() and gpu_count > 1:
        raise CatalogError(f"{where}: column 'gpu_count': '{cell('gpu_count')}' is neither whole nor a part of one GPU")
    memory = required("gpu_memory_gb")
    expected = gpu.memory_gb * min(gpu_count, 1.0)  # a partition sees its share of one GPU
    if not math.isclose(memory, expected, rel_tol=0.01):
        raise CatalogError(
            f"{where}: column 'gpu_memory_gb': '{cell('gpu_memory_gb')}' does not match {gpu.key}'s "
            f"{gpu.memory_gb} GB for {cell('gpu_count')} GPU(s) (expected {expected:g})"
        )

    interconnect = choice("gpu_interconnect", INTERCONNECTS)
    link = number("gpu_link_gbs")
    if gpu_count > 1 and (interconnect == "none" or link is None):
        raise CatalogError(f"{where}: column 'gpu_interconnect': {cell('gpu_count')} GPUs need a link and its GB/s")
    if gpu_count <= 1 and (interconnect != "none" or link is not None):
        raise CatalogError(f"{where}: column 'gpu_interconnect': at most one GPU has no link: use 'none' and no GB/s")

    vcpus = row.required_integer("vcpus")

    price_date = text("price_date")
    try:
        if not _DATE.fullmatch(price_date):
            raise ValueError
        date.fromisoformat(price_date)
    except ValueError:
        raise CatalogError(f"{where}: column 'price_date': '{price_date}' is not a YYYY-MM-DD date") from None

    return InstanceSpec(
        provider=provider,
        name=text("name"),
        gpu_key=gpu_key,
        gpu_count=gpu_count,
        gpu_memory_gb=memory,
        gpu_interconnect=interconnect,
        gpu_link_gbs=link,
        vcpus=vcpus,
        ram_gib=required("ram_gib"),
        network_gbps=number("network_gbps"),
        network_kind=choice("network_kind", NETWORK_KINDS),
        price_usd_per_hour=required("price_usd_per_hour"),
        region=text("region"),
        price_date=price_date,
        source=text("source"),
        notes=cell("notes"),
    )


@functools.cache
def _load() -> tuple[InstanceSpec, ...]:
    # a tuple, so the one cached copy cannot be changed by a caller
    text = resources.files("redline.specs").joinpath("data/instances.csv").read_text(encoding="utf-8")
    return tuple(parse_instance_csv(text))


# ------------------------------------------------------------------------------------------- lookup


def instance_catalog() -> list[InstanceSpec]:
    """Every instance in the catalog, in CSV order. The CSV is read once; each call returns a fresh list."""
    return list(_load())


def find_instance(name: str) -> InstanceSpec:
    """Look an instance up by name (any case) or as "provider:name"; BadInput naming close matches if unknown.

    A bare name that two providers share is ambiguous and must be given with its provider.
    """
    wanted = name.strip()
    provider, sep, bare = wanted.partition(":")
    if sep and provider.strip().lower() in PROVIDERS:
        provider, bare = provider.strip().lower(), bare.strip()
    else:
        provider, bare = "", wanted
    matches = [
        spec for spec in _load() if spec.name.lower() == bare.lower() and (not provider or spec.provider == provider)
    ]
    if len(matches) == 1:
        return matches[0]
    if matches:
        options = ", ".join(f"{spec.provider}:{spec.name}" for spec in matches)
        raise BadInput(f"instance '{name}' is ambiguous; say which: {options}")
    names = {spec.name.lower(): spec.name for spec in _load()}
    close = [names[key] for key in difflib.get_close_matches(bare.lower(), list(names), n=5, cutoff=0.6)]
    hint = f"did you mean {', '.join(close)}?" if close else "run `redline catalog instances` for the list"
    raise BadInput(f"unknown instance '{name}'; {hint}")
