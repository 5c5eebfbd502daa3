"""`redline catalog`: what each GPU model should deliver on paper (dense peaks, memory, links).

The figures come from the vendors' datasheets; `redline catalog gpus --json` shows the source of each row.
"""

from __future__ import annotations

import re

import typer
from rich import box
from rich.table import Table

from redline.cli import ui
from redline.errors import BadInput
from redline.specs.catalog import GpuSpec, gpu_catalog

app = typer.Typer(help="Browse the GPU catalog: the vendor figures redline measures against.", no_args_is_help=True)


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
