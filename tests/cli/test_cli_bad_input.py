"""Bad input to every command gets one line and exit 2, never a traceback: first the cases a fuzz of every
command found (each the same command, its exit code and its message), then a fuzz over every option of every
command that keeps "internal error" and "Traceback" out of the output."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cli_fork import said
from conftest import FIXTURES, run_cli
from ports import free_port


def one_line(result: subprocess.CompletedProcess[str], *needles: str, code: int = 2) -> str:
    assert result.returncode == code, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    lines = said(result.stderr)  # a request that ran past 2 s first says what it was doing
    assert len(lines) == 1 and result.stderr.endswith(lines[0] + "\n"), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def run_python(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -c CODE ARGS`, as run_cli runs redline (no REDLINE_DEBUG, 120 columns)."""
    env = {k: v for k, v in os.environ.items() if k != "REDLINE_DEBUG"} | {"COLUMNS": "120"} | (env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, env=env, timeout=900
    )


# ------------------------------------------------------------------------------------- what the fuzz found


def test_more_ranks_than_the_host_can_run_are_refused_before_any_starts() -> None:
    line = one_line(run_cli("bench", "collective", "--ranks", "100000"), "--ranks 100000", "at most")
    assert "CPU ranks" in line or "GiB" in line


def test_an_empty_precision_is_refused() -> None:
    one_line(run_cli("bench", "compute", "--precision", ""), "--precision takes a comma-separated list")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nonexist:foo", "module 'nonexist' not found"),
        ("garbage", "--dataset takes 'module:factory'"),
        ("os:getcwd", "getcwd() returned a str, not a Dataset"),
    ],
)
def test_a_bad_dataset_is_named_at_once(spec: str, message: str) -> None:
    one_line(run_cli("bench", "dataloader", "--dataset", spec), message)


@pytest.mark.parametrize("args", [["--json", "bogus"], ["--save", "--json", "bogus"]])
def test_an_unknown_suite_is_refused_whatever_the_other_options(args: list[str], tmp_path: Path) -> None:
    one_line(run_cli("bench", *args, env={"REDLINE_HOME": str(tmp_path)}), "unknown bench suite bogus")


def test_a_port_out_of_range_is_bad_input() -> None:
    one_line(run_cli("bench", "network", "--serve", "--port", "99999"), "--port 99999 is not a TCP port")


@pytest.mark.parametrize(
    "args",
    [
        ["--hardware", "8xh100-sxm", "--nodes", "99999999999999999999"],
        ["--cloud", "--max-nodes", "99999999999999999999"],
    ],
)
def test_a_cluster_past_the_largest_known_is_refused(args: list[str]) -> None:
    """The search is linear in the GPU count: 10^20 nodes ran for hours (found by this file's fuzz)."""
    one_line(run_cli("plan", "-m", "gpt2", "--tokens", "1B", *args), "nodes must be", "16384")


def test_calibration_without_pytorch_says_how_to_get_it() -> None:
    result = run_python(
        """
        import sys
        sys.modules["torch"] = None  # as on a machine without PyTorch: `import torch` fails
        from redline.cli.entry import main
        sys.argv = ["redline", *sys.argv[1:]]
        main()
        """,
        *("plan", "-m", "llama-2-7b", "--hardware", "8xh100-sxm", "--calibrate"),
    )
    one_line(result, "--calibrate", "needs PyTorch", "pip install torch")


@pytest.fixture
def as_a_user():
    """A prefix that runs a command as a user without root's power over file permissions (root with its DAC
    capabilities dropped from the bounding set), and a folder that user may not enter."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv (util-linux) to drop the file-permission capabilities")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


@pytest.fixture
def locked(tmp_path: Path):
    folder = tmp_path / "someone-elses"
    folder.mkdir()
    (folder / "secret").write_text("")
    if os.geteuid() == 0:
        os.chown(folder, 65534, 65534)  # nobody's
    folder.chmod(0o700 if os.geteuid() == 0 else 0o000)
    yield folder
    folder.chmod(0o700)


@pytest.mark.parametrize(("option", "name", "message"), [("-o", "x.json", "cannot write"), ("--data", "secret", "")])
def test_a_path_this_user_may_not_touch_is_one_line(as_a_user, locked, option: str, name: str, message: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "REDLINE_DEBUG"}
    target = str(locked / name)
    result = subprocess.run(
        [*as_a_user, sys.executable, "-m", "redline", "probe", option, target],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    one_line(result, target, "Permission denied", message)


# Ctrl-C at a chosen moment: an import hook raises KeyboardInterrupt when the module named is first imported,
# exactly as the signal would if it arrived then (a timer could land anywhere on a loaded machine)
INTERRUPT_AT = """
import sys
target = sys.argv.pop(1)

