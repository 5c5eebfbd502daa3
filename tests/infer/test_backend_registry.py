"""The registry of inference backends (``infer.backends.BACKENDS``): each backend registered with the traits the
measurement and the artifact read (an exported graph or not, a batch size it pins, how its artifact loads), and a
backend this redline does not know refused in the one line ``--backends`` has always given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from redline.errors import BadInput
from redline.infer import artifact
from redline.infer.backends import BACKENDS, REFERENCE, named
from redline.infer.measure import selected

KNOWN = "eager, compile, compile-max-autotune, export-aoti, onnxruntime, onnxruntime-trt, tensorrt, int8-dynamic"


@pytest.mark.parametrize(
    ("name", "exported", "pinned", "one_shape", "default_on_cpu", "fixed_precision"),
    [
        ("eager", False, False, False, True, None),
        ("compile", False, False, False, True, None),
        ("compile-max-autotune", False, False, False, False, None),
        ("export-aoti", True, False, True, True, None),
        ("onnxruntime", True, False, True, True, None),
        ("onnxruntime-trt", True, True, True, True, None),
        ("tensorrt", False, True, True, True, None),
        ("int8-dynamic", False, False, False, True, "int8"),
    ],
)
def test_each_backend_is_registered_with_its_traits(
    name: str, exported: bool, pinned: bool, one_shape: bool, default_on_cpu: bool, fixed_precision: str | None
) -> None:
    backend = BACKENDS[name]
    assert backend.name == name
    assert (backend.exported, backend.pinned_batch is not None, backend.one_shape) == (exported, pinned, one_shape)
    assert (backend.default_on_cpu, backend.fixed_precision) == (default_on_cpu, fixed_precision)


def test_the_registry_holds_the_backends_in_the_order_they_are_listed_and_measured() -> None:
    assert ", ".join(BACKENDS) == KNOWN
    assert REFERENCE in BACKENDS and not BACKENDS[REFERENCE].one_shape


def test_an_unknown_backend_is_the_one_line_it_has_always_been() -> None:
    with pytest.raises(BadInput) as caught:
        named(["compile", "warp", "turbo"])
    assert str(caught.value) == f"unknown backend(s) warp, turbo; known: {KNOWN}"
    with pytest.raises(BadInput) as again:
        selected(["warp"], "cpu")
    assert str(again.value) == f"unknown backend(s) warp; known: {KNOWN}"


def test_the_reference_is_measured_first_and_each_backend_once() -> None:
    assert [b.name for b in selected(["compile", "compile"], "cpu")] == ["eager", "compile"]
    assert [b.name for b in selected(["compile", "eager"], "cpu")] == ["compile", "eager"]
    assert "compile-max-autotune" not in [b.name for b in selected(None, "cpu")]  # opt-in on a CPU
    assert [b.name for b in selected(None, "cuda")] == list(BACKENDS)


def test_an_aot_inductor_artifact_loads_on_the_device_it_was_compiled_for_only(tmp_path: Path) -> None:
    with pytest.raises(BadInput) as caught:
        BACKENDS["export-aoti"].load_graph(tmp_path / "model.pt2", "cuda", "cpu")
    assert str(caught.value) == f"{tmp_path}: an AOTInductor package compiled for cuda, not cpu"


def test_an_artifact_of_a_backend_this_redline_lacks_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / artifact.MANIFEST).write_text(json.dumps({"format": artifact.FORMAT, "backend": "warp"}))
    with pytest.raises(BadInput) as caught:
        artifact.read_manifest(tmp_path)
    assert str(caught.value) == f"{tmp_path}: an artifact of backend 'warp', which this redline lacks"
