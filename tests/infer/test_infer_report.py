"""`redline infer`'s figures: the speed-up and samples/s come from one statistic and agree, the words say faster
or slower the right way up, and every table it prints reads whole at 80 and 120 columns, on the terminal and in
the HTML page alike."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from conftest import run_cli
from redline.cli import infer as infer_cli
from redline.cli import ui
from redline.infer import report
from redline.infer.generate import GenerationRow
from redline.infer.measure import Parity, Row, Settings, latency_stats, pick, speedups
from tables import WIDTHS, assert_whole

HERE = Path(__file__).resolve().parent
MS = 1e-3


def _timed(backend: str, batch: int, seconds: list[float], slo_ms: float | None = None) -> Row:
    """A row as ``measure`` fills it from its timed calls."""
    p50_ms, p99_ms, rate = latency_stats(seconds, batch)
    row = Row(backend, batch, "fp32", "ok", cold_s=3.0, p50_ms=p50_ms, p99_ms=p99_ms, samples_per_s=rate)
    row.peak_memory_bytes, row.calls, row.parity = 12_345_678, len(seconds), Parity(1e-6, 2e-7, 1.0)
    row.meets_slo = None if slo_ms is None else p99_ms <= slo_ms
    return row


def _header(text: str, columns: tuple[str, ...]) -> bool:
    """Whether a line of ``text`` is the header of a table of ``columns``: each, in order, on that one line."""
    pattern = r"\s+".join(re.escape(column) for column in columns)
    return any(re.fullmatch(pattern, line.strip()) for line in text.splitlines())


def _outlying(typical_s: float, outlier_s: float, every: int, calls: int = 40) -> list[float]:
    """Calls of ``typical_s`` with one of ``outlier_s`` every ``every`` (a call descheduled by a neighbour, the
    first after another backend ran): the mean moves, the median does not."""
    return [outlier_s if i % every == 0 else typical_s for i in range(calls)]


def test_speed_up_and_samples_per_s_are_one_statistic_and_agree() -> None:
    """The finding: 17.79x beside 2.4x eager's samples/s. The ratio was of p50s, samples/s of means: a backend
    whose calls are short has its mean moved most by the same few slow calls."""
    eager = _timed("eager", 8, _outlying(10 * MS, 30 * MS, every=10))
    compiled = _timed("compile", 8, _outlying(1 * MS, 30 * MS, every=4))
    speedup = speedups([eager, compiled])
    assert speedup[("compile", 8)] == pytest.approx(10.0)  # eager's p50 over compile's: above 1 is faster
    assert speedup[("eager", 8)] == pytest.approx(1.0)
    assert compiled.samples_per_s / eager.samples_per_s == pytest.approx(speedup[("compile", 8)])
    assert compiled.samples_per_s == pytest.approx(8 / (1 * MS))
    assert report.speed_cells(compiled, speedup[("compile", 8)])[4:6] == ["8,000", "10.00x"]


def test_the_verdict_says_faster_or_slower_in_words() -> None:
    settings = Settings((8,), latency_slo_ms=20.0)
    eager = _timed("eager", 8, [10 * MS] * 19 + [25 * MS], slo_ms=20.0)  # p99 over the SLO
    compiled = _timed("compile", 8, [10 / 2.4 * MS] * 20, slo_ms=20.0)
    line = report.verdict([eager, compiled], pick([eager, compiled]), settings)
    assert line.startswith("pick: compile at batch 8 (fp32): 1,920 samples/s")
    assert line.endswith("2.40x faster than eager (p50 at batch 8)")
    slower = _timed("int8-dynamic", 8, [20 * MS] * 20, slo_ms=20.0)
    line = report.verdict([eager, slower], pick([eager, slower]), settings)
    assert line.endswith("2.00x slower than eager (p50 at batch 8)") and "eager's latency" not in line
    alone = _timed("eager", 8, [10 * MS] * 20)
    assert report.verdict([alone], alone, Settings((8,))).endswith("samples/s, p99 10.00 ms")  # no ratio to itself


def _rows() -> tuple[list[Row], Row]:
    """A run as a GPU server's defaults give it: the longest backend name, an SLO missed, one failed, one absent."""
    rows = []
    for batch in (1, 32):
        rows += [
            _timed("eager", batch, [batch * 1.5 * MS] * 20, slo_ms=20.0),
            _timed("compile-max-autotune", batch, [batch * 0.25 * MS] * 20, slo_ms=20.0),
            _timed("onnxruntime-trt", batch, [batch * 0.3 * MS] * 20, slo_ms=20.0),
        ]
    rows.append(Row("tensorrt", 1, "fp32", "absent", "needs Torch-TensorRT: pip install torch-tensorrt"))
    rows.append(Row("export-aoti", 1, "fp32", "failed", "RuntimeError: no export"))
    return rows, rows[1]


