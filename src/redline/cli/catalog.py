"""`redline catalog`: what each GPU model should deliver on paper, and what cloud GPU instances hold and cost.

The GPU figures come from the vendors' datasheets, the instance figures from the SkyPilot catalog and the
providers' documentation; `--json` shows the source of each row.
"""

from __future__ import annotations

import re
from fractions import Fraction

import typer
from rich.table import Table

from redline.cli import ui
from redline.errors import BadInput
from redline.report.tables import listing
from redline.specs.catalog import GpuSpec, gpu_catalog
from redline.specs.instances import PROVIDERS, InstanceSpec, instance_catalog

app = typer.Typer(
    help="Browse the catalogs: the vendor figures redline measures against, and cloud GPU instances with prices.",
    no_args_is_help=True,
)


@app.command("gpus")
def gpus(
    name: str | None = typer.Argument(
        None,
        metavar="[NAME]",
        help="Only GPUs whose key or name matches NAME (case-insensitive regex), or whose NVML name it is.",
    ),
    json_output: bool = typer.Option(False, "--json", help="Print every field, sources included, as JSON."),
) -> None:
    """List the GPUs redline knows, with their dense (non-sparse) peak throughput, memory and links."""
    specs = gpu_catalog()
    if name is not None:
        specs = [spec for spec in specs if _selected(spec, name)]
        if not specs:
            raise BadInput(f"no GPU in the catalog matches '{name}'; run `redline catalog gpus` for the list")
    if json_output:
        ui.print_json([spec.to_dict() for spec in specs])
        return
    ui.print_table(_table(specs, wide=ui.console.width >= WIDE))


def _selected(spec: GpuSpec, wanted: str) -> bool:
    """Whether the NAME filter picks ``spec``: a regex search on key and name, or an exact NVML name."""
    try:
        pattern = re.compile(wanted, re.IGNORECASE)
    except re.error:  # "a100(" is a fine thing to type; treat it as plain text
        pattern = re.compile(re.escape(wanted), re.IGNORECASE)
    return bool(pattern.search(spec.key) or pattern.search(spec.name)) or spec.matches_nvml_name(wanted)


_PRECISIONS_SHOWN = ("fp32", "tf32", "bf16", "fp8")
# a terminal at least this wide gets the tables' extra columns (a GPU's name; an instance's link, CPUs, RAM and
# network); a narrower one, a pipe or a job log (80), the columns that fit 80
WIDE = 120


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:g}"


def _table(specs: list[GpuSpec], *, wide: bool) -> Table:
    """One line per GPU, at 80 columns: the key (what --hardware takes: 8xh100-sxm) and the numbers, each unit
    said once in its header; ``wide`` adds the vendor's name. The memory type and the sources are in --json."""
    table = listing(
        # at 80 columns only the box's one space between columns: the headers, wider than most values, space them
        padding=(0, 1 if wide else 0),
        caption="dense peaks (not sparse); sources: redline catalog gpus --json",
        caption_justify="left",
    )
    table.add_column("GPU", no_wrap=True)
    if wide:
        table.add_column("name", no_wrap=True)
    table.add_column("mem\nGB", justify="right", no_wrap=True)
    table.add_column("mem\nGB/s", justify="right", no_wrap=True)
    for precision in _PRECISIONS_SHOWN:
        table.add_column(f"{precision}\nTFLOP/s", justify="right", no_wrap=True)
    table.add_column("NVLink\nGB/s", justify="right", no_wrap=True)
    table.add_column("PCIe\ngen", justify="right", no_wrap=True)
    table.add_column("TDP\nW", justify="right", no_wrap=True)
    table.add_column("arch", no_wrap=True)  # CUDA compute capability, or AMD's gfx target
    for spec in specs:
        table.add_row(
            spec.key,
            *([spec.name] if wide else []),
            _num(spec.memory_gb),
            _num(spec.memory_bandwidth_gbs),
            *(_num(spec.peak_tflops.get(p)) for p in _PRECISIONS_SHOWN),
            _num(spec.nvlink_gbs),
            str(spec.pcie_gen),
            _num(spec.tdp_w),
            spec.compute_capability,
        )
    return table


# ---------------------------------------------------------------------------------------- instances


@app.command("instances")
def instances(
    name: str | None = typer.Argument(
        None,
        metavar="[NAME-REGEX]",
        help="Only instances whose name (or provider:name) matches this case-insensitive regex.",
    ),
    provider: str | None = typer.Option(
        None, "--provider", metavar="PROVIDER", help=f"Only this provider: {', '.join(PROVIDERS)}."
    ),
    gpu: str | None = typer.Option(
        None,
        "--gpu",
        metavar="KEY-OR-REGEX",
        help="Only instances with this GPU: a catalog key (h100-sxm) or a regex on the key or name (a100, H100).",
    ),
    max_price: float | None = typer.Option(
        None, "--max-price", metavar="USD", help="Only instances whose on-demand price per hour is at most USD."
    ),
    json_output: bool = typer.Option(False, "--json", help="Print every field, sources included, as JSON."),
) -> None:
    """List cloud GPU instances: GPUs, how they are linked, network and on-demand price, cheapest first."""
    specs = instance_catalog()
    if provider is not None:
        wanted = provider.strip().lower()
        if wanted not in PROVIDERS:
            raise BadInput(f"unknown provider '{provider}'; known: {', '.join(PROVIDERS)}")
        specs = [spec for spec in specs if spec.provider == wanted]
    if gpu is not None:
        keys = {gpu_spec.key.lower() for gpu_spec in gpu_catalog()}
        specs = [spec for spec in specs if _gpu_selected(spec, gpu, keys)]
    if max_price is not None:
        if not max_price > 0:
            raise BadInput(f"--max-price must be a positive price per hour, not {max_price:g}")
        specs = [spec for spec in specs if spec.price_usd_per_hour <= max_price]
    if name is not None:
        pattern = _pattern(name)
        specs = [spec for spec in specs if pattern.search(spec.name) or pattern.search(f"{spec.provider}:{spec.name}")]
    if not specs:
        raise BadInput(
            f"no instance in the catalog matches {_describe(name, provider, gpu, max_price)}; "
            "run `redline catalog instances` for the list"
        )
    specs.sort(key=lambda spec: (spec.provider, spec.price_usd_per_hour, spec.name.lower()))
    if json_output:
        ui.print_json([spec.to_dict() for spec in specs])
        return
    ui.print_table(_instance_table(specs, wide=ui.console.width >= WIDE))


