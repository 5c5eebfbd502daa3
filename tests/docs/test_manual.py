"""The manual against the code it describes (issue 43, findings 6 and 14): the README is a front door under 350
lines with a table of contents, its test command is the one CI runs, its Train diff is the example's, every page
is in the site's navigation, and each command's generated reference lists every option its ``--help`` lists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import cli_reference
from conftest import run_cli

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def fenced(text: str, language: str) -> list[str]:
    """The bodies of the ```LANGUAGE blocks of ``text``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


def slug(heading: str) -> str:
    """The anchor GitHub and MkDocs give a heading (lower case, punctuation dropped, spaces to hyphens)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_a_front_door_with_a_table_of_contents() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 350
    headings = {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("## ")}
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    anchors = re.findall(r"\]\(#([\w-]+)\)", contents)
    assert anchors and set(anchors) == headings - {"contents"}, "the table of contents lists every section"
    for section in ("Install", "Quick start", "Train your own loop", "Commands", "Tests"):
        assert f"## {section}\n" in text


def test_the_readme_installs_pytorch_for_a_cpu_machine_and_a_gpu_server() -> None:
    text = README.read_text()
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in text
    assert re.search(r"pip install torch --index-url https://download\.pytorch\.org/whl/cu\d{3}", text)
    for command in ("bench", "run", "tune", "infer"):  # named as needing PyTorch before any quick-start line
        assert f"`{command}`" in text.split("## Install", 1)[1].split("## Quick start", 1)[0]


def test_the_test_command_is_the_one_ci_runs_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index("# The README's test command, verbatim:") + 1]
    assert command.startswith("pip install torch==2.13.0 && pip install -e '.[test]'")
    readme = README.read_text()
    assert f"```bash\n{command}\n```" in readme.split("## Tests", 1)[1], "the README's Tests section shows it"
    assert command not in readme.split("## Tests", 1)[0], "a newcomer's install is not the developer's command"
    assert f"```bash\n{command}\n```" in (DOCS / "testing.md").read_text()
    assert "mkdocs build --strict" in "\n".join(ci[ci.index(command) :])


def example_lines() -> set[str]:
    """examples/train_gpt.py's lines, stripped, without a trailing comment."""
    text = (ROOT / "examples" / "train_gpt.py").read_text()
    return {re.sub(r"\s+#.*$", "", line).strip() for line in text.splitlines()}


@pytest.mark.parametrize("page", ["README.md", "docs/train.md"])
def test_the_train_diff_is_the_example(page: str) -> None:
    diff = fenced((ROOT / page).read_text(), "diff")[0]
    lines = example_lines()
    kept = [line[1:].strip() for line in diff.splitlines() if line[:1] in "+ "]
    missing = [line for line in kept if line and line not in lines]
    assert not missing, f"{page}: lines of its Train diff that examples/train_gpt.py does not have: {missing}"
    assert "run.forward_backward(tokens, targets)" in kept
    assert fenced(README.read_text(), "diff")[0] == diff, "the README and the Train page show one diff"


def nav_pages(entries: list[object]) -> list[str]:
    pages: list[str] = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [str(value)]
    return pages


def test_every_page_is_in_the_navigation_and_every_command_on_a_page() -> None:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = nav_pages(config["nav"])
    assert sorted(pages) == sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    assert config["hooks"] == ["tools/cli_reference.py"] and config["theme"]["font"] == "false"
    marked = {tuple(m.split()) for page in DOCS.rglob("*.md") for m in cli_reference.MARKER.findall(page.read_text())}
    for command in cli_reference.commands():
        if command.path:
            assert any(command.path[: len(key)] == key for key in marked), f"{command.name} is on no page"


def listed_options(help_text: str) -> set[str]:
    """The option names in the first column of ``--help``'s panels (``--model  -m  <str>  ...``)."""
    names: set[str] = set()
    for line in help_text.splitlines():
        first_column = line.strip("│ ").split(" <", 1)[0]
        if first_column.startswith("-"):
            names |= {name for name in re.split(r"[\s/,]+", first_column) if name.startswith("-")}
    return names


COMMANDS = [command for command in cli_reference.commands() if command.path]


@pytest.mark.parametrize("command", COMMANDS, ids=[command.name for command in COMMANDS])
def test_the_generated_reference_lists_every_option_of_the_help(command: cli_reference.Command) -> None:
    result = run_cli(*command.path, "--help", columns=200)
    assert result.returncode == 0, result.stderr
    listed = listed_options(result.stdout)
    assert "--help" in listed
    rendered = cli_reference.render(command)
    assert listed <= cli_reference.option_names(rendered), f"missing from the page: {listed - set(rendered.split())}"
    assert command.usage.split(" [", 1)[0] in rendered and f"`{command.name}`" in rendered
    summary = " ".join(result.stdout.split("╭", 1)[0].split()[1:])  # the usage line and help, as printed
    assert " ".join(command.help.split()) in summary
