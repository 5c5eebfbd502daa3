"""Known third-party noise is kept off stderr (torchao's failed loads, PyTorch's "please file a bug", the ONNX
exporter's "torchvision is not installed"), everything else gets through, and REDLINE_DEBUG=1 shows it all."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import run_cli
from redline.cli import quiet

# each as the library says it (torchao 0.18, torch 2.13), with its arguments
LOGGED = [
    ("torchao", "Failed to load /site-packages/torchao/_C_mxfp8.so: Could not load this library", ()),
    (
        "torch.utils._pytree",
        "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. Calling "
        "register_constant() on Enum subclasses is deprecated and will be an error in a future release.",
        ("<enum 'KernelPreference'>",),
    ),
    ("torch.onnx._internal.exporter._registration", "torchvision is not installed. Skipping %s", ("torchvision::nms",)),
]
WARNED = [
    (
        UserWarning,
        "The module hierarchy tracking maybe be messed up. Please file a bug to PyTorch, if it is the case.",
        "torch.distributed._tools.mod_tracker",
    ),
    (
        FutureWarning,
        "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()`",
        "copyreg",
    ),
]


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def kept() -> Iterator[_Kept]:
    """What reaches a handler on each of the noisy loggers (a handler on the logger itself: torch's loggers do not
    pass their records up to the root's)."""
    handler = _Kept()
    loggers = [logging.getLogger(name) for name, _, _ in LOGGED]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)


def _say_everything() -> list[str]:
    """Log and warn each known noise, and one message of the same loggers and categories that is not noise."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet.third_party_noise_silenced():
            for name, message, args in LOGGED:
                logging.getLogger(name).warning(message, *args)
                logging.getLogger(name).warning("a real problem")
            for category, message, module in WARNED:
                warnings.warn_explicit(message, category, filename=f"{module}.py", lineno=1, module=module)
                warnings.warn_explicit("a real warning", category, filename=f"{module}.py", lineno=2, module=module)
            warnings.warn("redline's own", UserWarning, stacklevel=1)
    return [str(w.message) for w in caught]


def test_known_noise_is_dropped_and_nothing_else(kept: _Kept, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDLINE_DEBUG", raising=False)
    warned = _say_everything()
    assert kept.messages == ["a real problem"] * len(LOGGED)
    assert warned == ["a real warning"] * len(WARNED) + ["redline's own"]


def test_redline_debug_shows_the_noise(kept: _Kept, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDLINE_DEBUG", "1")
    warned = _say_everything()
    assert len(kept.messages) == 2 * len(LOGGED)
    assert "torchvision is not installed. Skipping torchvision::nms" in kept.messages
    assert len(warned) == 2 * len(WARNED) + 1


def test_the_filters_are_gone_after_the_command(kept: _Kept, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's tests run commands in process: one command's filters must not hide another test's messages."""
    monkeypatch.delenv("REDLINE_DEBUG", raising=False)
    _say_everything()
    name, message, args = LOGGED[0]
    logging.getLogger(name).warning(message, *args)
    assert kept.messages[-1] == message


# a Llama config as the plan tests use, small: tracing it makes PyTorch's module tracker warn
LLAMA = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256,
}  # fmt: skip


@pytest.mark.slow
def test_plan_on_a_config_prints_no_third_party_noise_unless_debugging(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    args = ("plan", "-m", str(config), "--hardware", "1xa10g", "--global-batch", "8", "--json")
    quiet_run, debug_run = run_cli(*args), run_cli(*args, env={"REDLINE_DEBUG": "1"})
    assert quiet_run.returncode == 0 and debug_run.returncode == 0, quiet_run.stderr + debug_run.stderr
    assert "Please file a bug to PyTorch" in debug_run.stderr  # the noise is real, and still there to debug
    assert "Please file a bug" not in quiet_run.stderr and "Warning" not in quiet_run.stderr, quiet_run.stderr
