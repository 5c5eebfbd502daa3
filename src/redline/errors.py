"""Errors that reach the user as one line and an exit code, never as a traceback."""


class RedlineError(Exception):
    """Something the user can act on; the CLI prints the message alone and exits with ``exit_code``."""

    exit_code = 1


class BadInput(RedlineError):
    """The user handed us something we cannot use: a malformed file, an unknown name, a bad option."""

    exit_code = 2


def read_user_file(path, what: str) -> str:
    """The text of a file the user named (``what`` says which kind, for the message); BadInput, one line,
    when it is missing, unreadable or not text."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"no such {what}: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read {what} {path}: {exc}") from None
