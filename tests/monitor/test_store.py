"""The monitor record: round trip, plots' series and summaries, retention, refusing files it did not write,
and durability against a killed writer and a concurrent reader."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import typing

import pytest

from redline.errors import BadInput
from redline.monitor import store as store_module
from redline.monitor.sample import GpuProcess, GpuSample, HostSample, Sample, StepSample
from redline.monitor.store import ROLLUP_S, Store

T0 = 1_700_000_000.0


@functools.cache
def _hints(cls: type) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


def _filled(cls: type, seed: int, **overrides: typing.Any) -> typing.Any:
    """An instance of a Sample dataclass with every field set to a value derived from ``seed`` (so a field the
    store dropped or mixed up would show), whatever fields the schema has today."""
    values = {}
    for i, (name, hint) in enumerate(_hints(cls).items()):
        text = str(hint)
        if name in overrides:
            values[name] = overrides[name]
        elif name == "processes":
            values[name] = [GpuProcess(pid=1000 + seed, name="python", user="ml", used_memory_bytes=seed << 20)]
        elif "list[str]" in text:
            values[name] = ["sw_power_cap", f"reason{seed}"]
        elif hint is bool:
            values[name] = bool(seed % 2)
        elif "float" in text:
            values[name] = seed + i / 8
        elif "int" in text:
            values[name] = seed * 100 + i
        elif "str" in text:
            values[name] = f"{name}-{seed}"
        else:
            raise AssertionError(f"no test value for {cls.__name__}.{name}: {hint}")
    return cls(**values)


def full_sample(k: int, gpus: int = 2) -> Sample:
    """Sample ``k``: every field of every part set (one GPU lost in every fifth sample, as NVML reports it)."""
    gpu_list = [_filled(GpuSample, k + g, index=g) for g in range(gpus)]
    if k % 5 == 0:
        gpu_list[-1] = GpuSample(index=gpus - 1, uuid=gpu_list[-1].uuid, lost=True)
    return Sample(
        time=T0 + k,
        gpus=gpu_list,
        host=_filled(HostSample, k),
        steps=[_filled(StepSample, k, rank=r, step=k) for r in range(2)],
        notes=[f"note {k}"] if k % 3 == 0 else [],
    )


def gpu_sample(
    k: int, util: float | None, power: float | None, energy: float | None, gpus: int = 2, note: str | None = None
) -> Sample:
    return Sample(
        time=T0 + k,
        notes=[note] if note else [],
        gpus=[
            GpuSample(
                index=g,
                utilization_ratio=util,
                power_watts=power,
                energy_joules_total=energy,
                memory_used_bytes=None if util is None else int(util * 1e9) + g,
                temperature_celsius=50.0 + (k % 7),
            )
            for g in range(gpus)
        ],
    )


# -- round trip ----------------------------------------------------------------------------------------------


def test_full_samples_round_trip_through_the_file(tmp_path):
    samples = [full_sample(k) for k in range(20)]
    samples.append(Sample(time=T0 + 100))  # nothing known at all
    with Store.open(tmp_path / "rec.db") as store:
        for s in samples:
            store.append(s)
    with Store.read(tmp_path / "rec.db") as store:
        assert list(store.samples()) == samples
        assert store.count() == len(samples)
        assert store.time_range() == (T0, T0 + 100)
        assert store.latest() == samples[-1]
        assert store.gpu_indices() == [0, 1]
        assert store.ranks() == [0, 1]
        assert store.notes() == [(T0 + k, f"note {k}") for k in range(0, 20, 3)]
        assert store.notes(T0 + 4, T0 + 10) == [(T0 + 6, "note 6"), (T0 + 9, "note 9")]


def test_samples_come_back_in_time_order_within_the_window_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "_CHUNK", 7)
    times = [5, 3, 9, 1, 1, 8, 2, 7, 6, 4, 0, 12, 11, 10]  # appended out of order, with a duplicate time
    with Store.open(tmp_path / "rec.db") as store:
        store.append_many(Sample(time=T0 + t, notes=[str(i)]) for i, t in enumerate(times))
        assert [s.time - T0 for s in store.samples()] == sorted(times)
        assert [s.time - T0 for s in store.samples(T0 + 2, T0 + 9)] == [2, 3, 4, 5, 6, 7, 8, 9]
        assert store.count(T0 + 2, T0 + 9) == 8


def test_reopening_appends_and_keeps_what_was_there(tmp_path):
    path = tmp_path / "rec.db"
    with Store.open(path) as store:
        store.append_many(gpu_sample(k, 0.5, 100.0, 1000.0 + 100 * k) for k in range(10))
    with Store.open(path) as store:
        store.append_many(gpu_sample(k, 0.5, 100.0, 1000.0 + 100 * k) for k in range(10, 20))
        assert [s.time - T0 for s in store.samples()] == list(range(20))
        # the energy of the first new sample counts from the last old one: nothing lost at the seam
        assert store.gpu_stats()[0].energy_joules == pytest.approx(1900.0)


# -- series for plots ----------------------------------------------------------------------------------------


def test_series_are_raw_with_none_as_gaps_when_short(tmp_path):
    utils = [0.1, None, 0.3, 0.9]
    with Store.open(tmp_path / "rec.db") as store:
        store.append_many(gpu_sample(k, u, 100.0, None) for k, u in enumerate(utils))
        lines = store.gpu_series("utilization_ratio", max_points=100)
        assert list(lines) == [0, 1]
        assert lines[1].values == utils and lines[1].times == [T0 + k for k in range(4)]
        assert not lines[1].downsampled
        assert list(store.gpu_series("utilization_ratio", gpu=1)) == [1]
        assert store.host_series("cpu_ratio").values == []  # no sample had host data
        with pytest.raises(ValueError, match="no column"):
            store.gpu_series("not_a_field")


@pytest.mark.parametrize("n", [600, 3000])  # bucket narrower than ROLLUP_S (raw rows), and wider (rollups)
def test_long_series_are_downsampled_keeping_extremes_and_gaps(tmp_path, n):
    def util(k: int) -> float | None:
        return None if n // 3 <= k < n // 3 + 100 else (k % 50) / 50

    with Store.open(tmp_path / "rec.db") as store:
        store.append_many(gpu_sample(k, util(k), 100.0, None) for k in range(n))
        line = store.gpu_series("utilization_ratio", max_points=50)[0]
    known = [u for u in map(util, range(n)) if u is not None]
    assert line.downsampled and len(line.times) <= 51
    assert line.times == sorted(line.times)
    assert min(v for v in line.lows if v is not None) == min(known)
    assert max(v for v in line.highs if v is not None) == max(known)
    assert None in line.values  # the hole of 100 samples is still a hole
    means = [v for v in line.values if v is not None]
    assert sum(means) / len(means) == pytest.approx(sum(known) / len(known), rel=0.05)


def test_several_fields_in_one_query(tmp_path):
    with Store.open(tmp_path / "rec.db") as store:
        store.append_many(full_sample(k) for k in range(1, 30))
        both = store.series("step", ["time_s", "data_s"], max_points=10)
        assert set(both) == {"time_s", "data_s"} and set(both["data_s"]) == {0, 1}
        assert all(len(s.times) <= 10 for s in both["time_s"].values())
        with pytest.raises(ValueError, match="no table"):
            store.series("nope", ["x"])


# -- summaries -----------------------------------------------------------------------------------------------


def _expected(samples: list[Sample], gpu: int, start: float, end: float) -> dict[str, float]:
    rows = [(s.time, g) for s in samples if start <= s.time <= end for g in s.gpus if g.index == gpu]
    utils = sorted(g.utilization_ratio for _, g in rows if g.utilization_ratio is not None)
    return {
        "samples": len(rows),
        "mean": sum(utils) / len(utils),
        "p95": utils[math.ceil(0.95 * len(utils)) - 1],
        "peak": max(g.memory_used_bytes for _, g in rows if g.memory_used_bytes is not None),
        "temp": max(g.temperature_celsius for _, g in rows),
    }


@pytest.mark.parametrize("window", [(None, None), (T0 + 13.5, T0 + 377.2), (T0 + 3, T0 + 7)])
def test_gpu_stats_are_exact_over_whole_and_ragged_ranges(tmp_path, window):
    samples = [gpu_sample(k, ((k * 37) % 101) / 100 if k % 11 else None, 200.0, 5000.0 + 300 * k) for k in range(400)]
    with Store.open(tmp_path / "rec.db") as store:
        store.append_many(samples)
        stats = store.gpu_stats(*window)
    start, end = window[0] or T0, window[1] or T0 + 399
    want = _expected(samples, 1, start, end)
    got = stats[1]
    assert got.samples == want["samples"]
    assert got.utilization_mean_ratio == pytest.approx(want["mean"])
    assert got.utilization_p95_ratio == pytest.approx(want["p95"])
    assert got.memory_peak_bytes == want["peak"]
    assert got.temperature_max_celsius == want["temp"]
    assert got.power_mean_watts == pytest.approx(200.0)
    # the energy counter: 300 J between consecutive samples, counted for each sample after the first
    first = math.ceil(start - T0)
    assert got.energy_joules == pytest.approx(300.0 * (want["samples"] - (1 if first == 0 else 0)))


def test_energy_counter_resets_count_nothing_and_power_fills_in_without_a_counter(tmp_path):
    counter = [1000.0, 1500.0, 2000.0, 10.0, 510.0]  # the driver reloaded before the fourth sample
    with Store.open(tmp_path / "rec.db") as store:
        store.append_many(gpu_sample(k, 0.5, 300.0, e, gpus=1) for k, e in enumerate(counter))
        assert store.gpu_stats()[0].energy_joules == pytest.approx(500 + 500 + 500)
    with Store.open(tmp_path / "power.db") as store:
        store.append_many(gpu_sample(k, 0.5, 100.0 + 100 * k, None, gpus=1) for k in range(4))
        store.append(gpu_sample(1000, 0.5, 100.0, None, gpus=1))  # after a long gap: not integrated across it
        assert store.gpu_stats()[0].energy_joules == pytest.approx(150 + 250 + 350)


def test_step_stats(tmp_path):
    with Store.open(tmp_path / "rec.db") as store:
        store.append_many(
            Sample(
                time=T0 + k,
                steps=[
                    StepSample(rank=r, step=k, time_s=1.0 + r, data_s=0.25, compute_s=0.5, optimizer_s=0.1)
                    for r in range(2)
                ],
            )
            for k in range(50)
        )
        stats = store.step_stats()
    assert stats[0].steps == 50 and stats[0].time_mean_s == pytest.approx(1.0)
    assert stats[1].data_share_ratio == pytest.approx(0.25 / 2.0)


# -- retention -----------------------------------------------------------------------------------------------


def test_retention_keeps_the_newest_window_and_prunes_now_and_then(tmp_path, monkeypatch):
    calls = []
    real_prune = Store.prune
    monkeypatch.setattr(Store, "prune", lambda self: calls.append(1) or real_prune(self))
    path = tmp_path / "rec.db"
    with Store.open(path, retention_s=100) as store:
        for k in range(600):
            store.append(gpu_sample(k, 0.5, 100.0, None, note=f"note {k}" if k % 100 == 0 else None))
            assert store.count() <= 100 + 1 + store_module.PRUNE_INTERVAL_S
    assert len(calls) < 600 / store_module.PRUNE_INTERVAL_S + 3  # periodic, not on every append
    with Store.read(path) as store:
        assert store.time_range() == (T0 + 499, T0 + 599)
        assert store.gpu_stats()[0].samples == 101
        assert store.notes() == [(T0 + 500, "note 500")]
        assert min(store.gpu_series("utilization_ratio", max_points=10)[0].times) >= T0 + 499 - ROLLUP_S
    with pytest.raises(BadInput, match="retention"):
        Store.open(tmp_path / "other.db", retention_s=0)


# -- files that are not ours, broken or out of reach ---------------------------------------------------------


def _snapshot(path):
    return path.read_bytes(), sorted(p.name for p in path.parent.iterdir())


def _assert_refused(path, match: str) -> None:
    before = _snapshot(path)
    for opener in (Store.open, Store.read):
        with pytest.raises(BadInput, match=match) as err:
            opener(path)
        assert "\n" not in str(err.value) and str(path) in str(err.value)
        assert _snapshot(path) == before  # not a byte changed, no -wal/-shm left beside it


def test_a_foreign_sqlite_database_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE samples (id INTEGER PRIMARY KEY, time REAL, body BLOB)")
    conn.execute("INSERT INTO samples VALUES (1, 2.0, x'00')")
    conn.commit()
    conn.close()
    _assert_refused(path, "another application")


@pytest.mark.parametrize("content", [b"time,gpu,util\n1,0,0.5\n" * 50, bytes(range(256)) * 8, b"SQLite format"])
def test_a_file_that_is_not_a_record_is_refused_and_left_untouched(tmp_path, content):
    path = tmp_path / "notes.db"
    path.write_bytes(content)
    _assert_refused(path, "not a redline monitor record|corrupt")


def test_a_truncated_record_is_refused_naming_a_way_out(tmp_path):
    path = tmp_path / "rec.db"
    with Store.open(path) as store:
        store.append_many(full_sample(k, gpus=4) for k in range(300))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _assert_refused(path, r"corrupt.*truncated.*new path")


def test_a_record_with_damaged_pages_is_refused_before_recording(tmp_path):
    path = tmp_path / "rec.db"
    with Store.open(path) as store:
        store.append_many(full_sample(k, gpus=4) for k in range(300))
    data = bytearray(path.read_bytes())
    page = 4096
    for start in range(3 * page, len(data) - page, 5 * page):  # scribble over every fifth page past the schema
        data[start : start + page] = bytes([0x5A]) * page
    path.write_bytes(bytes(data))
    before = path.read_bytes()
    with pytest.raises(BadInput, match=r"corrupt.*new path"):
        Store.open(path)
    assert path.read_bytes() == before
    with pytest.raises(BadInput, match="corrupt"), Store.read(path) as store:  # found where it is read
        list(store.samples())
        store.gpu_stats()


def test_a_record_from_a_newer_redline_is_refused(tmp_path):
    path = tmp_path / "rec.db"
    Store.open(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {store_module.FORMAT_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(BadInput, match="newer"):
        Store.open(path)


def test_an_empty_file_becomes_a_record_and_a_missing_one_is_not_invented_by_read(tmp_path):
    (tmp_path / "empty.db").write_bytes(b"")
    with Store.open(tmp_path / "empty.db") as store:
        store.append(full_sample(1))
    with pytest.raises(BadInput, match="no monitor record"):
        Store.read(tmp_path / "missing.db")
    assert not (tmp_path / "missing.db").exists()


def test_a_folder_is_created_and_an_unwritable_place_is_a_clear_error(tmp_path):
    with Store.open(tmp_path / "new" / "deeper" / "rec.db") as store:
        store.append(full_sample(1))
    (tmp_path / "file").write_text("x")
    with pytest.raises(BadInput, match="cannot create the folder") as err:
        Store.open(tmp_path / "file" / "rec.db")
    assert "\n" not in str(err.value)
    with pytest.raises(BadInput, match="is a folder, not a file"):
        Store.open(tmp_path / "new")


@contextlib.contextmanager
def _read_only(*paths):
    """Make ``paths`` unwritable even for root (chattr +i; chmod for anyone else), and writable again after."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", *paths], check=False).returncode:
            pytest.skip("running as root where chattr +i is not available")
        undo = ["chattr", "-i", *paths]
    else:
        for p in paths:
            p.chmod(0o500 if p.is_dir() else 0o400)
        undo = ["chmod", "u+w", *paths]
    try:
        yield
    finally:
        subprocess.run(undo, check=True)


