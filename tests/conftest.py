"""Shared test helpers. tests/ is on sys.path (pyproject: pythonpath), so fixtures import by plain name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

# `redline ARGS` as a user runs it: run_cli forks each command from a process that has imported the CLI and
# PyTorch; run_executable starts the installed entry point (cli_fork says when each is the one to use)
from cli_fork import cli as run_cli
from cli_fork import executable as run_executable  # noqa: F401 (the tests import it from here)

FIXTURES = Path(__file__).parent / "fixtures"

# fixtures of their own modules: a queue folder per test (``queue``), a second Unix user (``other_user``)
pytest_plugins = ("queue_daemons", "unix_users")


def _no_gpu_reason() -> str | None:
    """Why the tests marked ``gpu`` cannot run here; None on a machine with an NVIDIA GPU PyTorch can use."""
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi: not a GPU machine"
    import torch

    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


# fixtures that make a test a system one wherever it is: a second Unix user
SYSTEM_FIXTURES = frozenset({"other_user", "stranger"})


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests taking a second Unix user are marked ``system`` (modules of real servers mark themselves). Every
    test marked ``gpu`` is skipped, with the reason, where there is no GPU: one rule for all of them. Each test
    gets its pytest-xdist group (see ``_worker_group``); on a worker the long tests come first."""
    for item in items:
        if SYSTEM_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.system)
        group = _worker_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the long tests first, so that no worker ends
        items.sort(key=lambda item: not (item.get_closest_marker("slow") or item.get_closest_marker("ranks")))
    marked = [item for item in items if item.get_closest_marker("gpu")]
    reason = _no_gpu_reason() if marked else None
    for item in marked if reason else []:
        item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}"))


def _worker_group(item: pytest.Item) -> str | None:
    """Which tests `pytest -n 2` (``--dist loadgroup``) keeps on one worker, one after another.

    System tests are one group: they share what a machine has once (Slurm's and Ray's clusters, namespaces,
    Unix users, mounts, the CPU a throughput is measured on), so they never run beside each other. A test that
    uses a module-scoped fixture runs on its module's worker, so the fixture is built once. Every other test
    goes to whichever worker is free."""
    if item.get_closest_marker("system"):
        return "system"
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.values() if info else ()
    if any(d.scope in ("module", "class") for defs in definitions for d in defs):
        return item.nodeid.split("::")[0]
    return None


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def measured_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A REDLINE_HOME with this machine's ceilings measured, as `redline bench --save` leaves them: what planning
    for a CPU (`--hardware local`) needs."""
    home = tmp_path_factory.mktemp("home")
    result = run_cli("bench", "compute", "memory", "--save", "--quick", env={"REDLINE_HOME": str(home)}, timeout=300)
    assert result.returncode == 0, result.stderr
    return home
