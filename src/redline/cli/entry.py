"""The `redline` executable: Ctrl-C is handled before the CLI's imports (typer, rich) run, not after."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from redline.cli.main import main as run
    except KeyboardInterrupt:  # interrupted while starting: one line, as at any other moment
        sys.stderr.write("redline: interrupted\n")
        sys.exit(130)
    run()