def test_a_read_only_place_is_a_clear_error_for_recording_but_can_be_read(tmp_path):
    folder = tmp_path / "mount"
    folder.mkdir()
    path = folder / "rec.db"
    with Store.open(path) as store:
        store.append_many(full_sample(k) for k in range(5))
    with _read_only(path, folder):
        for target in (path, folder / "new.db"):
            with pytest.raises(BadInput, match="writable") as err:
                Store.open(target)
            assert "\n" not in str(err.value) and str(target) in str(err.value)
        with Store.read(path) as store:  # a report of a record on a read-only mount
            assert store.count() == 5 and len(list(store.samples())) == 5
        assert sorted(p.name for p in folder.iterdir()) == ["rec.db"]


# -- other processes -----------------------------------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys, time
    from redline.monitor.sample import GpuSample, Sample
    from redline.monitor.store import Store
    store = Store.open(sys.argv[1])
    for k in range(int(sys.argv[2])):
        store.append(Sample(time=1_700_000_000.0 + k, gpus=[GpuSample(index=0, utilization_ratio=k / 1000)]))
        print(k, flush=True)  # acknowledged: append returned, so the sample is committed
        time.sleep(float(sys.argv[3]))
    store.close()
    """
)


def _writer(path, samples: int, pause: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(samples), str(pause)],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_killed_writer_loses_at_most_the_sample_in_flight(tmp_path):
    path = tmp_path / "rec.db"
    writer = _writer(path, 100_000, 0.0)
    acknowledged = -1
    while acknowledged < 200:
        acknowledged = int(writer.stdout.readline())
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=10)
    unread = writer.stdout.read().split()  # acknowledged while we were not looking
    writer.stdout.close()
    acknowledged = int(unread[-1]) if unread else acknowledged
    with Store.open(path) as store:  # recovers from the WAL, and records on
        count = store.count()
        assert acknowledged + 1 <= count <= acknowledged + 2
        assert [s.time for s in store.samples()] == [T0 + k for k in range(count)]
        store.append(Sample(time=T0 + count))
        assert store.count() == count + 1


def test_a_reader_sees_a_running_writer_and_does_not_block_it(tmp_path):
    path = tmp_path / "rec.db"
    writer = _writer(path, 150, 0.004)
    assert writer.stdout.readline()  # the file exists
    seen = []
    with Store.read(path) as reader:
        while writer.poll() is None:
            seen.append(reader.count())
            assert all(s.gpus[0].utilization_ratio is not None for s in reader.samples())
        writer.stdout.read()
        writer.stdout.close()
        assert writer.returncode == 0
        assert reader.count() == 150
    assert len(set(seen)) > 3 and seen == sorted(seen)  # it watched the record grow


# -- one writer, readers that change nothing -----------------------------------------------------------------


def test_a_second_writer_is_refused_with_the_holders_pid_and_the_first_records_on(tmp_path):
    path = tmp_path / "rec.db"
    with Store.open(path) as first:
        first.append(full_sample(1))
        with pytest.raises(BadInput, match=f"being written by another process \\(pid {os.getpid()}\\)") as err:
            Store.open(path)
        assert "\n" not in str(err.value) and str(path) in str(err.value)
        first.append(full_sample(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.db"]  # the lock goes with its writer
    with Store.open(path) as again:  # ... and the next writer may come
        assert again.count() == 2


def test_a_killed_writers_lock_is_taken_over(tmp_path):
    path = tmp_path / "rec.db"
    writer = _writer(path, 100_000, 0.01)
    assert writer.stdout.readline()
    with pytest.raises(BadInput, match=f"pid {writer.pid}"):
        Store.open(path)
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    writer.stdout.close()
    assert (tmp_path / "rec.db.lock").exists()  # left behind by the kill; the kernel released the lock itself
    with Store.open(path) as store:
        assert store.count() >= 1


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_reading_a_record_changes_no_byte_of_it_after_a_killed_writer(tmp_path):
    """A writer killed with its last commits in the WAL: a reader sees them and leaves the WAL unfolded."""
    path = tmp_path / "rec.db"
    writer = _writer(path, 100_000, 0.0)
    while int(writer.stdout.readline()) < 50:
        pass
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    writer.stdout.close()
    before = _files(tmp_path)
    assert before["rec.db-wal"]  # the commits that a read-write close would fold into rec.db
    with Store.read(path) as store:
        assert store.count() >= 51
    after = _files(tmp_path)
    assert after["rec.db"] == before["rec.db"] and after["rec.db-wal"] == before["rec.db-wal"]


def test_reading_a_closed_record_creates_nothing_beside_it(tmp_path):
    path = tmp_path / "rec.db"
    with Store.open(path) as store:
        store.append_many(full_sample(k) for k in range(3))
    before = _files(tmp_path)
    with Store.read(path) as store:
        assert store.count() == 3 and len(list(store.samples())) == 3
    assert _files(tmp_path) == before


def test_the_tables_columns_are_those_of_format_version_1():
    """A column added, renamed or dropped changes the record's format: raise FORMAT_VERSION (and read the old
    one) when this fails, then update the lists here."""
    from redline.monitor import record_format

    assert record_format.FORMAT_VERSION == 1
    assert record_format.STEP_FIELDS == (
        "step", "time_s", "data_s", "compute_s", "optimizer_s", "comm_s", "samples_per_s", "tokens_per_s",
        "mfu_catalog", "peak_memory_bytes", "loss",
    )  # fmt: skip
    assert record_format.HOST_FIELDS == (
        "cpu_ratio", "cpu_iowait_ratio", "load_1m", "memory_used_bytes", "memory_total_bytes", "swap_used_bytes",
        "disk_read_bytes_per_second", "disk_write_bytes_per_second", "network_rx_bytes_per_second",
        "network_tx_bytes_per_second",
    )  # fmt: skip
    assert record_format.GPU_FIELDS == (
        "lost", "utilization_ratio", "memory_bandwidth_ratio", "memory_used_bytes", "memory_total_bytes",
        "sm_clock_hertz", "sm_clock_max_hertz", "memory_clock_hertz", "power_watts", "power_limit_watts",
        "energy_joules_total", "temperature_celsius", "temperature_slowdown_celsius", "pcie_tx_bytes_per_second",
        "pcie_rx_bytes_per_second", "nvlink_tx_bytes_per_second", "nvlink_rx_bytes_per_second",
        "sm_activity_ratio", "tensor_activity_ratio",
    )  # fmt: skip
