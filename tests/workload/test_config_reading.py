"""A Hugging Face config.json is read one way whatever is installed, and its model is named from the config.

Traced through transformers unless ``--analytic`` asks for the formulas (or the layout is T5's, which is not
traced): without transformers, or without PyTorch, a config to trace is refused in one line, never planned by
the formulas instead. The two readings differ for the same file (Hugging Face's eager code saves more for
backward than the formulas count), so a silent fallback planned the same file differently on another machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from builders import TINY_LLAMA
from redline.errors import BadInput
from redline.units import fmt_count
from redline.workload.load import config_model_name, load_workload


def write_config(folder: Path, config: dict[str, Any]) -> Path:
    """``config`` as ``folder``/config.json, the folder named like a user's project (nothing like the model)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def without(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``package`` look uninstalled for the rest of the test (an import of it fails, a probe finds none)."""
    monkeypatch.setitem(sys.modules, package, None)


def test_a_config_to_trace_is_refused_without_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path / "my-project", TINY_LLAMA)
    without(monkeypatch, "transformers")
    with pytest.raises(BadInput) as known:
        load_workload(str(path))
    assert str(known.value) == (
        f"{path} is a Hugging Face model config; reading it needs transformers "
        "(the hf extra: pip install transformers), or --analytic for the transformer formulas"
    )
    # a layout with no formula offers none; a model folder is named by its config file
    unknown = write_config(tmp_path / "other", {"model_type": "mixtral", "hidden_size": 64})
    with pytest.raises(BadInput, match=r"other/config\.json is a Hugging Face model config; .*transformers\)$"):
        load_workload(str(unknown.parent))


def test_a_config_to_trace_is_refused_without_pytorch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path, TINY_LLAMA)
    without(monkeypatch, "torch")
    with pytest.raises(BadInput, match="needs PyTorch"):
        load_workload(str(path))


def test_the_formulas_read_a_config_alike_with_or_without_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_config(tmp_path, TINY_LLAMA)
    with_it = load_workload(str(path), analytic=True)
    without(monkeypatch, "transformers")
    assert load_workload(str(path), analytic=True) == with_it
    assert with_it.method == "analytic"


def test_t5_is_read_by_its_formula_either_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """T5 is not traced (it needs decoder inputs): its reading never depended on transformers, and still does not."""
    t5 = {"model_type": "t5", "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4}
    path = write_config(tmp_path, t5 | {"vocab_size": 1000})
    with_it = load_workload(str(path))
    without(monkeypatch, "transformers")
    assert load_workload(str(path)) == with_it


def test_a_config_is_named_after_its_model_never_its_folder(tmp_path: Path) -> None:
    """By formula here; ``tests/plan/test_plan_config_json.py`` traces one and reads the name wherever it shows."""
    profile = load_workload(str(write_config(tmp_path / "my-project", TINY_LLAMA)), analytic=True)
    assert profile.name == f"llama {fmt_count(profile.params_total)}"
    saved = write_config(tmp_path / "checkpoints", TINY_LLAMA | {"_name_or_path": "TinyLlama/TinyLlama-1.1B"})
    assert load_workload(str(saved.parent), analytic=True).name == "TinyLlama/TinyLlama-1.1B"


@pytest.mark.parametrize(
    ("config", "name"),
    [
        ({"model_type": "gpt2", "_name_or_path": "openai-community/gpt2"}, "openai-community/gpt2"),
        ({"model_type": "gpt2", "_name_or_path": " "}, "gpt2 124M"),  # blank: what a fresh config writes
        ({"model_type": "bert", "_name_or_path": None}, "bert 124M"),
        ({"model_type": "llama"}, "llama 124M"),
    ],
)
def test_config_model_name(config: dict[str, Any], name: str) -> None:
    assert config_model_name(config, 124_439_808) == name
