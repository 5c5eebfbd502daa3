"""The cloud instance catalog: every row resolves to a GPU, adds up, and is dated and sourced; bad CSV cells are
named by line and column; lookups and `redline catalog instances` behave."""

from __future__ import annotations

import json
from datetime import date

import pytest

from conftest import run_cli
from redline.errors import BadInput
from redline.specs.catalog import CatalogError, gpu_catalog
from redline.specs.instances import (
    COLUMNS,
    INTERCONNECTS,
    NETWORK_KINDS,
    PROVIDERS,
    InstanceSpec,
    find_instance,
    instance_catalog,
    parse_instance_csv,
)

REQUIRED = {
    ("aws", "p3.2xlarge"),
    ("aws", "p3.16xlarge"),
    ("aws", "p4d.24xlarge"),
    ("aws", "p4de.24xlarge"),
    ("aws", "p5.48xlarge"),
    ("aws", "p5en.48xlarge"),
    ("aws", "g4dn.xlarge"),
    ("aws", "g4dn.12xlarge"),
    ("aws", "g5.xlarge"),
    ("aws", "g5.12xlarge"),
    ("aws", "g5.48xlarge"),
    ("aws", "g6.xlarge"),
    ("aws", "g6e.xlarge"),
    ("gcp", "a2-highgpu-1g"),
    ("gcp", "a2-highgpu-8g"),
    ("gcp", "a2-ultragpu-1g"),
    ("gcp", "a2-ultragpu-8g"),
    ("gcp", "a3-highgpu-8g"),
    ("gcp", "a3-megagpu-8g"),
    ("azure", "Standard_ND96asr_v4"),
    ("azure", "Standard_ND96amsr_A100_v4"),
    ("azure", "Standard_ND96isr_H100_v5"),
    ("azure", "Standard_NV4as_v4"),
    ("azure", "Standard_NV32as_v4"),
    ("azure", "Standard_NC24ads_A100_v4"),
    ("lambda", "gpu_1x_a100"),
    ("lambda", "gpu_8x_a100"),
    ("lambda", "gpu_8x_a100_80gb_sxm4"),
    ("lambda", "gpu_1x_h100_pcie"),
    ("lambda", "gpu_8x_h100_sxm5"),
}

# one region per provider, so prices compare like with like
REGIONS = {"aws": "us-east-1", "gcp": "us-central1", "azure": "eastus", "lambda": "any"}


def _by_name() -> dict[str, InstanceSpec]:
    return {spec.name: spec for spec in instance_catalog()}


# -------------------------------------------------------------------------------------------- data


def test_required_instances_are_present_once():
    idents = [(spec.provider, spec.name) for spec in instance_catalog()]
    assert set(idents) >= REQUIRED, REQUIRED - set(idents)
    assert len(idents) == len(set(idents))
    assert {spec.provider for spec in instance_catalog()} == set(PROVIDERS)


def test_every_gpu_key_resolves_to_the_gpu_catalog():
    keys = {spec.key for spec in gpu_catalog()}
    for spec in instance_catalog():
        assert spec.gpu_key in keys, spec.name
        assert spec.gpu.key == spec.gpu_key


def test_every_row_is_sane():
    today = date.today()
    for spec in instance_catalog():
        assert spec.price_usd_per_hour > 0, spec.name
        assert spec.vcpus > 0 and spec.ram_gib > 0, spec.name
        assert spec.gpu_count > 0, spec.name
        assert spec.gpu_count.is_integer() or spec.gpu_count < 1, spec.name
        # whole GPUs show the catalog's memory; a partition its share of one GPU
        assert spec.gpu_memory_gb == pytest.approx(spec.gpu.memory_gb * min(spec.gpu_count, 1), rel=0.01), spec.name
        assert spec.gpu_interconnect in INTERCONNECTS and spec.network_kind in NETWORK_KINDS, spec.name
        if spec.gpu_count > 1:
            assert spec.gpu_interconnect != "none" and spec.gpu_link_gbs and spec.gpu_link_gbs > 0, spec.name
        else:
            assert spec.gpu_interconnect == "none" and spec.gpu_link_gbs is None, spec.name
        if spec.gpu_interconnect in ("nvswitch", "nvlink"):
            # a link cannot beat what the GPU itself has
            assert spec.gpu_link_gbs <= spec.gpu.nvlink_gbs, spec.name
        assert spec.network_gbps is None or spec.network_gbps > 0, spec.name
        assert date(2020, 1, 1) <= date.fromisoformat(spec.price_date) <= today, spec.name
        assert spec.region == REGIONS[spec.provider], spec.name
        assert "@" in spec.source, spec.name  # names the catalog commit it was read from
        assert "not before" in spec.notes, spec.name  # says how the price was dated


