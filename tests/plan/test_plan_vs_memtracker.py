"""The planner's peak memory against PyTorch's own accounting of a real training step.

``torch.distributed._tools.mem_tracker.MemTracker`` follows every tensor of one forward, backward and fused
Adam step (run on fake tensors by the tracer, micro-batch 1, fp32). The planner must land within the
issue's target: at most 5% over, never more than 3% under. The GPU check compares with
``torch.cuda.max_memory_allocated`` on real hardware the same way.
"""

from __future__ import annotations

import json

import pytest

from redline.plan.memory import memory_per_gpu
from redline.plan.strategy import Strategy
from redline.workload.load import load_workload
from redline.workload.presets import preset_profile


def check(profile) -> float:
    if profile.traced_peak_bytes is None:
        pytest.skip("MemTracker unavailable in this torch: " + "; ".join(profile.notes))
    predicted = memory_per_gpu(profile, Strategy(data=1, precision="fp32", micro_batch=1), 1).allocated
    ratio = predicted / profile.traced_peak_bytes["total"]
    assert 0.97 <= ratio <= 1.05, f"{profile.name}: predicted/MemTracker = {ratio:.3f}"
    return ratio


@pytest.mark.parametrize("name", ["resnet50", "vit-b-16"])
def test_zoo_models(name: str) -> None:
    check(preset_profile(name))


def test_hugging_face_gpt2_from_its_config(tmp_path) -> None:
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}
        )
    )
    profile = load_workload(str(config), seq_len=512)
    assert profile.method == "traced" and profile.transformer is not None
    check(profile)
