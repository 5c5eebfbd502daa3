"""`redline catalog`: what each GPU model should deliver on paper, and what cloud GPU instances hold and cost.

The GPU figures come from the vendors' datasheets, the instance figures from the SkyPilot catalog and the
providers' documentation; `--json` shows the source of each row.
"""

from __future__ import annotations

import re
from fractions import Fraction

import typer
from rich import box
from rich.table import Table

from redline.cli import ui
from redline.errors import BadInput
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
    ui.console.print(_table(specs))


def _selected(spec: GpuSpec, wanted: str) -> bool:
    """Whether the NAME filter picks ``spec``: a regex search on key and name, or an exact NVML name."""
    try:
        pattern = re.compile(wanted, re.IGNORECASE)
    except re.error:  # "a100(" is a fine thing to type; treat it as plain text
        pattern = re.compile(re.escape(wanted), re.IGNORECASE)
    return bool(pattern.search(spec.key) or pattern.search(spec.name)) or spec.matches_nvml_name(wanted)


_PRECISIONS_SHOWN = ("fp32", "tf32", "bf16", "fp8")


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:g}"


def _table(specs: list[GpuSpec]) -> Table:
    # one line per GPU from 120 columns; narrower, cells fold rather than hide digits behind an ellipsis
    table = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
        caption="dense peaks; sources: redline catalog gpus --json",
        caption_justify="left",
    )
    table.add_column("key", overflow="fold")
    table.add_column("name", overflow="fold")
    table.add_column("memory\nGB", overflow="fold")
    table.add_column("memory\nGB/s", justify="right", overflow="fold")
    for precision in _PRECISIONS_SHOWN:
        table.add_column(f"{precision}\nTFLOP/s", justify="right", overflow="fold")
    table.add_column("NVLink\nGB/s", justify="right", overflow="fold")
    table.add_column("PCIe\ngen", justify="right", overflow="fold")
    table.add_column("TDP\nW", justify="right", overflow="fold")
    table.add_column("cc", overflow="fold")
    for spec in specs:
        table.add_row(
            spec.key,
            spec.name,
            f"{spec.memory_gb} {spec.memory_type}",
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
    ui.console.print(_instance_table(specs))


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


def _instance_table(specs: list[InstanceSpec]) -> Table:
    # one line per instance from 120 columns; narrower, cells fold rather than hide digits behind an ellipsis
    table = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
        caption=f"on-demand prices as of {_price_dates(specs)} (earliest snapshot dates); sources: --json",
        caption_justify="left",
    )
    table.add_column("provider", overflow="fold")
    table.add_column("name", overflow="fold")
    table.add_column("GPUs", overflow="fold")
    table.add_column("GPU\nmemory", justify="right", overflow="fold")
    table.add_column("GPU link\nGB/s", overflow="fold")
    table.add_column("vCPUs", justify="right", overflow="fold")
    table.add_column("RAM\nGiB", justify="right", overflow="fold")
    table.add_column("network\nGbit/s", overflow="fold")
    table.add_column("$/h", justify="right", overflow="fold")
    table.add_column("$/GPU-h", justify="right", overflow="fold")
    for spec in specs:
        table.add_row(
            spec.provider,
            spec.name,
            _gpus_cell(spec),
            f"{_num(spec.gpu_memory_gb)} GB",
            _interconnect_cell(spec),
            str(spec.vcpus),
            _num(spec.ram_gib),
            _network_cell(spec),
            f"{spec.price_usd_per_hour:.2f}",
            f"{spec.price_per_gpu_hour:.2f}",
        )
    return table
