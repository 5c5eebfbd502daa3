"""What `redline bench` prints and saves: a table whole at 80 and 120 columns, the dataloader grid with its
spread, and every figure measured on a busy host marked, footnoted, warned about and saved marked."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from redline.bench import store, suites
from redline.bench.context import BenchContext
from redline.bench.model import BenchRun, Measurement, Spread
from redline.cli import bench as bench_cli
from redline.cli import ui
from redline.hw.snapshot import BusyProcess, CpuBusy
from tables import WIDTHS, assert_whole

BUSY = CpuBusy(2.0, 2, 2.0, 1.9, 6.1, [BusyProcess(4242, "python3", "alice", 1.0)])


def _grid_row(workers: int, prefetch: int | None, rate: float) -> dict[str, object]:
    return {
        "num_workers": workers,
        "prefetch_factor": prefetch,
        "persistent_workers": workers > 0,
        "pin_memory": False,
        "threads": 1,
        "samples_per_s": rate,
        "samples_per_s_p10": rate * 0.9,
        "samples_per_s_p90": rate * 1.1,
        "startup_s": 0.0123,
    }


def _measurements(busy: bool) -> list[Measurement]:
    host_cpu = {"busy": busy, "summary": BUSY.describe()}
    grid = [_grid_row(0, None, 512.3), _grid_row(1, 2, 498.1), _grid_row(2, 2, 1003.4), _grid_row(2, 4, 1010.9)]
    return [
        Measurement("compute", "matmul_fp32", 1.234, "TFLOP/s", "torch.matmul", spread=Spread(1.2, 1.1, 1.3, 1, 1.4)),
        Measurement(
            "memory",
            "h2d_pinned",
            24.5,
            "GB/s",
            "copy_",
            device="cuda:0",
            peak=63.0,
            peak_source="PCIe Gen5 x16",
            spread=Spread(24.5, 23.1, 25.2, 22, 26),
        ),
        Measurement("storage", "rand_read_4k", 123456.0, "IOPS", "preadv", spread=Spread(1, 120_000, 125_000, 1, 1)),
        Measurement(
            "dataloader",
            "samples_per_s",
            1010.9,
            "samples/s",
            "DataLoader",
            spread=Spread(1010.9, 909.8, 1112.0, 1, 1),
            extra={
                "host_cpu": host_cpu,
                "grid": grid,
                "setting": "num_workers=2",
                "recommended": {
                    "num_workers": 2,
                    "prefetch_factor": 4,
                    "persistent_workers": True,
                    "pin_memory": False,
                },
            },
        ),
    ]


def _printed(measurements: list[Measurement], width: int, monkeypatch: pytest.MonkeyPatch) -> str:
    buffer = io.StringIO()
    monkeypatch.setattr(ui, "console", Console(file=buffer, width=width, markup=False, color_system=None))
    ui.print_measurements(measurements)
    return buffer.getvalue()


@pytest.mark.parametrize("width", WIDTHS)
def test_the_bench_table_and_grid_are_whole_tables_at_any_width(width, monkeypatch):
    """The finding: at 80 columns rich cut figures ("1.235e+0…") out of the bench table."""
    text = _printed(_measurements(busy=False), width, monkeypatch)
    assert_whole(text, "matmul_fp32", "h2d_pinned cuda:0", "1.234 TFLOP/s", "123,500 IOPS", "39% of 63", width=width)
    assert_whole(text, "120,000-125,000", "1,011 samples/s", "910-1,110", "[4]", width=width)
    # a table, not stacked: the header row and the grid's rows as rows
    headers = [line.split() for line in text.splitlines()]
    assert ["suite", "measurement", "value", "of", "peak", "p10-p90", "how"] in headers
    assert ["workers", "prefetch", "pin", "threads", "samples/s", "p10-p90", "start-up", "s"] in headers
    (chosen,) = [line for line in text.splitlines() if "<- use" in line]
    assert chosen.split()[:4] == ["2", "4", "no", "1"] and "1,011  909.8-1,112" in chosen


@pytest.mark.parametrize("width", WIDTHS)
def test_the_dataloader_row_names_the_setting_its_figure_is(width, monkeypatch):
    """The finding: the row read "samples_per_s 1,011 samples/s" next to advice for another setting. It names
    the setting the figure was measured at, the one the grid marks to use, and still fits 80 columns."""
    text = _printed(_measurements(busy=False), width, monkeypatch)
    (row,) = [line for line in text.splitlines() if line.startswith("dataloader ")]
    assert row.split()[:4] == ["dataloader", "num_workers=2", "1,011", "samples/s"]
    assert ["suite", "measurement", "value", "of", "peak", "p10-p90", "how"] in [
        line.split() for line in text.splitlines()
    ]


@pytest.mark.parametrize("width", WIDTHS)
def test_a_figure_from_a_busy_host_is_marked_and_footnoted(width, monkeypatch):
    text = _printed(_measurements(busy=True), width, monkeypatch)
    (row,) = [line for line in text.splitlines() if line.startswith("dataloader ")]
    assert "1,011 samples/s*" in row
    assert "1.234 TFLOP/s*" not in text  # the others were not measured on a busy host
    footnote = " ".join(text.split("* dataloader: measured while", 1)[1].split())
    assert footnote.startswith("other processes kept 1.9 of 2 CPUs busy (load 6.1; python3 (alice) 1.0)")
    assert_whole(text, "1,011 samples/s*", width=width)


def test_every_suite_records_how_busy_the_host_was(monkeypatch):
    class Watch:
        def stop(self, host: object) -> CpuBusy:
            return BUSY

    monkeypatch.setattr("redline.hw.cpu_busy.CpuWatch", Watch)
    monkeypatch.setattr(suites, "runner", lambda name: lambda ctx: _measurements(busy=False)[:2])
    measurements = suites.run_suite("compute", BenchContext())
    assert all(m.busy_host for m in measurements)
    record = measurements[0].extra["host_cpu"]
    assert record["others_cores"] == 1.9 and record["taken_ratio"] == 0.95 and record["load_1m"] == 6.1
    assert record["top"] == [{"pid": 4242, "name": "python3", "user": "alice", "cpu_cores": 1.0}]


def test_save_warns_and_keeps_the_mark_for_the_doctor_and_the_planner(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REDLINE_HOME", str(tmp_path))
    monkeypatch.setattr(ui, "console", Console(file=io.StringIO(), width=120))
    run = BenchRun("f" * 12, {}, "2026-12-07T20:00:00+00:00", _measurements(busy=True))
    bench_cli._report(run, json_out=False, save=True)
    warning = " ".join(capsys.readouterr().err.split())
    assert "1 of the 4 figures were measured while other processes kept 1.9 of 2 CPUs busy" in warning
    assert "saved marked as taken on a busy host" in warning and "when it is idle" in warning
    saved = store.latest("f" * 12)
    assert saved is not None
    assert [m.name for m in saved.measurements if m.busy_host] == ["samples_per_s"]


def _busy(suite: str, name: str, **extra: object) -> Measurement:
    host_cpu = {"busy": True, "summary": BUSY.describe()}
    return Measurement(suite, name, 1.0, "MB/s", "m", extra={"host_cpu": host_cpu, **extra})


def test_save_names_the_command_that_measures_the_busy_figures_again(tmp_path, monkeypatch, capsys):
    """The finding: the warning said "rerun `redline bench --save`", every suite again, while the doctor named
    the affected ones. It names the suites measured busy, with the --path and --dataset that chose what they
    measured (a storage rerun without its --path would measure the current folder's disk instead)."""
    monkeypatch.setenv("REDLINE_HOME", str(tmp_path))
    monkeypatch.setattr(ui, "console", Console(file=io.StringIO(), width=120))
    measurements = [
        _measurements(busy=False)[0],
        _busy("storage", "seq_read", path="/mnt/my data"),
        _busy("storage", "rand_read_4k", path="/mnt/my data"),
        _busy("dataloader", "samples_per_s", dataset_spec="mydata:build"),
    ]
    bench_cli._report(BenchRun("f" * 12, {}, "2026-12-07T20:00:00+00:00", measurements), json_out=False, save=True)
    warning = " ".join(capsys.readouterr().err.split())
    assert "3 of the 4 figures were measured while" in warning
    assert (
        "rerun `redline bench storage dataloader --path '/mnt/my data' --dataset mydata:build --save` when it is idle"
        in warning
    )


def test_the_rerun_command_keeps_to_the_suites_and_their_options():
    assert suites.rerun_command([_busy("compute", "matmul_fp32"), _busy("memory", "device_copy")]) == (
        "redline bench compute memory --save"
    )
    # the synthetic dataset is the default: no --dataset; figures of two paths: one to fill in
    two_paths = [_busy("storage", "seq_read", path="/a"), _busy("storage", "small_files", path="/b")]
    assert suites.rerun_command([*two_paths, _busy("dataloader", "samples_per_s", dataset_spec=None)]) == (
        "redline bench storage dataloader --path DATASET_DIR --save"
    )


def _a_cpu_machines_quick_bench() -> list[Measurement]:
    """What `redline bench --quick` measures on a 2-core CPU box: no figure has a catalog peak."""
    spread = Spread(1, 27_600, 30_000, 1, 1)
    return [
        Measurement(
            "compute", "matmul_bf16", 0.001346, "TFLOP/s", "torch.matmul", spread=Spread(1, 0.00134, 0.00135, 1, 1)
        ),
        Measurement("collective", "reduce_scatter", 0.3236, "GB/s", "gloo"),
        Measurement("storage", "rand_read_128k /dev/vda", 952.0, "MB/s", "preadv", spread=spread),
        Measurement("storage", "small_files /dev/vda", 7686.0, "files/s", "readv", spread=spread),
    ]


def test_a_cpu_machines_bench_is_a_table_at_80_columns_without_a_column_of_na(monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk of the quick start on a 2-core CPU: with an "of peak" column of n/a the table was 83 wide and
    printed stacked, one block per figure; without it, one line per figure."""
    buffer = io.StringIO()
    monkeypatch.setattr(ui, "console", Console(file=buffer, width=80, markup=False, color_system=None))
    ui.print_measurements(_a_cpu_machines_quick_bench())
    text = buffer.getvalue()
    assert "of peak" not in text and "n/a" not in text
    assert_whole(text, "0.001346 TFLOP/s", "0.00134-0.00135", "27,600-30,000", width=80)
    assert any(line.startswith("storage") and "952 MB/s" in line for line in text.splitlines()), text
