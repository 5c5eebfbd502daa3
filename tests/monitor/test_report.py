"""`redline report`: the offline HTML page and the PNGs, from records of 2 to 8 GPUs, with gaps, empty, long."""

from __future__ import annotations

import base64
import math
import re
import struct
import time

import pytest

from redline.doctor.model import Area, Finding, Severity
from redline.errors import BadInput
from redline.monitor.report import GENERATOR, PLOT_TITLES, _with_gaps, render_html, render_pngs
from redline.monitor.sample import GpuSample, HostSample, Sample, StepSample
from redline.monitor.store import Store

T0 = 1_700_000_000.0
GiB = 1024**3
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def sample(k: int, gpus: int, *, steps: bool = True, lost: int | None = None) -> Sample:
    """Sample ``k`` of a training run on ``gpus`` GPUs: utilisation that breathes, memory that climbs, a
    power cap and a clock that drops now and then; GPU ``lost`` reads as NVML reports a lost GPU."""
    return Sample(
        time=T0 + k,
        gpus=[
            GpuSample(index=g, lost=True)
            if g == lost
            else GpuSample(
                index=g,
                name="NVIDIA H100 80GB HBM3",
                utilization_ratio=0.75 + 0.25 * math.sin(k / 30 + g),
                memory_used_bytes=(40 + (k % 100) // 10 + g) * GiB,
                memory_total_bytes=80 * GiB,
                power_watts=450.0 + 10 * g + 50 * math.cos(k / 20),
                power_limit_watts=700.0,
                energy_joules_total=1e6 + 500.0 * k,
                sm_clock_hertz=1.98e9 if k % 50 else 1.6e9,
                sm_clock_max_hertz=1.98e9,
                temperature_celsius=60.0 + g + (k % 40) / 4,
                temperature_slowdown_celsius=87.0,
            )
            for g in range(gpus)
        ],
        host=HostSample(cpu_ratio=0.2 + 0.1 * math.sin(k / 15), cpu_iowait_ratio=0.01),
        steps=[step(k, r) for r in range(gpus)] if steps else [],
    )


def step(k: int, rank: int) -> StepSample:
    return StepSample(rank=rank, step=k, time_s=0.5, data_s=0.05 + rank / 100, compute_s=0.4, optimizer_s=0.05)


FINDINGS = [
    Finding(Severity.INFO, "Host CPU mostly idle <b>", "nothing", "nothing", rule="monitor.cpu-idle"),
    Finding(
        Severity.FAIL,
        "GPU 1 held at its power cap 62% of the time",
        "clocks drop",
        "raise the cap",
        evidence={"gpu": 1, "ratio": 0.62},
        rule="monitor.power-capped",
        area=Area.POWER_THERMAL,
        subject="GPU 1",
    ),
    Finding(Severity.WARN, "Rank 3 waits on data 30% of each step", "idle GPUs", "more workers", rule="monitor.data"),
]


def _pngs_in(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def _assert_png(data: bytes) -> None:
    assert data.startswith(PNG_SIGNATURE)
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert width == 1000 and height == 300
    assert data.rstrip().endswith(b"IEND\xaeB`\x82")


@pytest.mark.parametrize("gpus", [2, 8])
def test_the_page_is_one_self_contained_file_with_every_plot_and_the_findings(tmp_path, gpus):
    record = tmp_path / "rec.db"
    with Store.open(record) as store:
        store.append_many(sample(k, gpus) for k in range(300))
    out = render_html(record, FINDINGS, tmp_path / "report.html", title="run 42 on gpu-box")
    page = out.read_text(encoding="utf-8")
    images = _pngs_in(page)
    assert len(images) == len(PLOT_TITLES)
    for image in images:
        _assert_png(image)
    # offline: nothing fetched, nothing run
    assert not re.search(r"(src|href)=\"(?!data:)|<script|@import|url\(", page)
    assert GENERATOR in page[:512] and "<title>run 42 on gpu-box</title>" in page
    # findings worst first, escaped, with their evidence, cost and fix
    positions = [page.index(f.title.replace("<", "&lt;").replace(">", "&gt;")) for f in FINDINGS]
    assert positions[1] < positions[2] < positions[0]
    assert "clocks drop" in page and "raise the cap" in page and "&quot;ratio&quot;: 0.62" in page
    # the summary: range, every GPU with its mean utilisation and energy (500 J a sample, 299 intervals)
    assert "2023-11-14 22:13:20 UTC" in page and "2023-11-14 22:18:19 UTC" in page
    assert page.count("<td>NVIDIA H100 80GB HBM3</td>") == gpus
    assert f"<td>{299 * 500 / 3600:.1f} Wh</td>" in page
    assert "Not recorded" not in page


def test_pngs_for_a_terminal_user(tmp_path):
    samples = [sample(k, 4) for k in range(120)]
    paths = render_pngs(samples, tmp_path / "plots")
    assert [p.name for p in paths] == [f"{slug}.png" for slug in PLOT_TITLES]
    for path in paths:
        _assert_png(path.read_bytes())
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "host-cpu.png").write_bytes(b"my holiday photo")
    with pytest.raises(BadInput, match="not written by redline"):
        render_pngs(samples, mine)
    assert [p.name for p in mine.iterdir()] == ["host-cpu.png"]  # refused before writing any plot
    assert (mine / "host-cpu.png").read_bytes() == b"my holiday photo"
    assert render_pngs(samples[:60], tmp_path / "plots") == paths  # its own files, replaced
    assert all(path.stat().st_mtime_ns > 0 for path in paths)


def test_missing_values_are_gaps_and_missing_parts_are_named(tmp_path):
    samples = [sample(k, 3, steps=False, lost=1 if 40 <= k < 80 else None) for k in range(150)]
    samples[40].notes = ["NVML: GPU 1 is lost (Xid 79)"]
    for s in samples[100:110]:
        for g in s.gpus:
            g.utilization_ratio = None  # NVML did not answer for a while
    samples = samples[:120] + [Sample(time=s.time + 3600, gpus=s.gpus, host=s.host) for s in samples[120:]]  # a hole
    page = render_html(samples, [], tmp_path / "r.html").read_text()
    drawn = re.findall(r'<img alt="([^"]+)"', page)
    assert len(drawn) == len(PLOT_TITLES) - 1 and not any("step" in alt for alt in drawn)
    for image in _pngs_in(page):
        _assert_png(image)
    assert "Not recorded: training step time and data wait." in page
    assert "No findings" in page
    assert "2023-11-14 22:14:00 UTC: NVML: GPU 1 is lost (Xid 79)" in page  # the sampler's notes, with their time


def test_a_record_with_nothing_plottable_still_reports_what_it_has(tmp_path):
    samples = [Sample(time=T0 + k, notes=["no NVIDIA driver"] if k == 0 else []) for k in range(5)]
    page = render_html(samples, [], tmp_path / "r.html").read_text()
    assert not _pngs_in(page)
    assert "No GPU was recorded" in page and "no NVIDIA driver" in page


def test_an_empty_record_or_range_is_a_clear_error(tmp_path):
    record = tmp_path / "rec.db"
    Store.open(record).close()
    for call in (lambda: render_html(record, [], tmp_path / "r.html"), lambda: render_pngs([], tmp_path / "p")):
        with pytest.raises(BadInput, match="holds no samples") as err:
            call()
        assert "\n" not in str(err.value)
    assert not (tmp_path / "r.html").exists()
    with Store.open(record) as store:
        store.append_many(sample(k, 2) for k in range(10))
    with pytest.raises(BadInput, match="no samples between"):
        render_html(record, [], tmp_path / "r.html", start=T0 + 100)
    with pytest.raises(BadInput, match="no monitor record"):
        render_html(tmp_path / "missing.db", [], tmp_path / "r.html")


def test_the_page_never_replaces_the_record_or_a_file_redline_did_not_write(tmp_path):
    record = tmp_path / "rec.db"
    with Store.open(record) as store:
        store.append_many(sample(k, 2) for k in range(10))
    before = record.read_bytes()
    with pytest.raises(BadInput, match="refusing to overwrite the monitor record"):
        render_html(record, [], record)
    assert record.read_bytes() == before
    notes = tmp_path / "notes.html"
    notes.write_text("<p>my notes</p>")
    with pytest.raises(BadInput, match="not written by redline"):
        render_html(record, [], notes)
    assert notes.read_text() == "<p>my notes</p>"


def test_a_window_of_the_record(tmp_path):
    with Store.from_samples(sample(k, 2) for k in range(300)) as store:
        page = render_html(store, [], tmp_path / "r.html", start=T0 + 100, end=T0 + 199).read_text()
    assert "2023-11-14 22:15:00 UTC" in page and "2023-11-14 22:16:39 UTC" in page and "<td>100</td>" in page


def test_a_long_record_renders_in_bounded_time(tmp_path):
    """Two hours at 1 Hz on 2 GPUs, drawn at 100 points a line: the plots come from the store's rollups, so this
    costs about what a short record does."""
    n = 2 * 3600
    samples = [
        Sample(
            time=T0 + k,
            gpus=[GpuSample(index=g, utilization_ratio=(k % 97) / 96, memory_used_bytes=k << 20) for g in range(2)],
            host=HostSample(cpu_ratio=0.5),
        )
        for k in range(n)
    ]
    with Store.from_samples(samples) as store:
        started = time.perf_counter()
        page = render_html(store, [], tmp_path / "r.html", max_points=100).read_text()
        elapsed = time.perf_counter() - started
        line = store.gpu_series("utilization_ratio", max_points=100)[0]
    assert elapsed < 10, f"rendering {n} samples took {elapsed:.1f} s"
    assert len(line.times) <= 100 and line.downsampled
    assert min(line.lows) == 0 and max(line.highs) == 1  # the extremes survive downsampling
    assert len(_pngs_in(page)) == 3  # utilisation, memory, host CPU
    assert f"<td>{n:,}</td>" in page


def test_none_and_holes_in_time_break_the_line_instead_of_drawing_zeros():
    times, values = _with_gaps([T0, T0 + 1, T0 + 2, T0 + 3, T0 + 600, T0 + 601], [0.5, None, 0.25, 1.0, 0.5, 0.5], 100)
    assert len(times) == 7 and str(times.dtype) == "datetime64[us]"
    assert [None if math.isnan(v) else v for v in values] == [50, None, 25, 100, None, 50, 50]
