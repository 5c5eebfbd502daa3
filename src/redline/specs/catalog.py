"""The GPU catalog: what each GPU model should deliver on paper, from the vendor's own datasheets.

Everything that judges a server ("this H100 reaches 60% of its bf16 peak", "this link should run at Gen5")
needs the number the vendor promises. Those numbers live in ``data/gpus.csv``, one row per GPU, each with
the datasheet or whitepaper it came from in ``source``, so a reader can check every figure.

Conventions of the CSV:

- Units are in the column names (``_gb``, ``_gbs``, ``_tflops``, ``_w``). ``memory_gb`` is the marketing
  number ("80GB"); ``nvlink_gbs`` is the total GPU-to-GPU bandwidth per GPU, both directions together.
- Every peak is DENSE: datasheets often print the 2:4 sparsity figure, twice the dense one; we never do.
  ``int8_tops`` is in tera-operations per second, the rest in TFLOP/s.
- An empty cell means not supported or not applicable (no NVLink, no fp8 tensor cores) or, for a row whose
  notes say UNVERIFIED, not known. fp64 is left empty on GA10x/AD10x parts: they run it at 1/64 rate and
  their datasheets do not list it.
- ``tdp_w`` is the board maximum; many SKUs ship configured lower.
- ``sm_count`` is the streaming multiprocessors enabled on the product (compute units on AMD), from the
  architecture whitepapers (Volta V100, Ampere GA100 and GA102, Hopper H100, Ada AD102/AD104, Turing TU104) and
  AMD's CDNA3 and Vega whitepapers; the planner's GEMM model fills the GPU in waves of that many tiles.
- ``nvml_names`` is a ``|``-separated list of case-insensitive regexes, each of which must match the WHOLE
  name NVML reports (``re.fullmatch``), so "NVIDIA A10" cannot match "NVIDIA A100" or "NVIDIA A10G".
  Where NVML names carry the memory size the size is optional in the pattern: a name without it matches
  several rows and ``match_gpu`` picks by memory.

The CSV is checked when it is loaded (a bad number names the line and column) because a silent typo in a
peak would skew every efficiency figure redline prints.
"""

from __future__ import annotations

import csv
import functools
import io
import math
import re
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

from redline.errors import BadInput, RedlineError

# precision -> CSV column, in the order reports show them
PRECISION_COLUMNS: dict[str, str] = {
    "fp64": "fp64_tflops",
    "fp64_tensor": "fp64_tensor_tflops",
    "fp32": "fp32_tflops",
    "tf32": "tf32_tflops",
    "bf16": "bf16_tflops",
    "fp16": "fp16_tflops",
    "fp8": "fp8_tflops",
    "int8": "int8_tops",
}
PRECISIONS: tuple[str, ...] = tuple(PRECISION_COLUMNS)

COLUMNS: tuple[str, ...] = (
    "key",
    "name",
    "vendor",
    "form_factor",
    "memory_gb",
    "memory_type",
    "memory_bandwidth_gbs",
    *PRECISION_COLUMNS.values(),
    "nvlink_gbs",
    "nvlink_links",
    "pcie_gen",
    "tdp_w",
    "compute_capability",
    "sm_count",
    "ecc",
    "nvml_names",
    "source",
    "notes",
)