@pytest.mark.parametrize(
    ("name", "gpu_key", "gpus", "price", "link", "network"),
    [
        ("p5.48xlarge", "h100-sxm", 8, 55.04, ("nvswitch", 900), (3200, "efa")),
        ("p4d.24xlarge", "a100-sxm4-40gb", 8, 21.957642, ("nvswitch", 600), (400, "efa")),
        ("g5.12xlarge", "a10g", 4, 5.672, ("pcie", 64), (40, "efa")),
        ("Standard_ND96isr_H100_v5", "h100-sxm", 8, 98.32, ("nvswitch", 900), (3200, "infiniband")),
        ("a3-megagpu-8g", "h100-sxm", 8, 92.21427, ("nvswitch", 900), (1600, "gpudirect-tcpxo")),
        ("gpu_8x_h100_sxm5", "h100-sxm", 8, 31.92, ("nvswitch", 900), (None, "ethernet")),
    ],
)
def test_known_rows(name, gpu_key, gpus, price, link, network):
    spec = _by_name()[name]
    assert (spec.gpu_key, spec.whole_gpus) == (gpu_key, gpus)
    assert spec.price_usd_per_hour == pytest.approx(price)
    assert (spec.gpu_interconnect, spec.gpu_link_gbs) == link
    assert (spec.network_gbps, spec.network_kind) == network


def test_gcp_price_is_host_plus_gpus():
    # Google bills A2/A3/G2 GPUs apart from the machine; the catalog row is the sum, and notes show the terms
    spec = _by_name()["a2-highgpu-8g"]
    assert spec.price_usd_per_hour == pytest.approx(5.91582 + 23.47126)
    assert "5.91582" in spec.notes and "23.47126" in spec.notes


def test_partitions_are_not_whole_gpus():
    nv4 = _by_name()["Standard_NV4as_v4"]
    assert (nv4.gpu_key, nv4.gpu_count, nv4.gpu_memory_gb) == ("mi25", 0.125, 2)
    assert nv4.whole_gpus == 0
    # the rate of a whole GPU: 8 slices of 0.233
    assert nv4.price_per_gpu_hour == pytest.approx(0.233 * 8)
    assert _by_name()["Standard_NV32as_v4"].whole_gpus == 1


def test_price_per_gpu_hour_and_dict():
    spec = _by_name()["p5.48xlarge"]
    assert spec.price_per_gpu_hour == pytest.approx(55.04 / 8)
    data = spec.to_dict()
    assert set(COLUMNS) <= set(data)
    assert data["gpu_name"] == "NVIDIA H100 SXM5 80GB"
    assert data["price_per_gpu_hour"] == pytest.approx(6.88)
    assert data["whole_gpus"] == 8
    json.dumps([s.to_dict() for s in instance_catalog()])  # every row is JSON-ready


def test_catalog_is_cached_but_callers_get_their_own_list():
    first = instance_catalog()
    first.clear()
    assert len(instance_catalog()) >= len(REQUIRED)
    assert len(set(instance_catalog())) == len(instance_catalog())  # hashable, and no two alike


# ---------------------------------------------------------------------------------------- lookup


