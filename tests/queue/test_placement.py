"""Where jobs go, from what NVML says (through the NVML fake: the daemon reads the real one), and which start
when (priority, aging, backfill, per-user limits)."""

from __future__ import annotations

from fakes.fake_nvml import FakeNvml, FakeProcess, eight_gpu_server, h100_sxm, rtx_4090
from redline.hw.nvml.probe import probe_gpus
from redline.queue.placement import Devices, Request, Reservation, more_gpus_than_here, slots_from
from redline.queue.policy import AGING_S, Limits, Running, Waiting, decide, ordered

GIB = 2**30
MIB = 2**20


def devices(nvml: FakeNvml, ours: set[int] = frozenset(), reservations=()) -> Devices:
    return Devices(slots_from(probe_gpus(nvml), set(ours)), list(reservations))


def test_jobs_share_a_gpu_while_they_fit_and_pack_fills_the_fullest() -> None:
    """Two GPUs of 80 GiB: a 30 GiB job goes to GPU 0; under pack the next 30 GiB job joins it, and a third
    that would not fit beside them goes to GPU 1; spread would have put the second on the empty GPU."""
    gpus = devices(FakeNvml([h100_sxm(0), h100_sxm(1)]))
    first = gpus.place(Request(1, 30 * GIB))
    assert first.uuids == (gpus.slots[0].uuid,) and first.reserved_bytes == (30 * GIB,)
    gpus = gpus.with_job("1", first, exclusive=False)
    second = gpus.place(Request(1, 30 * GIB), "pack")
    assert second.uuids == (gpus.slots[0].uuid,)
    assert gpus.place(Request(1, 30 * GIB), "spread").uuids == (gpus.slots[1].uuid,)
    gpus = gpus.with_job("2", second, exclusive=False)
    assert gpus.place(Request(1, 30 * GIB)).uuids == (gpus.slots[1].uuid,)  # 19.6 GiB left on GPU 0


def test_a_process_the_queue_did_not_start_counts_and_keeps_whole_gpu_jobs_off() -> None:
    """gflow's bug (#208): a GPU holding 21 GiB of a hand-started process looked free. Here its memory is out
    of the room NVML reports, a 70 GiB job does not go there, and a job asking whole GPUs neither; the reason
    names the process."""
    busy = h100_sxm(0, memory_used_mib=21 * 1024, processes=[FakeProcess(4242, 21 * GIB)])
    gpus = devices(FakeNvml([busy]))
    assert gpus.slots[0].foreign == ((4242, 21 * GIB),)
    assert "GPU 0 has 58.6 GiB free of the 70.0 GiB asked" in gpus.place(Request(1, 70 * GIB))
    assert "a process the queue did not start (pid 4242, 21.0 GiB)" in gpus.place(Request(1))
    assert gpus.place(Request(1, 50 * GIB)).uuids == (busy.uuid,)
    # the same process as one of the queue's own jobs is not foreign
    assert devices(FakeNvml([busy]), ours={4242}).slots[0].foreign == ()


def test_a_running_job_reserves_what_it_has_not_taken_yet() -> None:
    """A job reserved 40 GiB and holds 10 so far (NVML sees its pid): the room is 80 - 10 used - 30 to come."""
    gpu = h100_sxm(0, memory_used_mib=10 * 1024, processes=[FakeProcess(100, 10 * GIB)])
    slots = slots_from(probe_gpus(FakeNvml([gpu])), {100})
    gpus = Devices(slots, [Reservation("1", gpu.uuid, 40 * GIB, slots[0].using({100}))])
    assert gpus.room(slots[0]) == 81559 * MIB - 40 * GIB
    assert isinstance(gpus.place(Request(1, 40 * GIB)), str) and gpus.place(Request(1, 39 * GIB)).uuids


def test_exclusive_and_whole_gpu_jobs_take_gpus_alone() -> None:
    gpus = devices(FakeNvml([h100_sxm(0)]))
    alone = gpus.place(Request(1, 10 * GIB, exclusive=True))
    assert alone.reserved_bytes == (81559 * MIB,)  # it holds the whole GPU
    taken = gpus.with_job("1", alone, exclusive=True)
    assert "held whole by job 1" in taken.place(Request(1, 1 * GIB))
    shared = gpus.with_job("2", gpus.place(Request(1, 10 * GIB)), exclusive=False)
    assert "runs job 2" in shared.place(Request(1, exclusive=True))


