"""The pipeline schedules' bubble, in-flight activations and point-to-point traffic, against their formulas
(Narayanan et al. 2021, section 2.2; Korthikanti et al. 2022, section 4.2.3; Megatron-LM's interleaved warm-up)."""

from __future__ import annotations

import pytest

from redline.plan.hardware import parse_hardware
from redline.plan.memory import in_flight_micro_batches, memory_per_gpu, stage_memory, stages
from redline.plan.steptime import bubble_slots, step_time
from redline.plan.strategy import Strategy
from redline.workload.presets import preset_profile
from redline.workload.profile import TransformerShape
from redline.workload.transformer import transformer_profile

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
    # what every schedule holds once: the gradient of the output received for the backward that runs, the element
    # the dropped outputs share (the step's inputs are a few token ids: left out with the embedding's); bf16 (FSDP2
    # over the data ranks keeps a bf16 residual stream), half the profile's autocast figure
    output = LLAMA7.blocks[7].input_bytes_per_sample["16bit"] / 2
    once = output + 4
    # 1F1B: 4 micro-batches in flight, and two outputs whose sends' handles the schedule still holds (the latest
    # forward's, the last warm-up send's)
    ids = LLAMA7.layers[0].input_bytes_per_sample.get("16bit", 0.0)
    per_micro_batch = (one_f.activations - once - 2 * output - 12 * ids) / 4
    # GPipe: all 16, and every output but the first, whose send's handle it keeps until the forwards are done
    assert gpipe.activations == pytest.approx(16 * per_micro_batch + once + 15 * output)
    # interleaved: each of its 2 chunks holds its own output for each micro-batch in flight, but the one whose
    # backward begins (the schedule keeps every send's handle to the step's end), and the next forward's receive
    in_flight = 4 * (1 + 3 / 8)
    embedding = LLAMA7.layers[0]
    assert embedding.name not in {block.name for block in LLAMA7.blocks}
    held_embedding = (min(16, 2 * in_flight) - in_flight) * embedding.activation_bytes_per_sample["16bit"]
    waiting = (16 - min(16, 2 * in_flight)) * ids
    held = once + (2 * in_flight - 1) * output + output + held_embedding + waiting
    assert inter.activations == pytest.approx(in_flight * per_micro_batch + held)


def with_vocab(vocab: int) -> object:
    shape = TransformerShape(layers=8, hidden=1024, heads=16, ffn_hidden=4096, vocab=vocab, seq_len=2048)
    return transformer_profile(shape, name=f"vocab {vocab}", source="test")


@pytest.mark.parametrize(
    ("schedule", "virtual", "head_micro_batches"), [("1f1b", 1, 1), ("interleaved", 2, 1), ("gpipe", 1, 16)]
)
def test_the_lm_head_is_counted_once_on_the_last_stage_but_under_gpipe(
    schedule: str, virtual: int, head_micro_batches: int
) -> None:
    """The last stage's activations grow with the vocabulary by one micro-batch's head and loss: the model's last
    chunk runs each micro-batch's backward right after its forward under 1F1B and interleaved 1F1B (whose last
    rank holds 2.5 stages' worth of its blocks), every forward before any backward under GPipe."""
    strategy = Strategy(pipeline=4, accumulation=16, schedule=schedule, virtual_stages=virtual)

    def last_stage_activations(vocab: int) -> float:
        profile = with_vocab(vocab)
        return stage_memory(profile, strategy, stages(profile, 4)[-1], gpus_per_node=8).activations

    small, big = with_vocab(32_000), with_vocab(256_000)
    head_growth = sum(b.activation_bytes_per_sample["16bit"] for b in big.layers if not b.is_block) - sum(
        s.activation_bytes_per_sample["16bit"] for s in small.layers if not s.is_block
    )
    growth = last_stage_activations(256_000) - last_stage_activations(32_000)
    assert head_growth > 0
    assert growth == pytest.approx(head_micro_batches * head_growth)


def test_a_middle_stage_holding_one_block_more_than_the_first_counts_when_it_is_the_busiest() -> None:
    """7 blocks on 4 stages go 1, 2, 2, 2: stage 1 keeps 3 micro-batches of 2 blocks, the first 4 of 1, and with a
    small vocabulary the last stage's head is light, so stage 1 is the busiest and the plan must say its figure."""
    shape = TransformerShape(
        layers=7,
        hidden=4096,
        heads=32,
        ffn_hidden=16384,
        vocab=1024,
        seq_len=4096,
        dropout=False,
        bias=False,
        norm="rmsnorm",
        tied_embeddings=False,
    )
    profile = transformer_profile(shape, name="seven blocks", source="test")
    strategy = Strategy(pipeline=4, micro_batch=1, accumulation=8, precision="bf16", sharding="ddp")
    split = stages(profile, 4)
    assert [len(stage.blocks) for stage in split] == [1, 2, 2, 2]
    each = [stage_memory(profile, strategy, stage, gpus_per_node=8).device_total for stage in split]
    assert max(each) == each[1] > max(each[0], each[-1])
    assert memory_per_gpu(profile, strategy, 8).device_total == each[1]
