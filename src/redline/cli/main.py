"""The ``redline`` command: one sub-command per module in this package."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import typer

from redline import __version__
from redline.cli import bench, catalog, doctor, infer, monitor, plan, probe, queue, quiet, stage, transfer, tune, ui
from redline.cli import run as run_command  # `run` below is the function every command goes through
from redline.env import REDLINE_DEBUG
from redline.errors import RedlineError, one_line

app = typer.Typer(
    help="redline: make a GPU server deliver the compute it should.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
app.command("probe")(probe.probe)
app.command("doctor")(doctor.doctor)
app.command("bench")(bench.bench)
app.command("plan")(plan.plan)
app.command("run", context_settings={"allow_extra_args": True, "allow_interspersed_args": False})(run_command.run)
app.command("tune", context_settings={"allow_extra_args": True, "allow_interspersed_args": False})(tune.tune)
app.command("infer")(infer.infer)
app.command("monitor")(monitor.monitor)
app.command("report")(monitor.report)
app.command("submit", context_settings={"allow_extra_args": True, "allow_interspersed_args": False})(queue.submit)
app.command("jobs")(queue.jobs)
app.command("cancel")(queue.cancel)
app.command("hold")(queue.hold)
app.command("release")(queue.release)
app.command("logs")(queue.logs)
app.command("fetch")(transfer.fetch)
app.command("push")(transfer.push)
app.add_typer(queue.app, name="queue")
app.add_typer(catalog.app, name="catalog")
app.add_typer(stage.app, name="stage")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"redline {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """redline: make a GPU server deliver the compute it should."""


def run(args: Sequence[str] | None = None) -> int:
    """Run the command ARGS (``sys.argv[1:]`` when None) and return its exit code: every error becomes one line
    on stderr (a usage error 2, a bad value the command's code, an interrupt 130, anything else 1); with
    REDLINE_DEBUG=1 an unexpected error is raised with its traceback instead, and the known third-party noise that
    ``quiet`` keeps off stderr is let through. ``main`` and the tests share it."""
    try:
        # standalone_mode=False: usage errors reach us as exceptions, so they too are one line
        with quiet.third_party_noise_silenced():  # torchao's, torch's and the ONNX exporter's notes to themselves
            code = app(args=None if args is None else list(args), prog_name="redline", standalone_mode=False)
    except typer.Abort:
        ui.error("interrupted")
        return 130
    except typer.TyperException as exc:  # a usage error: unknown option, a value of the wrong type
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        if message:  # empty after `redline` alone, whose help is already printed
            ui.error(message)
        return getattr(exc, "exit_code", 2)
    except RedlineError as exc:
        ui.error(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        ui.error("interrupted")
        return 130
    except Exception as exc:
        if os.environ.get(REDLINE_DEBUG):
            raise
        ui.error(f"internal error: {one_line(exc)} (set {REDLINE_DEBUG}=1 for the traceback)")
        return 1
    if code == 130:  # typer turns a KeyboardInterrupt inside a command into Exit(130), silently
        ui.error("interrupted")
    return code if isinstance(code, int) else 0


def main() -> None:
    """Entry point: ``run`` on the command line, its code as the process's exit status."""
    code = run()
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
