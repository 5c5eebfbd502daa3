"""`redline plan -m config.json`: one reading of the file whatever is installed, the model named from the config.

The traced reading needs transformers; without it the command refuses in one line and names the ``hf`` extra,
where it used to plan the same file by the formulas (a different best plan: 8.6 against 44.9 GiB in the
issue). The model was named after the folder the command ran in; it is named from the config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from builders import TINY_LLAMA
from conftest import run_cli, run_executable
from redline.plan.planfile import load_plan
from redline.units import fmt_count


def project(tmp_path: Path) -> Path:
    """A user's project folder holding the config, its name nothing like the model's."""
    folder = tmp_path / "my-project"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return folder


def test_without_transformers_a_config_is_refused_in_one_line_never_planned_by_formula(tmp_path: Path) -> None:
    """A new interpreter, in which transformers cannot be imported (as where it is not installed)."""
    folder = project(tmp_path)
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\n\nsys.modules['transformers'] = None\n")
    path = os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")]))
    args = ("plan", "-m", "config.json", "--hardware", "1xh100-sxm")
    result = run_executable(*args, env={"PYTHONPATH": path}, cwd=folder, timeout=120)
    assert result.returncode == 2, result.stdout
    assert result.stdout == ""
    assert result.stderr == (
        "redline: config.json is a Hugging Face model config; reading it needs transformers "
        "(the hf extra: pip install transformers), or --analytic for the transformer formulas\n"
    )
    # the formulas, asked for, need nothing more and say which reading they are
    analytic = run_executable(*args, "--analytic", "--json", env={"PYTHONPATH": path}, cwd=folder, timeout=120)
    assert analytic.returncode == 0, analytic.stderr
    assert json.loads(analytic.stdout)["plan"]["model"]["method"] == "analytic"


@pytest.mark.slow  # traces the model through transformers
def test_the_model_is_named_from_its_config_in_the_output_the_plan_file_and_the_json(tmp_path: Path) -> None:
    folder = project(tmp_path)
    out = tmp_path / "plan.yaml"
    args = ("plan", "-m", "config.json", "--hardware", "1xh100-sxm")
    text = run_cli(*args, "-o", str(out), cwd=folder)
    assert text.returncode == 0, text.stderr
    plan = load_plan(out)
    name = f"llama {fmt_count(plan.model['params'])}"
    assert (plan.model["name"], plan.model["method"]) == (name, "traced")
    assert f"model     {name} (traced, config config.json, transformers " in text.stdout
    as_json = run_cli(*args, "--analytic", "--json", cwd=folder)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["plan"]["model"]["name"] == name  # the formulas count the same parameters
    assert "my-project" not in text.stdout  # (the plan file's model.load keeps the config's whole path)