class CatalogError(RedlineError):
    """The catalog CSV itself is wrong: a bug in redline's package data, not in the user's input."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model as its vendor specifies it. ``None`` means not applicable or not known."""

    key: str  # short, stable id: "h100-sxm", "a100-sxm4-80gb"
    name: str  # human name: "NVIDIA H100 SXM5 80GB"
    vendor: str  # "NVIDIA" | "AMD"
    form_factor: str  # "SXM5", "PCIe", "OAM"...
    memory_gb: int  # marketing number: 80 for an "80GB" part
    memory_type: str  # "HBM3", "GDDR6X"...
    memory_bandwidth_gbs: float
    # dense peak per precision in TFLOP/s (TOPS for int8); only the precisions the GPU supports are present
    peak_tflops: dict[str, float] = field(hash=False)
    nvlink_gbs: float | None  # GPU-to-GPU, per GPU, both directions; Infinity Fabric on AMD
    nvlink_links: int | None
    pcie_gen: int
    tdp_w: float | None  # board maximum
    compute_capability: str  # "9.0"; the gfx target ("gfx942") on AMD
    # streaming multiprocessors (compute units on AMD): how many output tiles a GEMM runs at once, a wave
    sm_count: int
    ecc: bool  # the part supports ECC memory (not that it is on)
    nvml_names: tuple[str, ...]  # whole-name, case-insensitive regexes
    source: str  # the datasheet or whitepaper the figures come from
    notes: str = ""

    @property
    def memory_bytes(self) -> int:
        """Nominal memory size to compare with what NVML reports (``memory_gb`` GiB).

        Vendors say "80GB" while NVML reports bytes close to a GiB multiple (an 80GB A100: 85899345920 =
        80 GiB; an H100 80GB: 81559 MiB; an H200: 143771 MiB), so GiB is the nearer reading of the label.
        """
        return self.memory_gb * 2**30

    def peak_flops(self, precision: str) -> float | None:
        """Dense peak in FLOP/s (operations/s for int8), or None when the GPU lacks that precision."""
        if precision not in PRECISION_COLUMNS:
            raise BadInput(f"unknown precision '{precision}'; known: {', '.join(PRECISIONS)}")
        tflops = self.peak_tflops.get(precision)
        return None if tflops is None else tflops * 1e12

    def matches_nvml_name(self, name: str) -> bool:
        """Whether ``name`` (as NVML reports it) is this model, ignoring case and outer whitespace."""
        name = name.strip()
        return any(re.fullmatch(pattern, name, re.IGNORECASE) for pattern in self.nvml_names)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field plus ``memory_bytes``."""
        data = asdict(self)
        data["nvml_names"] = list(self.nvml_names)
        data["memory_bytes"] = self.memory_bytes
        return data


# ------------------------------------------------------------------------------------------ loading


def peak_precisions(precision: str, *, tf32: bool = True) -> tuple[str, ...]:
    """The catalog precisions whose dense peak MFU is quoted against for matmuls in ``precision``, best first
    (the next is used where a GPU has no figure for the first): fp32 counts as TF32 where TF32 matmuls run, and
    fp8 against bf16, as the Llama 3 paper reports fp8-era MFU (fp8 recipes keep attention and the output layer
    in bf16, so the fp8 peak would understate them). The planner's ``mfu_peak`` and the runtime's
    ``peak_flops`` both take it from here."""
    if precision == "fp8":
        return ("bf16", "fp8")
    if precision == "fp32" and tf32:
        return ("tf32", "fp32")
    return (precision,)


def parse_gpu_csv(text: str, origin: str = "gpus.csv") -> list[GpuSpec]:
    """Parse and check catalog CSV text; raise CatalogError naming the line and column of any bad cell."""
    reader = csv.DictReader(io.StringIO(text))
    if tuple(reader.fieldnames or ()) != COLUMNS:
        raise CatalogError(f"{origin}: header is {reader.fieldnames}, expected {list(COLUMNS)}")
    specs: list[GpuSpec] = []
    seen: set[str] = set()
    for row in reader:
        spec = _parse_row(row, f"{origin} line {reader.line_num}")
        if spec.key.lower() in seen:
            raise CatalogError(f"{origin} line {reader.line_num}: duplicate key '{spec.key}'")
        seen.add(spec.key.lower())
        specs.append(spec)
    return specs


class CsvRow:
    """One row of a catalog CSV, read cell by cell; every bad cell is a CatalogError naming line and column."""

    def __init__(self, row: dict[str, str | None], where: str) -> None:
        self.row = row
        self.where = where  # "gpus.csv line 7"

    def error(self, column: str, message: str) -> CatalogError:
        return CatalogError(f"{self.where}: column '{column}': {message}")

    def cell(self, column: str) -> str:
        value = self.row.get(column)
        if value is None:  # a short row: csv.DictReader fills missing cells with None
            raise CatalogError(f"{self.where}: column '{column}' is missing")
        return value.strip()

    def text(self, column: str) -> str:
        value = self.cell(column)
        if not value:
            raise CatalogError(f"{self.where}: column '{column}' is empty")
        return value

    def choice(self, column: str, allowed: tuple[str, ...]) -> str:
        value = self.text(column)
        if value not in allowed:
            raise self.error(column, f"'{value}' is not one of {', '.join(allowed)}")
        return value

    def number(self, column: str) -> float | None:
        """A positive, finite number, or None for an empty cell."""
        value = self.cell(column)
        if not value:
            return None
        try:
            parsed = float(value)
        except ValueError:
            raise self.error(column, f"'{value}' is not a number") from None
        if not (parsed > 0 and math.isfinite(parsed)):  # also rejects nan
            raise self.error(column, f"'{value}' must be positive")
        return parsed

    def integer(self, column: str) -> int | None:
        parsed = self.number(column)
        if parsed is not None and not parsed.is_integer():
            raise self.error(column, f"'{self.cell(column)}' is not a whole number")
        return None if parsed is None else int(parsed)

    def required(self, column: str) -> float:
        parsed = self.number(column)
        if parsed is None:
            raise CatalogError(f"{self.where}: column '{column}' is empty")
        return parsed

    def required_integer(self, column: str) -> int:
        parsed = self.integer(column)
        if parsed is None:
            raise CatalogError(f"{self.where}: column '{column}' is empty")
        return parsed


def _parse_row(raw: dict[str, str | None], where: str) -> GpuSpec:
    row = CsvRow(raw, where)
    cell, text, number, integer = row.cell, row.text, row.number, row.integer

    ecc = text("ecc").lower()
    if ecc not in ("true", "false"):
        raise CatalogError(f"{where}: column 'ecc': '{cell('ecc')}' is not true or false")

    patterns = tuple(p.strip() for p in text("nvml_names").split("|"))
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise CatalogError(f"{where}: column 'nvml_names': bad regex '{pattern}': {exc}") from None

    peaks = {p: v for p, column in PRECISION_COLUMNS.items() if (v := number(column)) is not None}
    return GpuSpec(
        key=text("key"),
        name=text("name"),
        vendor=text("vendor"),
        form_factor=text("form_factor"),
        memory_gb=row.required_integer("memory_gb"),
        memory_type=text("memory_type"),
        memory_bandwidth_gbs=row.required("memory_bandwidth_gbs"),
        peak_tflops=peaks,
        nvlink_gbs=number("nvlink_gbs"),
        nvlink_links=integer("nvlink_links"),
        pcie_gen=row.required_integer("pcie_gen"),
        tdp_w=number("tdp_w"),
        compute_capability=text("compute_capability"),
        sm_count=row.required_integer("sm_count"),
        ecc=ecc == "true",
        nvml_names=patterns,
        source=text("source"),
        notes=cell("notes"),
    )


@functools.cache
def _load() -> tuple[GpuSpec, ...]:
    # a tuple, so the one cached copy cannot be changed by a caller
    text = resources.files("redline.specs").joinpath("data/gpus.csv").read_text(encoding="utf-8")
    return tuple(parse_gpu_csv(text))


# ------------------------------------------------------------------------------------------- lookup


def gpu_catalog() -> list[GpuSpec]:
    """Every GPU in the catalog, in CSV order. The CSV is read once; each call returns a fresh list."""
    return list(_load())


def match_gpu(name: str | None, memory_total_bytes: int | None = None) -> GpuSpec | None:
    """The catalog entry for a GPU as NVML describes it, or None when the model is not in the catalog.

    When several entries match (a name without its memory size, e.g. "Tesla V100-SXM2"), the one whose
    nominal memory is closest to ``memory_total_bytes`` wins; with memory unknown, the first in the CSV.
    """
    if not name or not name.strip():
        return None
    candidates = [spec for spec in _load() if spec.matches_nvml_name(name)]
    if not candidates:
        return None
    if memory_total_bytes is None:
        return candidates[0]
    return min(candidates, key=lambda spec: abs(spec.memory_bytes - memory_total_bytes))


def find_gpu(key_or_name: str) -> GpuSpec:
    """Look a GPU up by key ("h100-sxm", any case), catalog name or NVML name; BadInput if unknown."""
    wanted = key_or_name.strip().lower()
    for spec in _load():
        if wanted in (spec.key.lower(), spec.name.lower()):
            return spec
    matched = match_gpu(key_or_name)
    if matched is None:
        known = ", ".join(s.key for s in _load())
        raise BadInput(f"unknown GPU '{key_or_name}'; known: {known}")
    return matched