class Interrupt:
    def find_spec(self, name, path=None, module=None):
        if name == target:
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, Interrupt())
from redline.cli.entry import main
sys.argv = ["redline", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize(
    "moment",
    [
        "rich.console",  # while the CLI itself loads (typer, rich)
        "redline.hw.probe",  # once the probe command has started
    ],
)
def test_ctrl_c_while_starting_is_one_line(moment: str) -> None:
    one_line(run_python(INTERRUPT_AT, moment, "probe"), "interrupted", code=130)


# ----------------------------------------------------------------------------------------------- the fuzz

# Every value-taking option and argument of every command, with values that are wrong for most of them: empty,
# negative, not a number, a number past every range, a path where nothing is. Each runs as its own process in
# a scratch folder, from a base command that is cheap and harmless (--quick, --dry-run, --once, a snapshot
# file), so a value that happens to be valid runs briefly. What must never come back: a traceback, an
# "internal error", a usage error over several lines, or a run that will not end.
BAD_VALUES = ("", "-1", "abc", "1e309", "99999999999999999999", "missing/dir/file")
CASE_TIMEOUT_S = 600  # a hang guard only: a loaded runner is slow, a value that starts a long run is the failure

SNAPSHOT = str(FIXTURES / "h100x8-faulty.json")
# per command: the base invocation, and per option a base of its own where the option needs another context
BASES: dict[tuple[str, ...], dict[str, list[str]]] = {
    ("probe",): {"*": []},
    ("doctor",): {"*": ["--from", SNAPSHOT], "--from": []},
    ("bench",): {
        "suites": ["--quick"],
        "--device": ["memory", "--quick"],
        "--path": ["storage", "--quick"],
        "--listen": ["network", "--quick", "--serve"],
        "--connect": ["network", "--quick"],
        "--port": ["network", "--quick", "--connect", "127.0.0.1"],
        "--streams": ["network", "--quick"],
        "--ranks": ["collective", "--quick"],
        "--dataset": ["dataloader", "--quick"],
        "--precision": ["compute", "--quick"],
    },
    ("plan",): {
        "*": ["-m", "gpt2", "--hardware", "8xh100-sxm"],
        "--model": ["--hardware", "8xh100-sxm"],
        "--params": ["--hardware", "8xh100-sxm"],
        "--hardware": ["-m", "gpt2"],
        "--calibrate-micro-batch": ["-m", "resnet50", "--hardware", "local", "--calibrate"],
        # one node each: a value the ranking takes runs the whole ranking, a quarter of it at one node count
        "--provider": ["-m", "gpt2", "--cloud", "--tokens", "1B", "--max-nodes", "1"],
        "--max-nodes": ["-m", "gpt2", "--cloud", "--tokens", "1B"],
        "--deadline": ["-m", "gpt2", "--cloud", "--tokens", "1B", "--max-nodes", "1"],
    },
    ("run",): {"*": ["--dry-run", "train.py"], "script": ["--dry-run"]},
    ("tune",): {"*": ["--dry-run", "train.py"], "script": ["--dry-run"]},
    ("monitor",): {"*": ["--once", "--interval", "0.1"], "--interval": ["--once"], "--listen": ["--once", "--port"]},
    ("report",): {"*": ["run.rlm"], "record": []},
    ("catalog", "gpus"): {"*": []},
    ("catalog", "instances"): {"*": []},
    # the queue: the fuzz runs a daemon of its own (REDLINE_QUEUE_DIR); a submit only as a dry run
    ("submit",): {"*": ["--dry-run"]},
    ("jobs",): {"*": []},
    ("cancel",): {"*": ["1"], "ids": []},
    ("hold",): {"*": []},
    ("release",): {"*": []},
    ("logs",): {"*": []},
    ("queue", "status"): {"*": []},
    ("queue", "daemon"): {"*": ["--max-jobs-per-user", "0"], "--max-jobs-per-user": ["--policy", "nope"]},
    ("queue", "unit"): {"*": []},
    # transfers: a local file copied within the scratch folder
    ("fetch",): {"*": ["train.py", "copied.py"], "paths": []},
    ("push",): {"*": ["train.py", "pushed.py"], "paths": []},
    # the stage cache ($REDLINE_HOME/cache, in the scratch folder): a local file staged, listed, evicted
    ("stage", "add"): {"*": ["train.py"], "urls": []},
    ("stage", "ls"): {"*": []},
    ("stage", "evict"): {"*": ["train.py"], "urls": []},
    ("stage", "clear"): {"*": []},
    # inference: a two-layer factory in the scratch folder, eager only, one batch, one timed call
    ("infer",): {
        "*": ["-m", "tinynet:build", "--backends", "eager", "--batch", "1", "--iters", "1", "--generate", "0"],
        "--model": ["--backends", "eager", "--batch", "1", "--iters", "1"],
    },
}


def _commands() -> list[tuple[tuple[str, ...], object]]:
    import typer

    from redline.cli.main import app

    out = []

    def walk(command, path):
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, (*path, name))
        else:
            out.append((path, command))

    walk(typer.main.get_command(app), ())
    return out


