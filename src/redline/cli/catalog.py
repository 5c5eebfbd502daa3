"""`redline catalog`: the GPU catalog (filled in by the catalog work)."""

import typer

app = typer.Typer(help="Browse the GPU catalog.", no_args_is_help=True)
