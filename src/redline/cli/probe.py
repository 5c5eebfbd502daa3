"""`redline probe`: a snapshot of this server as versioned JSON (GPUs, host, storage, network, software)."""

from __future__ import annotations

from pathlib import Path

import typer

from redline.cli import ui
from redline.report.output import write_output

DATA_HELP = "A dataset path to locate (filesystem type, disk); repeatable."


def check_data_paths(paths: list[str]) -> list[str]:
    """A typo in a dataset path should stop the run, not produce an audit of nothing."""
    from redline.errors import BadInput

    for path in paths:
        try:
            Path(path).stat()
        except FileNotFoundError:
            raise BadInput(f"--data {path}: no such file or directory") from None
        except OSError as exc:  # not ours to see: the probe could say nothing about where it lives
            raise BadInput(f"--data {path}: {exc.strerror or exc} (as this user)") from None
    return paths


def probe(
    json_out: bool = typer.Option(False, "--json", help="Print the snapshot as JSON (for doctor --from)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Also write the JSON snapshot to this file."),
    data: list[str] = typer.Option([], "--data", help=DATA_HELP),
) -> None:
    """Take a snapshot of this server.

    Save one on a remote server with `redline probe --json > snap.json`, audit it anywhere with
    `redline doctor --from snap.json`.
    """
    from redline.hw.probe import CPU_SAMPLE_S, take_snapshot
    from redline.hw.snapshot import SNAPSHOT_MARKER
    from redline.report.summary import server_summary

    snapshot = take_snapshot(data_paths=check_data_paths(data), cpu_sample_s=CPU_SAMPLE_S)
    if output is not None:
        write_output(output, snapshot.to_json(), marker=SNAPSHOT_MARKER)
    if json_out:
        ui.print_json(snapshot.to_dict())
        return
    ui.print_table(ui.key_value_table("redline probe", server_summary(snapshot)))
    for gpu in snapshot.gpus:
        ui.console.print(ui.gpu_line(gpu))
    for note in snapshot.probe_errors:
        ui.warn(note)
    if output is None:
        ui.console.print(ui.dim("full snapshot: redline probe --json"))