def _cases() -> list[tuple[tuple[str, ...], str, list[str]]]:
    """(command, option, argv) for every value-taking parameter and bad value."""
    cases = []
    for path, command in _commands():
        bases = BASES[path]  # a KeyError here: a new command needs a base above
        for param in command.params:
            if getattr(param, "is_flag", False):
                continue
            option = param.opts[0] if param.param_type_name == "option" else param.name
            base = bases.get(option, bases.get("*"))
            assert base is not None, f"{' '.join(path)} {option}: give it a base in BASES"
            for value in BAD_VALUES:
                given = [value] if param.param_type_name == "argument" else [option, value]
                if option == "--listen" and path == ("monitor",):
                    given = [str(free_port()), *given]  # after the base's --port
                cases.append((path, option, [*path, *base, *given]))
    return cases


def test_every_command_has_a_base_for_the_fuzz() -> None:
    assert {path for path, _ in _commands()} == set(BASES)


@pytest.mark.slow
def test_no_bad_value_of_any_option_gets_a_traceback(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from redline.monitor.store import Store

    # each case runs in a copy of this folder: two cases at once never write one path (a push and a push to
    # pushed.py, an infer -o abc and a probe -o abc), which would test the race, not the value
    template = tmp_path / "template"
    template.mkdir()
    (template / "train.py").write_text("print('trained')\n")
    (template / "tinynet.py").write_text(
        "import torch\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), (8,)\n"
    )
    Store.open(template / "run.rlm").close()  # an empty record: report refuses it, options first
    queue = tmp_path / "queue"
    env = {"REDLINE_HOME": str(tmp_path / "home"), "REDLINE_QUEUE_DIR": str(queue)}
    assert run_cli("queue", "status", env=env).returncode == 0  # the queue's daemon: started on first use

    def run(numbered):
        index, case = numbered
        argv = case[2]
        workdir = tmp_path / f"case-{index}"
        shutil.copytree(template, workdir)
        try:
            result = run_cli(*argv, env=env, timeout=CASE_TIMEOUT_S, cwd=workdir)
        except subprocess.TimeoutExpired:
            return f"redline {' '.join(argv)}: still running after {CASE_TIMEOUT_S} s"
        output = result.stdout + result.stderr
        if "Traceback" in output or "internal error" in output:
            return f"redline {' '.join(argv)}: {result.stderr.strip()[-600:]}"
        if result.returncode not in (0, 2):
            return f"redline {' '.join(argv)}: exit {result.returncode}: {result.stderr.strip()[-300:]}"
        if result.returncode == 2 and len(said(result.stderr)) != 1:
            return f"redline {' '.join(argv)}: exit 2 with {result.stderr.strip()!r}"
        return None

    cases = _cases()
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            problems = [p for p in pool.map(run, enumerate(cases)) if p]
    finally:
        os.kill(int((queue / "daemon.lock").read_text()), signal.SIGTERM)
    assert not problems, f"{len(problems)} of {len(cases)} cases:\n" + "\n".join(problems)
