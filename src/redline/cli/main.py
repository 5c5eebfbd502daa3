"""The ``redline`` command: one sub-command per module in this package."""

from __future__ import annotations

import os
import sys

import typer

from redline import __version__
from redline.cli import bench, catalog, doctor, infer, monitor, plan, probe, queue, run, stage, transfer, tune, ui
from redline.errors import RedlineError

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
app.command("run", context_settings={"allow_extra_args": True, "allow_interspersed_args": False})(run.run)
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


def main() -> None:
    """Entry point: errors become one line on stderr and an exit code; REDLINE_DEBUG=1 shows tracebacks."""
    try:
        # standalone_mode=False: usage errors reach us as exceptions, so they too are one line
        code = app(standalone_mode=False)
    except typer.Abort:
        ui.error("interrupted")
        sys.exit(130)
    except typer.TyperException as exc:  # a usage error: unknown option, a value of the wrong type
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        if message:  # empty after `redline` alone, whose help is already printed
            ui.error(message)
        sys.exit(getattr(exc, "exit_code", 2))
    except RedlineError as exc:
        ui.error(str(exc))
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        ui.error("interrupted")
        sys.exit(130)
    except Exception as exc:
        if os.environ.get("REDLINE_DEBUG"):
            raise
        ui.error(f"internal error: {type(exc).__name__}: {exc} (set REDLINE_DEBUG=1 for the traceback)")
        sys.exit(1)
    if code == 130:  # typer turns a KeyboardInterrupt inside a command into Exit(130), silently
        ui.error("interrupted")
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
