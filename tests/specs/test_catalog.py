"""The GPU catalog: its data stays honest (dense peaks, sources), NVML names map to the right row, and
`redline catalog gpus` prints it."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from redline.cli import main as cli_main
from redline.errors import BadInput
from redline.specs.catalog import (
    PRECISIONS,
    CatalogError,
    GpuSpec,
    find_gpu,
    gpu_catalog,
    match_gpu,
    parse_gpu_csv,
)

GIB = 2**30
MIB = 2**20

REQUIRED_KEYS = {
    "v100-sxm2-16gb",
    "v100-sxm2-32gb",
    "v100-pcie-16gb",
    "v100-pcie-32gb",
    "a100-sxm4-40gb",
    "a100-sxm4-80gb",
    "a100-pcie-40gb",
    "a100-pcie-80gb",
    "h100-sxm",
    "h100-pcie",
    "h200-sxm",
    "h200-nvl",
    "a10",
    "a10g",
    "l4",
    "l40s",
    "t4",
    "rtx-3090",
    "rtx-4090",
    "rtx-a6000",
    "mi300x",
}


def _by_key() -> dict[str, GpuSpec]:
    return {spec.key: spec for spec in gpu_catalog()}


# -------------------------------------------------------------------------------------------- data


def test_every_required_gpu_is_present_once():
    keys = [spec.key for spec in gpu_catalog()]
    assert set(keys) >= REQUIRED_KEYS
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    ("key", "precision", "tflops"),
    [
        # datasheets print sparse figures (H100 SXM bf16 "1979"); the catalog holds the dense half
        ("h100-sxm", "bf16", 989.4),
        ("h100-sxm", "fp8", 1978.9),
        ("h100-sxm", "tf32", 494.7),
        ("h200-sxm", "bf16", 989.4),
        ("h100-pcie", "bf16", 756),
        ("a100-sxm4-80gb", "bf16", 312),
        ("a100-sxm4-80gb", "tf32", 156),
        ("l40s", "bf16", 362),
        ("mi300x", "bf16", 1307.4),
        ("v100-sxm2-16gb", "fp16", 125),
    ],
)
def test_peaks_are_dense(key, precision, tflops):
    spec = _by_key()[key]
    assert spec.peak_tflops[precision] == pytest.approx(tflops)
    assert spec.peak_flops(precision) == pytest.approx(tflops * 1e12)


def test_unsupported_precision_is_none_not_zero():
    v100 = _by_key()["v100-sxm2-32gb"]
    assert "bf16" not in v100.peak_tflops
    assert v100.peak_flops("bf16") is None
    assert v100.peak_flops("tf32") is None
    assert _by_key()["a100-sxm4-40gb"].peak_flops("fp8") is None


def test_unknown_precision_is_bad_input():
    with pytest.raises(BadInput, match="fp4"):
        _by_key()["h100-sxm"].peak_flops("fp4")


def test_every_row_is_complete_and_sourced():
    for spec in gpu_catalog():
        assert spec.source.strip(), spec.key
        assert spec.nvml_names, spec.key
        assert spec.memory_gb > 0 and spec.memory_bandwidth_gbs > 0, spec.key
        assert set(spec.peak_tflops) <= set(PRECISIONS), spec.key
        assert spec.peak_tflops, spec.key


def test_ecc_and_links():
    specs = _by_key()
    assert specs["rtx-3090"].ecc is False and specs["rtx-4090"].ecc is False
    assert all(specs[k].ecc for k in ("v100-sxm2-16gb", "a100-sxm4-80gb", "h100-sxm", "t4", "mi300x"))
    assert "off by default" in specs["rtx-a6000"].notes
    assert specs["v100-sxm2-16gb"].nvlink_links == 6
    assert specs["a100-sxm4-40gb"].nvlink_links == 12
    assert specs["h100-sxm"].nvlink_links == 18
    assert specs["h200-sxm"].nvlink_links == 18
    assert specs["rtx-4090"].nvlink_gbs is None


def test_a10g_is_marked_unverified():
    a10g = _by_key()["a10g"]
    assert "UNVERIFIED" in a10g.notes
    assert a10g.tdp_w is None


def test_memory_bytes_is_nominal_gib():
    assert _by_key()["a100-sxm4-80gb"].memory_bytes == 85899345920
    assert _by_key()["h200-sxm"].memory_bytes == 141 * GIB


def test_catalog_is_cached_but_callers_get_their_own_list():
    first = gpu_catalog()
    first.clear()
    assert len(gpu_catalog()) >= len(REQUIRED_KEYS)


def test_spec_is_hashable():
    assert len(set(gpu_catalog())) == len(gpu_catalog())


# ---------------------------------------------------------------------------------------- matching


@pytest.mark.parametrize(
    ("nvml_name", "memory_bytes", "key"),
    [
        ("NVIDIA H100 80GB HBM3", 81559 * MIB, "h100-sxm"),
        ("NVIDIA H100 PCIe", 81559 * MIB, "h100-pcie"),
        ("NVIDIA H200", 143771 * MIB, "h200-sxm"),
        ("NVIDIA H200 NVL", 143771 * MIB, "h200-nvl"),
        ("NVIDIA A100-SXM4-80GB", 85899345920, "a100-sxm4-80gb"),
        ("NVIDIA A100-SXM4-40GB", 40 * GIB, "a100-sxm4-40gb"),
        ("A100-SXM4-40GB", None, "a100-sxm4-40gb"),  # drivers before R470 had no "NVIDIA " prefix
        ("NVIDIA A100-PCIE-40GB", 40 * GIB, "a100-pcie-40gb"),
        ("NVIDIA A100 80GB PCIe", 80 * GIB, "a100-pcie-80gb"),
        ("Tesla V100-SXM2-16GB", 16 * GIB, "v100-sxm2-16gb"),
        ("Tesla V100-SXM2-32GB", 32 * GIB, "v100-sxm2-32gb"),
        ("Tesla V100-PCIE-32GB", 32 * GIB, "v100-pcie-32gb"),
        ("NVIDIA A10", 24 * GIB, "a10"),
        ("NVIDIA A10G", 24 * GIB, "a10g"),
        ("NVIDIA L4", 24 * GIB, "l4"),
        ("NVIDIA L40S", 48 * GIB, "l40s"),
        ("Tesla T4", 16 * GIB, "t4"),
        ("NVIDIA GeForce RTX 3090", 24 * GIB, "rtx-3090"),
        ("NVIDIA GeForce RTX 4090", 24 * GIB, "rtx-4090"),
        ("NVIDIA RTX A6000", 48 * GIB, "rtx-a6000"),
        ("AMD Instinct MI300X", 192 * GIB, "mi300x"),
        ("nvidia h100 80gb hbm3", None, "h100-sxm"),  # case-insensitive
        ("  NVIDIA L4 ", None, "l4"),  # outer whitespace ignored
    ],
)
def test_match_nvml_name(nvml_name, memory_bytes, key):
    spec = match_gpu(nvml_name, memory_bytes)
    assert spec is not None and spec.key == key


@pytest.mark.parametrize(
    ("nvml_name", "memory_bytes", "key"),
    [
        # a name without the memory size matches both rows: the memory decides
        ("Tesla V100-SXM2", 16 * GIB, "v100-sxm2-16gb"),
        ("Tesla V100-SXM2", 32 * GIB, "v100-sxm2-32gb"),
        ("Tesla V100-PCIE", 32 * GIB, "v100-pcie-32gb"),
        ("NVIDIA A100-SXM4", 85899345920, "a100-sxm4-80gb"),
        ("NVIDIA A100-SXM4", 40 * GIB, "a100-sxm4-40gb"),
        ("NVIDIA A100-PCIE", 81920 * MIB, "a100-pcie-80gb"),
        # memory unknown: the first row
        ("Tesla V100-SXM2", None, "v100-sxm2-16gb"),
        ("NVIDIA A100-SXM4", None, "a100-sxm4-40gb"),
    ],
)
def test_match_picks_by_memory(nvml_name, memory_bytes, key):
    spec = match_gpu(nvml_name, memory_bytes)
    assert spec is not None and spec.key == key


def test_memory_never_overrides_the_size_in_the_name():
    # a V100 "16GB" name matches only the 16 GB row, whatever the memory figure says
    spec = match_gpu("Tesla V100-SXM2-16GB", 32 * GIB)
    assert spec is not None and spec.key == "v100-sxm2-16gb"


@pytest.mark.parametrize(
    "nvml_name",
    [
        "NVIDIA A100",  # A10 must not match as a prefix, and bare A100 is no row
        "NVIDIA A10M",
        "NVIDIA L40",  # L4 must not match, and L40 is not in the catalog
        "NVIDIA H100 NVL",
        "NVIDIA H200 NVL2",
        "NVIDIA GeForce RTX 3090 Ti",
        "NVIDIA GeForce RTX 4090 D",
        "NVIDIA RTX 6000 Ada Generation",
        "Tesla V100S-PCIE-32GB",
        "Tesla V100-SXM2-32GB-LS",
        "AMD Instinct MI325X",
        "Quadro RTX 8000",
        "",
        "   ",
        None,
    ],
)
def test_unknown_names_do_not_match(nvml_name):
    assert match_gpu(nvml_name, 80 * GIB) is None


def test_find_gpu_by_key_name_or_nvml_name():
    assert find_gpu("h100-sxm").key == "h100-sxm"
    assert find_gpu("H100-SXM").key == "h100-sxm"
    assert find_gpu("NVIDIA GeForce RTX 4090").key == "rtx-4090"
    assert find_gpu("NVIDIA A100-SXM4-80GB").key == "a100-sxm4-80gb"
    assert find_gpu("Tesla T4").key == "t4"


def test_find_gpu_unknown_is_bad_input():
    with pytest.raises(BadInput, match=r"unknown GPU 'B300'; known: .*h100-sxm"):
        find_gpu("B300")


# -------------------------------------------------------------------------------------- validation

_HEADER = (
    "key,name,vendor,form_factor,memory_gb,memory_type,memory_bandwidth_gbs,fp64_tflops,fp64_tensor_tflops,"
    "fp32_tflops,tf32_tflops,bf16_tflops,fp16_tflops,fp8_tflops,int8_tops,nvlink_gbs,nvlink_links,pcie_gen,"
    "tdp_w,compute_capability,sm_count,ecc,nvml_names,source,notes\n"
)
_GOOD_ROW = "x1,X One,NVIDIA,PCIe,24,GDDR6,600,,,31.2,62.5,125,125,,250,,,4,150,8.6,80,true,nvidia x1,a datasheet,\n"


def test_parse_good_csv():
    (spec,) = parse_gpu_csv(_HEADER + _GOOD_ROW)
    assert spec.key == "x1"
    assert spec.peak_tflops == {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125, "int8": 250}
    assert spec.nvlink_gbs is None and spec.pcie_gen == 4 and spec.ecc is True


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (",31.2,", ",31.2x,", r"line 2: column 'fp32_tflops': '31\.2x' is not a number"),
        (",31.2,", ",-1,", r"line 2: column 'fp32_tflops': '-1' must be positive"),
        (",4,150,", ",4.5,150,", r"line 2: column 'pcie_gen': '4\.5' is not a whole number"),
        (",true,", ",yes,", r"line 2: column 'ecc': 'yes' is not true or false"),
        (",a datasheet,", ",,", r"line 2: column 'source' is empty"),
        (",nvidia x1,", ",nvidia (x1,", r"line 2: column 'nvml_names': bad regex"),
        (",600,", ",,", r"line 2: column 'memory_bandwidth_gbs' is empty"),
    ],
)
def test_parse_rejects_bad_cells(old, new, message):
    with pytest.raises(CatalogError, match=message):
        parse_gpu_csv(_HEADER + _GOOD_ROW.replace(old, new, 1))


def test_parse_rejects_duplicate_keys_and_bad_header():
    with pytest.raises(CatalogError, match="duplicate key 'x1'"):
        parse_gpu_csv(_HEADER + _GOOD_ROW + _GOOD_ROW)
    with pytest.raises(CatalogError, match="header"):
        parse_gpu_csv(_HEADER.replace("tdp_w", "tdp") + _GOOD_ROW)


# --------------------------------------------------------------------------------------------- CLI

runner = CliRunner()


def test_cli_table():
    result = runner.invoke(cli_main.app, ["catalog", "gpus"])
    assert result.exit_code == 0, result.output
    assert "h200-sxm" in result.stdout  # by the key --hardware takes (the name too on a wide terminal)
    assert "dense peaks" in result.stdout


def test_cli_json():
    result = runner.invoke(cli_main.app, ["catalog", "gpus", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert len(rows) >= 19
    h100 = next(row for row in rows if row["key"] == "h100-sxm")
    assert h100["peak_tflops"]["bf16"] == 989.4
    assert h100["source"] and h100["memory_bytes"] == 80 * GIB


@pytest.mark.parametrize(
    ("filter_", "keys"),
    [
        ("h200", {"h200-sxm", "h200-nvl"}),
        ("^a10$", {"a10"}),
        ("NVIDIA A100-SXM4-80GB", {"a100-sxm4-80gb"}),  # an NVML name, pasted from nvidia-smi
        ("a100(", set()),  # not a regex: plain text, which matches nothing here
    ],
)
def test_cli_filter(filter_, keys):
    result = runner.invoke(cli_main.app, ["catalog", "gpus", filter_, "--json"])
    if not keys:
        assert isinstance(result.exception, BadInput)
        return
    assert result.exit_code == 0, result.output
    assert {row["key"] for row in json.loads(result.stdout)} == keys


def test_cli_unknown_filter_is_bad_input():
    # CliRunner drives the typer app, which raises; turning that into a line and an exit code is main()'s job
    result = runner.invoke(cli_main.app, ["catalog", "gpus", "nosuchgpu"])
    assert isinstance(result.exception, BadInput)
    assert result.exception.exit_code == 2
    assert "nosuchgpu" in str(result.exception) and "\n" not in str(result.exception)


def test_cli_unknown_filter_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["redline", "catalog", "gpus", "nosuchgpu"])
    with pytest.raises(SystemExit) as exc:
        cli_main.main()
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "nosuchgpu" in lines[0]
    assert "Traceback" not in captured.err
