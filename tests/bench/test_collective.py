"""`redline bench collective`: nccl-tests' bandwidth rules, a real 2-rank gloo sweep, and clean failure."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import psutil
import pytest

from redline.bench import collective
from redline.bench.collective import (
    OPS,
    Plan,
    bandwidths,
    bus_factor,
    coll_counts,
    measurements,
    run_local,
    sweep_sizes,
)
from redline.bench.context import BenchContext
from redline.errors import BadInput, RedlineError

# nccl-tests' busbw factors (doc/PERFORMANCE.md), written out as numbers rather than recomputed
FACTORS = [
    ("all_reduce", 2, 1.0),
    ("all_reduce", 4, 1.5),
    ("all_reduce", 8, 1.75),
    ("reduce_scatter", 2, 0.5),
    ("reduce_scatter", 4, 0.75),
    ("reduce_scatter", 8, 0.875),
    ("all_gather", 2, 0.5),
    ("all_gather", 4, 0.75),
    ("all_gather", 8, 0.875),
    ("all_to_all", 2, 0.5),
    ("all_to_all", 4, 0.75),
    ("all_to_all", 8, 0.875),
    ("broadcast", 2, 1.0),
    ("broadcast", 4, 1.0),
    ("broadcast", 8, 1.0),
]


@pytest.mark.parametrize(("op", "nranks", "factor"), FACTORS)
def test_bus_factor_is_nccl_tests(op, nranks, factor):
    assert bus_factor(op, nranks) == pytest.approx(factor)


# one 8 GiB float sweep point (nccl-tests -e 8G), 40 ms per call: S is count*4 for all_reduce and broadcast,
# count*4*n for the others, where count is what nccl-tests prints (elements per rank or per peer)
SIZE_8G = 8 * 1024**3
COUNT_8G = SIZE_8G // 4


@pytest.mark.parametrize(
    ("op", "nranks", "paramcount", "algbw_gbps"),
    [
        ("all_reduce", 8, COUNT_8G, SIZE_8G / 0.04 / 1e9),
        ("broadcast", 8, COUNT_8G, SIZE_8G / 0.04 / 1e9),
        ("all_gather", 8, COUNT_8G // 8, SIZE_8G / 0.04 / 1e9),
        ("reduce_scatter", 4, COUNT_8G // 4, SIZE_8G / 0.04 / 1e9),
        ("all_to_all", 2, COUNT_8G // 2, SIZE_8G / 0.04 / 1e9),
    ],
)
def test_bandwidths_follow_nccl_tests_conventions(op, nranks, paramcount, algbw_gbps):
    send, recv, param = coll_counts(op, COUNT_8G, nranks)
    assert param == paramcount
    assert max(send, recv) * 4 == SIZE_8G  # nccl-tests' size column
    algbw, busbw = bandwidths(op, param, 4, nranks, 0.04)
    assert algbw == pytest.approx(algbw_gbps)
    assert busbw == pytest.approx(algbw_gbps * dict(((o, n), f) for o, n, f in FACTORS)[op, nranks])


def test_a_real_nccl_tests_line():
    # all_reduce_perf on 8 GPUs: "8589934592 2147483648 float sum -1 39818 215.73 377.52 0"
    algbw, busbw = bandwidths("all_reduce", 2147483648, 4, 8, 39818e-6)
    assert round(algbw, 2) == 215.73
    assert busbw == pytest.approx(377.52, abs=0.02)


def test_counts_round_down_to_a_multiple_of_the_ranks_as_nccl_tests_does():
    assert coll_counts("reduce_scatter", 10, 4) == (8, 2, 2)
    assert coll_counts("all_gather", 10, 4) == (2, 8, 2)
    assert coll_counts("all_to_all", 10, 4) == (8, 8, 2)
    assert coll_counts("all_reduce", 10, 4) == (10, 10, 10)
    assert sweep_sizes(8, 64) == [8, 16, 32, 64]


def test_expected_patterns_are_exact_and_catch_misplaced_data():
    import torch

    from redline.bench.collective_worker import count_wrong, fill_, rank_table, sum_table

    cpu = torch.device("cpu")
    t = fill_(torch.empty(300), rank_table(3, cpu), start=5)
    assert count_wrong(t, rank_table(3, cpu), start=5) == 0
    assert count_wrong(t, rank_table(2, cpu), start=5) == 300  # another rank's block never matches
    t[7] += 1
    assert count_wrong(t, rank_table(3, cpu), start=5) == 1
    assert count_wrong(torch.full((10,), float("nan")), rank_table(0, cpu)) == 10
    total = sum_table(8, cpu)
    assert torch.equal(total, sum(rank_table(r, cpu) for r in range(8)))


def _leftovers() -> tuple[list[psutil.Process], list[Path]]:
    """This process's live children and the collective's scratch folders: a test takes them before and after.
    (Children from before are the test session's own, such as the server ``run_cli`` forks commands from.)"""
    children = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    return children, sorted(Path(tempfile.gettempdir()).glob("redline-collective-*"))


@pytest.mark.ranks
def test_two_gloo_ranks_sweep_every_op_and_get_exact_results():
    before = _leftovers()
    plan = Plan(backend="gloo", device="cpu", sizes_bytes=sweep_sizes(8, 64 * 1024), warmup=1, iters=3, timeout_s=60)
    steps = []
    result = run_local(plan, 2, on_size=lambda: steps.append(1))
    found = measurements(result, plan)

    assert [m.name for m in found] == list(OPS)
    assert len(steps) == len(OPS) * len(plan.sizes_bytes)
    for m in found:
        assert m.suite == "collective" and m.unit == "GB/s" and m.device == "cpu"
        assert m.value > 0 and math.isfinite(m.value)
        assert m.size["size_bytes"] == 64 * 1024 and m.size["ranks"] == 2
        assert m.extra["wrong_total"] == 0 and "#wrong 0" in m.method
        assert m.extra["avg_busbw_gbps"] > 0
        rows = m.extra["rows"]
        assert len(rows) == len(plan.sizes_bytes)
        for row in rows:
            assert row["wrong"] == 0
            assert row["time_us"] > 0 and math.isfinite(row["busbw_gbps"])
            assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bus_factor(m.name, 2))
    assert _leftovers() == before


