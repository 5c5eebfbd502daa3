"""`redline probe` (in progress)."""


def probe() -> None:
    """Take a snapshot of this server."""