def _generated() -> list[GenerationRow]:
    eager = GenerationRow("eager", 1, 96, 32, compiled="nothing", cold_s=0.2, prefill_ms=98.0)
    compiled = GenerationRow("compile", 1, 96, 32, compiled="decode step", cold_s=14.0, prefill_ms=98.0)
    eager.decode_tokens_per_s, compiled.decode_tokens_per_s = 53.0, 61.3
    eager.agreement = compiled.agreement = 1.0
    return [eager, compiled]


def _printed(width: int, monkeypatch: pytest.MonkeyPatch, generated: list[GenerationRow]) -> str:
    """What `redline infer` prints for ``_rows()`` and ``generated`` on a console ``width`` columns wide."""
    buffer = io.StringIO()
    monkeypatch.setattr(ui, "console", Console(file=buffer, width=width, markup=False, color_system=None))
    rows, best = _rows()
    infer_cli._print("gpt2", Settings((1, 32), latency_slo_ms=20.0), rows, best, generated, None)
    return buffer.getvalue()


@pytest.mark.parametrize("width", WIDTHS)
def test_the_measurement_tables_are_whole_at_each_width(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eleven columns in one table cut every cell at 80 columns ("bac…", "4,0…"); as two tables of six and seven,
    each prints as a table (a header line names every column), every name and figure whole."""
    text = _printed(width, monkeypatch, [])
    assert_whole(text, "compile-max-autotune", "onnxruntime-trt", "6.00x", "5.00x", "4,000", "over SLO", "failed")
    assert_whole(text, "11.8 MiB", "2.0e-07", "100%", "48.00", width=width)
    for columns in (report.SPEED_COLUMNS, report.BUILD_COLUMNS):
        assert _header(text, columns), f"no header line of {columns}:\n{text}"
    assert "tensorrt: absent: needs Torch-TensorRT" in text and "x eager" not in text
    assert all(f"  {note}" in text for note in report.SPEED_NOTES + report.BUILD_NOTES)


@pytest.mark.parametrize("width", WIDTHS)
def test_the_generation_table_is_whole_at_each_width(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    text = _printed(width, monkeypatch, _generated())
    assert_whole(text, "generation: batch 1, 96-token prompt, 32 new tokens", "decode step", "61.3", "1.16x", "98.00")
    assert_whole(text, width=width)
    assert _header(text, report.GENERATION_COLUMNS), text
    assert all(f"  {note}" in text for note in report.GENERATION_NOTES)


def test_the_html_report_says_what_the_terminal_says() -> None:
    rows, best = _rows()
    page = report.html_report("gpt2", rows, best, _generated(), Settings((1, 32), latency_slo_ms=20.0))
    for header in report.SPEED_COLUMNS + report.BUILD_COLUMNS + report.GENERATION_COLUMNS:
        assert f"<th>{header}</th>" in page
    assert "6.00x faster than eager (p50 at batch 1)" in page and "x eager&#x27;s latency" not in page
    assert "<td>6.00x</td>" in page and "<td>decode step</td>" in page
    assert "prefill runs eager in both modes" in page


@pytest.mark.parametrize("width", WIDTHS)
def test_the_backends_list_is_whole_at_each_width(width: int) -> None:
    done = run_cli("infer", "--list-backends", "--device", "cpu", columns=width)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_whole(done.stdout, "compile-max-autotune", "onnxruntime-trt", "int8-dynamic", "(not by default)")
    assert_whole(done.stdout, "backend", "what", "here", width=width)


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
def test_a_run_prints_its_tables_whole_at_each_width(width: int) -> None:
    done = run_cli(
        "infer", "-m", "tiny_nets:classifier", "--backends", "eager,int8-dynamic,tensorrt", "--batch", "1,4",
        "--iters", "3", cwd=HERE, columns=width,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert_whole(done.stdout, "int8-dynamic", "1.00x", "speed-up", "rel err", "pick: ", width=width)
    assert "tensorrt: absent:" in done.stdout
