"""The Porting page's four ports (issue 42, item 9): a loop for one process, a DDP script, an Accelerate script
and a Lightning Fabric script (``examples/porting/*_before.py``), each ported to ``redline.prepare``
(``*_after.py``). The page shows each diff as it is; each port changes few lines; each runs on 1 and 2 ranks
under DDP and FSDP2 plans and ends at the original's validation loss."""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from ports import free_port
from ranks import script_pythonpath
from redline.plan.planfile import Plan, dump_plan
from redline.plan.strategy import Strategy

ROOT = Path(__file__).parents[2]
PORTS = ROOT / "examples" / "porting"
PAGE = ROOT / "docs" / "porting.md"
# lines each port adds or rewrites (re-indented lines not counted), as the page says
CHANGED = {"plain": 14, "ddp": 15, "accelerate": 19, "fabric": 14}
# per port: the original's batch per process, and the micro-batches in each (its gradient accumulation)
BATCH = {"plain": (32, 1), "ddp": (16, 1), "accelerate": (16, 2), "fabric": (16, 1)}
# the DDP port sees the original's batches in its order; the others draw another shuffle than the original (one
# order for every rank, from the process's seed), so their last validation loss is compared within 5%
TOLERANCE = {"plain": 0.05, "ddp": 1e-4, "accelerate": 0.05, "fabric": 0.05}


def changed_lines(before: list[str], after: list[str]) -> list[str]:
    """The port's lines that are not the original's, whitespace aside (a re-indented line is the same)."""
    diff = difflib.ndiff([line.strip() for line in before], [line.strip() for line in after])
    return [line[2:] for line in diff if line.startswith("+ ")]


def page_diff(port: str) -> str:
    """The unified diff the page shows for ``port`` (``diff -u`` of the two files, without its header)."""
    before = (PORTS / f"{port}_before.py").read_text().splitlines()
    after = (PORTS / f"{port}_after.py").read_text().splitlines()
    lines = difflib.unified_diff(before, after, lineterm="", n=2)
    return "\n".join(line for line in lines if not line.startswith(("---", "+++")))


@pytest.mark.parametrize("port", sorted(CHANGED))
def test_the_page_shows_each_port_as_it_is_and_it_changes_few_lines(port: str) -> None:
    before = (PORTS / f"{port}_before.py").read_text().splitlines()
    after = (PORTS / f"{port}_after.py").read_text().splitlines()
    assert len(changed_lines(before, after)) == CHANGED[port]
    page = PAGE.read_text()
    assert f"```diff\n{page_diff(port)}\n```" in page, f"docs/porting.md: the {port} diff is not the files' diff"
    assert f"{CHANGED[port]} changed lines" in page


def val_loss(output: str) -> float:
    """The last epoch's validation loss the script printed."""
    found = re.findall(r"^epoch 2 loss \S+ val_loss (\S+)$", output, re.MULTILINE)
    assert len(found) == 1, output[-3000:]
    return float(found[0])


def original(port: str, processes: int, cwd: Path) -> float:
    """The original script as its users launch it: plain python, torchrun (DDP, Accelerate), ``fabric run``."""
    script = str(PORTS / f"{port}_before.py")
    if port == "fabric" and processes > 1:
        # `fabric run` hands torchrun --master-port 29400 unless told: a test on the other worker may hold it
        argv = ["fabric", "run", "--accelerator", "cpu", "--devices", str(processes)]
        argv += ["--main-port", str(free_port()), script]
    elif port in ("ddp", "accelerate"):
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(processes),
            script,
        ]
    else:
        argv = [sys.executable, script]
    cwd.mkdir(parents=True)
    # Accelerate goes multi-process on CPUs only when told to, as `accelerate launch --cpu` tells it
    env = os.environ | {"ACCELERATE_USE_CPU": "1"}
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-8000:]
    return val_loss(done.stdout)


def plan_file(path: Path, *, ranks: int, micro_batch: int, accumulation: int, sharding: str) -> Path:
    """A plan of this strategy for the CPU (what ``redline plan -o`` writes, its predictions left out)."""
    strategy = Strategy(
        data=ranks, micro_batch=micro_batch, accumulation=accumulation, sharding=sharding, precision="fp32"
    )
    plan = Plan(strategy=strategy, model={}, hardware={"accelerator": "cpu"}, goal={}, predicted={})
    path.write_text(dump_plan(plan))
    return path


def port(name: str, ranks: int, sharding: str, cwd: Path) -> float:
    """The port through ``redline run --plan``, the plan's batch the original's on as many processes."""
    cwd.mkdir(parents=True)
    micro_batch, accumulation = BATCH[name]
    if name == "plain":  # one process's batch, shared out over the ranks
        micro_batch //= ranks
    plan = plan_file(
        cwd / "plan.yaml", ranks=ranks, micro_batch=micro_batch, accumulation=accumulation, sharding=sharding
    )
    argv = ("run", "--plan", str(plan), "--nproc-per-node", str(ranks), str(PORTS / f"{name}_after.py"))
    result = run_cli(*argv, env={"PYTHONPATH": script_pythonpath()}, cwd=cwd, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (cwd / "model.pt").exists()  # rank 0 saved the whole model
    return val_loss(result.stdout)


@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CHANGED))
def test_each_port_runs_on_1_and_2_ranks_under_ddp_and_fsdp2_and_ends_at_the_originals_loss(
    tmp_path: Path, name: str
) -> None:
    originals = {processes: original(name, processes, tmp_path / f"original-{processes}") for processes in (1, 2)}
    for ranks, sharding in ((1, "ddp"), (2, "ddp"), (2, "fsdp")):
        got = port(name, ranks, sharding, tmp_path / f"port-{ranks}-{sharding}")
        expected = originals[1 if name == "plain" else ranks]  # a loop for one process has no run on two
        assert got == pytest.approx(expected, rel=TOLERANCE[name]), (ranks, sharding)