@pytest.mark.ranks
def test_a_failing_rank_is_named_and_every_rank_is_reaped():
    before = _leftovers()
    plan = Plan(backend="gloo", device="cpu", sizes_bytes=[8], warmup=1, iters=1, timeout_s=60)
    plan.fault = {"rank": 1, "kind": "raise"}
    with pytest.raises(RedlineError, match=r"rank 1 failed: RuntimeError: injected fault"):
        run_local(plan, 2)
    assert _leftovers() == before


@pytest.mark.ranks
def test_a_hung_rank_hits_the_time_bound_and_every_rank_is_reaped(monkeypatch):
    before = _leftovers()
    monkeypatch.setattr(collective, "STARTUP_ALLOWANCE_S", 0.0)
    plan = Plan(backend="gloo", device="cpu", sizes_bytes=[8], warmup=1, iters=1, timeout_s=8)
    plan.fault = {"rank": 0, "kind": "hang"}
    with pytest.raises(RedlineError, match=r"no result after 8 s"):
        run_local(plan, 2)
    assert _leftovers() == before


@pytest.mark.parametrize(
    ("device", "ranks", "needle"),
    [
        ("cpu", 1, "at least 2 ranks"),
        ("cuda:0", 2, "one rank per GPU"),
    ],
)
def test_bad_rank_setups_are_one_line_errors(device, ranks, needle):
    with pytest.raises(BadInput, match=needle):
        collective.run(BenchContext(device=device, ranks=ranks, quick=True))


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(BadInput, match="2 ranks need 2 GPUs, torch sees 1"):
        collective.run(BenchContext(device="cuda", ranks=2, quick=True))


def test_under_torchrun_it_runs_as_the_given_rank(monkeypatch):
    """A one-rank group stands in for torchrun here: no spawning, rank 0 returns the figures."""
    children = _leftovers()[0]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(collective._free_port()))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setattr(collective, "plan_for", lambda ctx: Plan(backend="gloo", device="cpu", sizes_bytes=[64]))
    assert collective.under_torchrun()
    found = collective.run(BenchContext(device="cpu", ranks=2))
    assert [m.name for m in found] == list(OPS)
    assert all(m.extra["launcher"] == "torchrun" and m.extra["wrong_total"] == 0 for m in found)
    # one rank moves nothing over a link: nccl-tests' factors give 0 for all but broadcast
    assert {m.name for m in found if m.value == 0} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert _leftovers()[0] == children