def test_find_instance_exact_case_and_provider():
    assert find_instance("p5.48xlarge").provider == "aws"
    assert find_instance("P5.48XLARGE").name == "p5.48xlarge"
    assert find_instance("  standard_nd96isr_h100_v5 ").name == "Standard_ND96isr_H100_v5"
    assert find_instance("lambda:gpu_8x_h100_sxm5").provider == "lambda"
    assert find_instance("AWS:g5.xlarge").name == "g5.xlarge"


def test_find_instance_unknown_names_close_matches():
    with pytest.raises(BadInput, match=r"unknown instance 'p5.48xlarg'; did you mean p5\.48xlarge"):
        find_instance("p5.48xlarg")
    with pytest.raises(BadInput, match=r"unknown instance 'gcp:p5\.48xlarge'"):
        find_instance("gcp:p5.48xlarge")  # exists, but not at that provider
    with pytest.raises(BadInput, match=r"redline catalog instances"):
        find_instance("zzzzzz")


# -------------------------------------------------------------------------------------- validation

_HEADER = ",".join(COLUMNS) + "\n"
_GOOD_ROW = "aws,x1.big,h100-sxm,8,80,nvswitch,900,192,2048,3200,efa,55.04,us-east-1,2025-06-01,a catalog @ abc,\n"
_PART_ROW = "azure,Standard_X1,mi25,0.25,4,none,,8,28,,ethernet,0.466,eastus,2024-01-01,a catalog @ abc,a note\n"


def test_parse_good_csv():
    whole, part = parse_instance_csv(_HEADER + _GOOD_ROW + _PART_ROW)
    assert (whole.name, whole.gpu_count, whole.gpu_link_gbs, whole.network_gbps) == ("x1.big", 8, 900, 3200)
    assert whole.vcpus == 192 and isinstance(whole.vcpus, int) and whole.notes == ""
    assert (part.gpu_count, part.gpu_link_gbs, part.network_gbps, part.whole_gpus) == (0.25, None, None, 0)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (",55.04,", ",55.04x,", r"line 2: column 'price_usd_per_hour': '55\.04x' is not a number"),
        (",55.04,", ",-1,", r"line 2: column 'price_usd_per_hour': '-1' must be positive"),
        (",55.04,", ",,", r"line 2: column 'price_usd_per_hour' is empty"),
        (",h100-sxm,", ",h900,", r"line 2: column 'gpu_key': 'h900' is not a key in gpus\.csv"),
        ("aws,", "asw,", r"line 2: column 'provider': 'asw' is not one of aws, gcp, azure, lambda"),
        (",nvswitch,", ",nvlinkk,", r"line 2: column 'gpu_interconnect': 'nvlinkk' is not one of"),
        (",efa,", ",roce,", r"line 2: column 'network_kind': 'roce' is not one of"),
        (",2025-06-01,", ",2025-13-01,", r"line 2: column 'price_date': '2025-13-01' is not a YYYY-MM-DD date"),
        (",2025-06-01,", ",June 2025,", r"line 2: column 'price_date': 'June 2025' is not a YYYY-MM-DD date"),
        (",8,80,", ",1.5,80,", r"line 2: column 'gpu_count': '1\.5' is neither whole nor a part of one GPU"),
        (",8,80,", ",8,40,", r"line 2: column 'gpu_memory_gb': '40' does not match h100-sxm's 80 GB"),
        (",900,192,", ",,192,", r"line 2: column 'gpu_interconnect': 8 GPUs need a link"),
        (",192,2048,", ",192.5,2048,", r"line 2: column 'vcpus': '192\.5' is not a whole number"),
        (",a catalog @ abc,", ",,", r"line 2: column 'source' is empty"),
    ],
)
def test_parse_rejects_bad_cells(old, new, message):
    with pytest.raises(CatalogError, match=message):
        parse_instance_csv(_HEADER + _GOOD_ROW.replace(old, new, 1))


