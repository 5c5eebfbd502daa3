"""The model SPEC grammar: a preset, then a config.json path, then package.module:factory, and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from redline.errors import BadInput
from redline.workload.model_spec import ModelKind, ModelSpec, parse_factory, parse_model_spec
from redline.workload.presets import PRESET_NAMES


@pytest.mark.parametrize("text", ["gpt2", "GPT2", "  llama-2-7b ", "resnet50", "ViT-B-16"])
def test_a_preset_is_its_name_in_any_case(text: str) -> None:
    assert parse_model_spec(text) == ModelSpec(ModelKind.PRESET, text.strip(), preset=text.strip().lower())


def test_a_config_is_a_json_path_even_before_it_exists(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "config.json"
    assert parse_model_spec(str(missing)) == ModelSpec(ModelKind.CONFIG, str(missing), path=missing)


def test_a_config_is_any_file_or_folder_that_exists(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "weights.cfg").write_text("{}")
    assert parse_model_spec(str(tmp_path / "model")).path == tmp_path / "model"
    assert parse_model_spec(str(tmp_path / "weights.cfg")).kind is ModelKind.CONFIG


def test_a_config_path_has_its_home_expanded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_model_spec("~/config.json").path == tmp_path / "config.json"


def test_a_path_comes_before_a_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented order: a file named like a factory is that file, and so is a .json name with a colon."""
    monkeypatch.chdir(tmp_path)
    Path("mypkg.models:build").write_text("{}")
    assert parse_model_spec("mypkg.models:build").kind is ModelKind.CONFIG
    assert parse_model_spec("other.models:config.json").kind is ModelKind.CONFIG


def test_a_factory_is_a_module_and_a_dotted_callable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_model_spec(" mypkg.models:build ") == ModelSpec(
        ModelKind.FACTORY, "mypkg.models:build", module="mypkg.models", factory="build"
    )
    assert parse_model_spec("zoo:Nets.small").factory == "Nets.small"
    assert parse_factory("zoo:build") == parse_model_spec("zoo:build")


@pytest.mark.parametrize("text", ["gpt5", "", "   ", "no-such-model"])
def test_neither_form_names_the_three(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # "" would be the current folder were it taken as a path
    with pytest.raises(BadInput) as caught:
        parse_model_spec(text)
    assert str(caught.value) == (
        f"unknown model '{text}': not a preset ({', '.join(PRESET_NAMES)}), not a config.json path, "
        "not package.module:factory"
    )


@pytest.mark.parametrize("text", ["a.b:", ":build", "my-pkg:build", "pkg:build()", "a:b:c", "1pkg:build"])
def test_a_colon_that_is_no_factory_is_a_bad_factory_spec(
    text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInput) as caught:
        parse_model_spec(text)
    assert str(caught.value) == f"bad factory spec '{text}': expected package.module:callable, e.g. mypkg.models:build"


def test_an_artifacts_factory_is_never_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("mypkg:build").write_text("{}")
    assert parse_factory("mypkg:build").kind is ModelKind.FACTORY
    with pytest.raises(BadInput, match=r"^bad factory spec 'gpt2'"):
        parse_factory("gpt2")
