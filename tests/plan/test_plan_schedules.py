"""The pipeline schedules' bubble, in-flight activations and point-to-point traffic, against their formulas
(Narayanan et al. 2021, section 2.2; Korthikanti et al. 2022, section 4.2.3; Megatron-LM's interleaved warm-up)."""

from __future__ import annotations

import pytest

from redline.plan.hardware import parse_hardware
from redline.plan.memory import in_flight_micro_batches, stage_memory, stages
from redline.plan.steptime import bubble_slots, step_time
from redline.plan.strategy import Strategy
from redline.workload.presets import preset_profile

LLAMA7 = preset_profile("llama-2-7b")
H100X8 = parse_hardware("8xh100-sxm")


def piped(schedule: str, p: int, m: int, v: int = 1) -> Strategy:
    return Strategy(pipeline=p, accumulation=m, schedule=schedule, virtual_stages=v)


# (schedule, p, m, v): the bubble as a fraction of the ideal m slots, (p - 1)/m or (p - 1)/(v m)
BUBBLES = [
    ("gpipe", 4, 16, 1, 3 / 16),
    ("1f1b", 4, 16, 1, 3 / 16),
    ("1f1b", 8, 8, 1, 7 / 8),
    ("interleaved", 4, 16, 2, 3 / 32),
    ("interleaved", 8, 64, 3, 7 / 192),
    ("interleaved", 35, 280, 3, 34 / 840),
]


@pytest.mark.parametrize(("schedule", "p", "m", "v", "fraction"), BUBBLES)
def test_the_bubble_is_the_papers_fraction(schedule: str, p: int, m: int, v: int, fraction: float) -> None:
    assert bubble_slots(piped(schedule, p, m, v)) / m == pytest.approx(fraction, rel=1e-12)


# (schedule, p, m, v, stage, in flight): micro-batches of the stage's layers whose activations wait for a backward
IN_FLIGHT = [
    ("gpipe", 4, 16, 1, 0, 16),  # all of them, on every stage
    ("gpipe", 4, 16, 1, 3, 16),
    ("1f1b", 4, 16, 1, 0, 4),  # p - i
    ("1f1b", 4, 16, 1, 3, 1),
    ("1f1b", 8, 4, 1, 0, 4),  # no more than there are
    ("interleaved", 4, 16, 2, 0, 4 * (1 + 3 / 8)),  # p (1 + (p - 1)/(p v)), Korthikanti et al.
    ("interleaved", 8, 64, 4, 0, 8 * (1 + 7 / 32)),
    ("interleaved", 4, 16, 2, 3, 2.5),  # ((v - 1) p + 1)/v on the last stage
    ("interleaved", 4, 2, 2, 0, 2),
]


@pytest.mark.parametrize(("schedule", "p", "m", "v", "stage", "expected"), IN_FLIGHT)
def test_activations_in_flight_per_schedule(schedule: str, p: int, m: int, v: int, stage: int, expected: float) -> None:
    assert in_flight_micro_batches(piped(schedule, p, m, v), stage) == pytest.approx(expected, rel=1e-12)


def test_no_pipeline_holds_one_micro_batch() -> None:
    assert in_flight_micro_batches(Strategy(accumulation=8), 0) == 1


def test_the_schedules_step_times_differ_by_their_bubbles_and_sends() -> None:
    base = {"data": 2, "pipeline": 4, "accumulation": 16}
    one_f = step_time(LLAMA7, Strategy(**base), H100X8)
    gpipe = step_time(LLAMA7, Strategy(**base, schedule="gpipe"), H100X8)
    inter = step_time(LLAMA7, Strategy(**base, schedule="interleaved", virtual_stages=2), H100X8)
    assert gpipe.total == pytest.approx(one_f.total)
    assert inter.bubble == pytest.approx(one_f.bubble / 2)
    # v m + p - 1 sends each way instead of m + p - 1
    assert inter.pipeline_comm / one_f.pipeline_comm == pytest.approx((2 * 16 + 3) / (16 + 3), rel=1e-9)
    assert inter.compute == one_f.compute


def test_gpipe_holds_every_micro_batch_and_interleaving_a_little_more_than_1f1b() -> None:
    base = {"data": 2, "pipeline": 4, "accumulation": 16}

    def first_stage(**fields):
        strategy = Strategy(**base, **fields)
        return stage_memory(LLAMA7, strategy, stages(LLAMA7, 4)[0], gpus_per_node=8)

    one_f, gpipe = first_stage(), first_stage(schedule="gpipe")
    inter = first_stage(schedule="interleaved", virtual_stages=2)
    # 1F1B: 4 micro-batches in flight, and the first one's output, which its send's handle holds to the cool-down;
    # bf16 (FSDP2 over the data ranks keeps a bf16 residual stream), half the profile's autocast figure
    output = LLAMA7.blocks[7].input_bytes_per_sample["16bit"] / 2
    per_micro_batch = (one_f.activations - output) / 4
    assert gpipe.activations == pytest.approx(16 * per_micro_batch)
    # each chunk of an interleaved rank holds its own output for each micro-batch in flight (PyTorch's schedule
    # keeps a stage's outputs to their backward): two per stage's worth with v = 2, one under 1F1B; and to the
    # step's end every output it sent (the send handles) and its second chunk's 16 receive buffers
    saved = per_micro_batch - output
    in_flight = 4 * (1 + 3 / 8)
    held = 16 * output + 2 * (16 - in_flight) * output
    assert inter.activations == pytest.approx(in_flight * (saved + 2 * output) + held)
