"""`redline doctor` (in progress)."""


def doctor() -> None:
    """Audit this server."""