def test_parse_rejects_a_link_on_one_gpu_and_bad_partitions():
    one_gpu = "gcp,y1,l4,1,24,pcie,64,8,32,16,ethernet,0.85,us-central1,2024-12-13,a catalog @ abc,\n"
    with pytest.raises(CatalogError, match=r"line 2: column 'gpu_interconnect': at most one GPU has no link"):
        parse_instance_csv(_HEADER + one_gpu)
    with pytest.raises(CatalogError, match=r"line 3: column 'gpu_memory_gb': '16' does not match mi25's 16 GB"):
        parse_instance_csv(_HEADER + _GOOD_ROW + _PART_ROW.replace(",0.25,4,", ",0.25,16,"))


def test_parse_rejects_duplicates_bad_header_and_short_rows():
    with pytest.raises(CatalogError, match=r"line 3: duplicate instance 'aws:X1.BIG'"):
        parse_instance_csv(_HEADER + _GOOD_ROW + _GOOD_ROW.replace("x1.big", "X1.BIG"))
    with pytest.raises(CatalogError, match="header"):
        parse_instance_csv(_HEADER.replace("ram_gib", "ram_gb") + _GOOD_ROW)
    with pytest.raises(CatalogError, match=r"line 2: column '.*' is missing"):
        parse_instance_csv(_HEADER + "aws,x1.big,h100-sxm,8\n")


# --------------------------------------------------------------------------------------------- CLI


def _json_rows(*args: str) -> list[dict]:
    proc = run_cli("catalog", "instances", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _assert_one_line_error(proc, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0]


def test_cli_table():
    proc = run_cli("catalog", "instances")
    assert proc.returncode == 0, proc.stderr
    for needle in ("p5.48xlarge", "8 x H100 SXM5 80GB", "NVSwitch 900", "3200 EFA", "55.04", "6.88"):
        assert needle in proc.stdout, needle
    assert "1/8 of Radeon" in proc.stdout  # a partition, not "1 x" (the model name may fold onto the next line)
    assert "on-demand prices as of aws 2025-06-01" in proc.stdout


def test_cli_json_is_sorted_by_provider_then_price():
    rows = _json_rows()
    assert len(rows) == len(instance_catalog())
    keys = [(row["provider"], row["price_usd_per_hour"]) for row in rows]
    assert keys == sorted(keys)
    p5 = next(row for row in rows if row["name"] == "p5.48xlarge")
    assert p5["gpu_name"] == "NVIDIA H100 SXM5 80GB" and p5["source"] and p5["price_date"]


def test_cli_filters():
    assert {row["provider"] for row in _json_rows("--provider", "AZURE")} == {"azure"}
    assert {row["gpu_key"] for row in _json_rows("--gpu", "h100-sxm")} == {"h100-sxm"}
    # an exact key picks that GPU alone; anything else is a regex on key and name
    assert {row["gpu_key"] for row in _json_rows("--gpu", "a10")} == {"a10"}
    assert {row["gpu_key"] for row in _json_rows("--gpu", "H100")} == {"h100-sxm", "h100-pcie"}
    assert all(row["price_usd_per_hour"] <= 1 for row in _json_rows("--max-price", "1"))
    assert {row["name"] for row in _json_rows("^p5", "--provider", "aws", "--max-price", "60")} == {
        "p5.4xlarge",
        "p5.48xlarge",
    }
    assert [row["name"] for row in _json_rows("lambda:.*h100_sxm5$", "--gpu", "h100")] == [
        "gpu_1x_h100_sxm5",
        "gpu_8x_h100_sxm5",
    ]


def test_cli_no_match_is_one_line_exit_2():
    _assert_one_line_error(run_cli("catalog", "instances", "nosuchinstance"), "nosuchinstance")
    _assert_one_line_error(run_cli("catalog", "instances", "--gpu", "b300", "--max-price", "0.1"), "--gpu b300")
    _assert_one_line_error(run_cli("catalog", "instances", "--provider", "oracle"), "unknown provider 'oracle'")
    _assert_one_line_error(run_cli("catalog", "instances", "--max-price", "0"), "--max-price")


def test_unverified_prices_are_flagged() -> None:
    from redline.specs.instances import find_instance

    assert not find_instance("a3-highgpu-8g").price_verified  # its notes say why
    assert find_instance("p5.48xlarge").price_verified