def _pattern(wanted: str) -> re.Pattern[str]:
    try:
        return re.compile(wanted, re.IGNORECASE)
    except re.error:  # "p5(" is a fine thing to type; treat it as plain text
        return re.compile(re.escape(wanted), re.IGNORECASE)


def _gpu_selected(spec: InstanceSpec, wanted: str, keys: set[str]) -> bool:
    """An exact catalog key picks that GPU alone ("a10" is not "a10g"); anything else is a regex on key and name."""
    if wanted.strip().lower() in keys:
        return spec.gpu_key.lower() == wanted.strip().lower()
    pattern = _pattern(wanted)
    return bool(pattern.search(spec.gpu_key) or pattern.search(spec.gpu.name))


def _describe(name: str | None, provider: str | None, gpu: str | None, max_price: float | None) -> str:
    parts = [f"'{name}'"] if name is not None else []
    if provider is not None:
        parts.append(f"--provider {provider}")
    if gpu is not None:
        parts.append(f"--gpu {gpu}")
    if max_price is not None:
        parts.append(f"--max-price {max_price:g}")
    return " ".join(parts) or "anything"


_INTERCONNECT_NAMES = {"nvswitch": "NVSwitch", "nvlink": "NVLink", "pcie": "PCIe"}
_NETWORK_NAMES = {
    "efa": "EFA",
    "infiniband": "InfiniBand",
    "ethernet": "Ethernet",
    "gpudirect-tcpx": "TCPX",  # GPUDirect-TCPX, spelled out in --json
    "gpudirect-tcpxo": "TCPXO",
}


def _gpus_cell(spec: InstanceSpec) -> str:
    """ "8 x H100 SXM5 80GB"; a partition "1/8 of Radeon Instinct MI25". The vendor prefix only costs width."""
    gpu = spec.gpu
    model = gpu.name.removeprefix(f"{gpu.vendor} ")
    if spec.whole_gpus:
        return f"{spec.whole_gpus} x {model}"
    share = Fraction(spec.gpu_count).limit_denominator(64)
    return f"{share.numerator}/{share.denominator} of {model}"


def _interconnect_cell(spec: InstanceSpec) -> str:
    if spec.gpu_interconnect == "none":
        return "—"
    return f"{_INTERCONNECT_NAMES[spec.gpu_interconnect]} {_num(spec.gpu_link_gbs)}"


def _network_cell(spec: InstanceSpec) -> str:
    kind = _NETWORK_NAMES.get(spec.network_kind, spec.network_kind)
    return kind if spec.network_gbps is None else f"{_num(spec.network_gbps)} {kind}"


def _price_dates(specs: list[InstanceSpec]) -> str:
    dates: dict[str, set[str]] = {}
    for spec in specs:
        dates.setdefault(spec.provider, set()).add(spec.price_date)
    return ", ".join(f"{provider} {'/'.join(sorted(days))}" for provider, days in sorted(dates.items()))


def _instance_table(specs: list[InstanceSpec], *, wide: bool) -> Table:
    """One line per instance. ``wide`` (a terminal of ``WIDE`` columns) adds the GPU link, vCPUs, RAM and network;
    without it the table fits 80 columns and its caption says where the rest is."""
    rest = "" if wide else "; GPU links, vCPUs, RAM and network: a wider terminal or --json"
    table = listing(
        caption=f"on-demand prices as of {_price_dates(specs)} (earliest snapshot dates){rest}; sources: --json",
        caption_justify="left",
    )
    table.add_column("provider", no_wrap=True)
    table.add_column("instance", no_wrap=True)
    table.add_column("GPUs")  # a long one wraps at its words ("1/8 of Radeon Instinct MI25")
    table.add_column("GPU\nGB", justify="right", no_wrap=True)
    if wide:
        table.add_column("GPU link\nGB/s", no_wrap=True)
        table.add_column("vCPUs", justify="right", no_wrap=True)
        table.add_column("RAM\nGiB", justify="right", no_wrap=True)
        table.add_column("network\nGbit/s", no_wrap=True)
    table.add_column("$/h", justify="right", no_wrap=True)
    table.add_column("$/GPU-h", justify="right", no_wrap=True)
    for spec in specs:
        host = [_interconnect_cell(spec), str(spec.vcpus), _num(spec.ram_gib), _network_cell(spec)] if wide else []
        table.add_row(
            spec.provider,
            spec.name,
            _gpus_cell(spec),
            _num(spec.gpu_memory_gb),
            *host,
            f"{spec.price_usd_per_hour:.2f}",
            f"{spec.price_per_gpu_hour:.2f}",
        )
    return table
