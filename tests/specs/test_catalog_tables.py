"""`redline catalog`'s tables read whole at 80 and 120 columns: one line per GPU or instance, every key, name,
number and price unbroken, no line wider than the terminal (the finding: at 80 columns each GPU's name was
folded over five lines)."""

from __future__ import annotations

import pytest

from conftest import run_cli
from redline.specs.catalog import gpu_catalog
from redline.specs.instances import instance_catalog
from tables import WIDTHS, assert_whole


def _text(*args: str, width: int) -> str:
    result = run_cli(*args, columns=width)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _line_with(text: str, *cells: str) -> bool:
    return any(all(cell in line for cell in cells) for line in text.splitlines())


@pytest.mark.parametrize("width", WIDTHS)
def test_every_gpu_is_one_whole_line(width: int) -> None:
    text = _text("catalog", "gpus", width=width)
    assert_whole(text, "TFLOP/s", "NVLink", width=width)
    for spec in gpu_catalog():
        bf16 = spec.peak_tflops.get("bf16")
        cells = [spec.key, f"{spec.memory_bandwidth_gbs:g}", f"{bf16:g}" if bf16 else "—", spec.compute_capability]
        assert _line_with(text, *cells), f"{spec.key} is not one line with {cells}:\n{text}"
        if width >= 120:  # room for the vendor's name
            assert _line_with(text, spec.key, spec.name), text


@pytest.mark.parametrize("width", WIDTHS)
def test_every_instance_is_one_whole_line(width: int) -> None:
    text = _text("catalog", "instances", width=width)
    for spec in instance_catalog():
        prices = (f"{spec.price_usd_per_hour:.2f}", f"{spec.price_per_gpu_hour:.2f}")
        assert _line_with(text, spec.provider, spec.name, *prices), f"{spec.name} is not one line:\n{text}"
    assert_whole(text, "p5.48xlarge", "Standard_ND96amsr_A100_v4", "8 x H100 SXM5 80GB", width=width)
    if width >= 120:  # the host's side too
        assert _line_with(text, "p5.48xlarge", "NVSwitch 900", "3200 EFA")
    else:  # said where it went
        assert_whole(text, "network:", width=width)