def test_several_gpus_come_from_one_nvlink_domain_or_numa_node() -> None:
    """Eight H100s behind NVSwitches are one NVLink domain: a 4-GPU job gets four of it. Four RTX 4090s
    (no NVLink), two per NUMA node: a 2-GPU job gets a pair on one node, even when pack would pick across."""
    h100 = devices(eight_gpu_server("h100"))
    assert {s.domain for s in h100.slots} == {"nvlink-0"}
    assert len(h100.place(Request(4, 10 * GIB)).uuids) == 4
    boxes = [rtx_4090(i, bus_id=f"00000000:{0x18 + i:02X}:00.0") for i in range(4)]
    nvml = FakeNvml(boxes)
    gpus = devices(nvml)
    gpus.slots = [s.__class__(**{**s.__dict__, "numa_node": s.index // 2}) for s in gpus.slots]
    gpus = gpus.with_job("1", gpus.place(Request(1, 20 * GIB)), exclusive=False)  # GPU 0, node 0
    pair = gpus.place(Request(2, 2 * GIB))
    numa = {s.uuid: s.numa_node for s in gpus.slots}
    assert len({numa[u] for u in pair.uuids}) == 1 and pair.note == ""


def test_a_lost_or_failing_gpu_is_drained() -> None:
    gpus = devices(FakeNvml([h100_sxm(0, lost=True), h100_sxm(1)]))
    assert gpus.slots[0].drained == "lost"
    assert gpus.place(Request(1, GIB)).uuids == (gpus.slots[1].uuid,)
    assert (
        gpus.place(Request(3, GIB)) == "asks 3 GPUs; this machine has 2: ask --gpus 2 or fewer (`--gpus 0`: on the CPU)"
    )
    assert "drained (lost)" in gpus.place(Request(2, GIB))


# ------------------------------------------------------------------------------------------------ policy


def one_gpu() -> Devices:
    return devices(FakeNvml([h100_sxm(0)]))


def test_a_job_that_asks_more_gpus_than_the_machine_has_is_told_how_to_ask_fewer() -> None:
    """What `redline submit` says on a machine without a GPU (the daemon's refusal) names the way out."""
    assert more_gpus_than_here(1, 0) == "asks 1 GPU; this machine has 0: `--gpus 0` runs it on the CPU"
    told = more_gpus_than_here(2, 0, " (its plan's; --gpus overrides it)")
    assert told == "asks 2 GPUs (its plan's; --gpus overrides it); this machine has 0: `--gpus 0` runs it on the CPU"


def test_priority_then_first_come_and_aging() -> None:
    jobs = [
        Waiting("1", 0, 0, 100.0, Request(1)),
        Waiting("2", 0, 5, 200.0, Request(1)),
        Waiting("3", 0, 5, 150.0, Request(1)),
    ]
    assert [j.id for j in ordered(jobs, now=300.0)] == ["3", "2", "1"]
    # a job of priority 0 that has waited six aging periods goes before a new one of priority 5
    old, new = Waiting("old", 0, 0, 0.0, Request(1)), Waiting("new", 0, 5, 6 * AGING_S, Request(1))
    assert [j.id for j in ordered([new, old], now=6 * AGING_S)] == ["old", "new"]
    younger = Waiting("old", 0, 0, 2 * AGING_S, Request(1))  # four periods: 4 < 5
    assert [j.id for j in ordered([younger, new], now=6 * AGING_S)] == ["new", "old"]


def test_backfill_never_delays_the_head_job() -> None:
    """One GPU, a job on it for 1 h more. The head wants the whole GPU: it starts in 1 h. A small job of
    30 min may use the room now (it ends before); one of 2 h may not (it would delay the head); one without a
    time limit neither."""
    gpus = one_gpu()
    gpus = gpus.with_job("run", gpus.place(Request(1, 20 * GIB)), exclusive=False)
    running = [Running("run", 0, 0.0, 1, time_limit_s=3600.0)]
    head = Waiting("head", 0, 10, 0.0, Request(1))
    short = Waiting("short", 1, 0, 1.0, Request(1, 10 * GIB), time_limit_s=1800.0)
    long = Waiting("long", 1, 0, 2.0, Request(1, 10 * GIB), time_limit_s=7200.0)
    endless = Waiting("endless", 1, 0, 3.0, Request(1, 10 * GIB))
    decision = decide([head, short, long, endless], running, gpus, now=0.0)
    assert [job.id for job, _ in decision.starts] == ["short"]
    assert "GPU 0 runs job run" in decision.waiting["head"]
    assert decision.waiting["long"] == decision.waiting["endless"] == "backfill would delay job head, first in line"
    # without the head, all three fit beside the running job (20 + 3 x 10 GiB)
    assert len(decide([short, long, endless], running, gpus, now=0.0).starts) == 3


def test_backfill_may_run_past_the_shadow_where_the_head_still_fits() -> None:
    """The head wants 50 GiB once the running 40 GiB job ends; a 10 GiB job without a limit may start now:
    at the head's start there is room for both (80 - 10 - 50)."""
    gpus = one_gpu()
    gpus = gpus.with_job("run", gpus.place(Request(1, 40 * GIB)), exclusive=False)
    running = [Running("run", 0, 0.0, 1, time_limit_s=3600.0)]
    head = Waiting("head", 0, 10, 0.0, Request(1, 50 * GIB))
    small = Waiting("small", 1, 0, 1.0, Request(1, 10 * GIB))
    big = Waiting("big", 1, 0, 2.0, Request(1, 25 * GIB))
    decision = decide([head, small, big], running, gpus, now=0.0)
    assert [job.id for job, _ in decision.starts] == ["small"]
    assert "delay job head" in decision.waiting["big"]


def test_per_user_limits() -> None:
    gpus = devices(eight_gpu_server("h100"))
    jobs = [Waiting(str(i), 7, 0, float(i), Request(1, GIB)) for i in range(4)]
    decision = decide(jobs, [], gpus, now=10.0, limits=Limits(jobs_per_user=2))
    assert len(decision.starts) == 2 and decision.waiting["2"] == "its user runs 2 jobs, the limit"
    decision = decide(jobs, [Running("r", 7, 0.0, 3)], gpus, now=10.0, limits=Limits(gpus_per_user=4))
    assert len(decision.starts) == 1 and "holds 4 GPUs of a limit of 4" in decision.waiting["1"]


def mig_gpu() -> FakeNvml:
    """GPU 0 in MIG mode with a 3g.40gb and a 1g.10gb instance (slot 1 empty), the first running a process the
    queue did not start; GPU 1 a whole H100."""

    def instance(uuid: str, profile: str, mib: int, **fields) -> object:
        return h100_sxm(0, uuid=uuid, name=f"NVIDIA H100 80GB HBM3 MIG {profile}", memory_total_mib=mib, **fields)

    gpu = h100_sxm(0, mig=True)
    busy = instance("MIG-big", "3g.40gb", 40 * 1024, memory_used_mib=4096, processes=[FakeProcess(99, 4 * GIB)])
    gpu.mig_devices = [busy, None, instance("MIG-small", "1g.10gb", 10 * 1024)]
    return FakeNvml([gpu, h100_sxm(1)])


def test_mig_instances_are_devices_of_their_own() -> None:
    """A GPU in MIG mode is its instances: each placed by its own memory and processes, named by its MIG UUID;
    a whole-device job may take the empty one; a job of two devices takes no MIG instance (a CUDA process sees
    one at most)."""
    gpus = devices(mig_gpu())
    assert [(s.uuid, s.label, s.total_bytes) for s in gpus.slots] == [
        ("MIG-big", "GPU 0 MIG 3g.40gb", 40 * GIB),
        ("MIG-small", "GPU 0 MIG 1g.10gb", 10 * GIB),
        (gpus.slots[2].uuid, "GPU 1", 81559 * MIB),  # an H100 80GB: 81,559 MiB
    ]
    assert gpus.slots[0].foreign == ((99, 4 * GIB),)
    assert gpus.place(Request(1, 8 * GIB)).uuids == ("MIG-small",)  # pack: the tightest fit
    assert gpus.place(Request(1, 30 * GIB)).uuids == ("MIG-big",)  # 36 GiB free there
    assert gpus.place(Request(1, 38 * GIB)).uuids == (gpus.slots[2].uuid,)
    assert gpus.place(Request(1)).uuids == ("MIG-small",)  # whole: the instance without a foreign process
    two = gpus.place(Request(2, 1 * GIB))
    assert isinstance(two, str) and "GPU 0 MIG 3g.40gb is a MIG instance, and a CUDA process sees one at most" in two
