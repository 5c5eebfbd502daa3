"""The command line's options, frozen: a new, renamed or dropped option fails here until this list says so,
so that a change to what users type is a deliberate one."""

from __future__ import annotations

FLAGS: dict[str, set[str]] = {
    "probe": {"--data", "--json", "--output", "-o"},
    "doctor": {"--bench", "--bench-file", "--data", "--from", "--html", "--json", "--list-rules", "--strict"},
    "bench": {
        *("--connect", "--dataset", "--device", "--json", "--listen", "--path", "--port", "--precision"),
        *("--quick", "--ranks", "--save", "--serve", "--streams"),
    },
    "plan": {
        *("--calibrate", "--calibrate-micro-batch", "--checkpointing", "--cloud", "--dataset-size", "--deadline"),
        *("--epochs", "--global-batch", "--hardware", "--input-shape", "--json", "--list-models", "--max-nodes"),
        *("--micro-batch", "--model", "--network-gbps", "--nodes", "--optimizer", "--output", "--params", "--pp"),
        *("--precision", "--provider", "--rank", "--seq-len", "--sharding", "--tokens", "--top", "--tp", "-m", "-o"),
        # the layout switches, the pipeline schedule, tracing or not, and the memory kept free (issue 16)
        *("--sequence-parallel", "--no-sequence-parallel", "--flash-attention", "--no-flash-attention"),
        *("--schedule", "--virtual-stages", "--analytic", "--memory-margin"),
        "--residual-bytes",  # another framework's residual stream (issue 44)
        # the runtime's settings (runtime.config.SETTINGS), the same as `redline run`'s
        *("--ac-every", "--accumulation", "--checkpoint-dir", "--checkpoint-every", "--comm-hook", "--compile"),
        *("--metrics", "--no-compile", "--num-workers", "--cpu-threads", "--max-steps", "--loader-batch"),
    },
    "run": {
        *("--dry-run", "--json", "--max-restarts", "--nnodes", "--nproc-per-node", "--plan", "--rdzv-endpoint"),
        *("--rdzv-id", "--plan-anyway"),
        *("--ac-every", "--accumulation", "--checkpoint-dir", "--checkpoint-every", "--comm-hook", "--compile"),
        *("--metrics", "--no-compile", "--num-workers", "--cpu-threads", "--max-steps", "--loader-batch"),
    },
    "monitor": {
        *("--duration", "--gpus", "--interval", "--job-pid", "--json", "--listen", "--once", "--port", "--record"),
        *("--retention", "--steps", "--window"),
    },
    "report": {"--html", "--json", "--png", "--window"},
    "tune": {
        *("--budget", "--cache-dir", "--dry-run", "--html", "--json", "--max-trials", "--nproc-per-node", "--output"),
        "--plan",
        *("--space", "--steps", "--trial-steps", "--trial-timeout", "--warmup", "-o"),
        # the model, for the planner's ranking
        *("--model", "-m", "--seq-len", "--input-shape"),
    },
    # the queue (issue 18)
    "submit": {
        *("--gpus", "--gpu-memory", "--plan", "--exclusive", "--priority", "--after", "--retries", "--time-limit"),
        *("--name", "--hold", "--share-logs", "--engine", "--nodes", "--queue", "--image", "--kind", "--namespace"),
        *("--address", "--dry-run", "--json"),
    },
    "jobs": {"--all", "--engine", "--namespace", "--address", "--json"},
    "cancel": {"--engine", "--namespace", "--address", "--json"},
    "hold": {"--json"},
    "release": {"--json"},
    "logs": {"--follow", "-f"},
    "queue status": {"--json"},
    "queue daemon": {
        *("--dir", "--policy", "--max-jobs-per-user", "--max-gpus-per-user", "--retry-backoff", "--metrics-port"),
    },
    "queue unit": set(),
    # serving (issue 20)
    "infer": {
        *("--model", "-m", "--weights", "--batch", "--seq-len", "--input-shape", "--precision", "--latency-slo"),
        *("--backends", "--device", "--iters", "--generate", "--output", "-o", "--html", "--list-backends", "--json"),
    },
    # transfers (issue 19)
    "fetch": {
        *("--streams", "--per-endpoint", "--chunk-size", "--checksum", "--overwrite", "--congestion", "--retries"),
        *("--read-timeout", "--endpoint-url", "--known-hosts", "--ssh-key", "--json"),
        *("--copy-links", "-L"),  # issue 40: a folder's symlinks followed, as rclone's -L
    },
    "push": {
        *("--streams", "--per-endpoint", "--chunk-size", "--congestion", "--retries", "--read-timeout"),
        *("--endpoint-url", "--known-hosts", "--ssh-key", "--json"),
        *("--copy-links", "-L"),  # issue 40
    },
    "stage add": {"--cache", "--max-size", "--json", "--allow-evict"},  # issue 43: over the cap only when told
    "stage ls": {"--cache", "--json"},
    "stage evict": {"--cache", "--json"},
    "stage clear": {"--cache", "--json"},
    "catalog gpus": {"--json"},
    "catalog instances": {"--gpu", "--json", "--max-price", "--provider"},
}


def _flags() -> dict[str, set[str]]:
    import typer

    from redline.cli.main import app

    found: dict[str, set[str]] = {}

    def walk(command, path: tuple[str, ...]) -> None:
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, (*path, name))
            return
        options = [p for p in command.params if p.param_type_name == "option"]
        found[" ".join(path)] = {name for p in options for name in (*p.opts, *p.secondary_opts)}

    walk(typer.main.get_command(app), ())
    return found


def test_every_command_has_the_options_listed() -> None:
    assert _flags() == FLAGS


def test_run_and_plan_take_the_runtime_settings_from_one_table() -> None:
    from redline.runtime.config import SETTINGS

    flagged = {s.flag for s in SETTINGS if s.flag is not None}
    assert {"--metrics", "--checkpoint-dir", "--checkpoint-every", "--compile", "--num-workers"} <= flagged
    assert {"--comm-hook", "--accumulation"} <= flagged
    flags = _flags()
    assert flagged <= flags["run"] and flagged <= flags["plan"]
