"""Errors that reach the user as one line and an exit code, never as a traceback."""


class RedlineError(Exception):
    """Something the user can act on; the CLI prints the message alone and exits with ``exit_code``."""

    exit_code = 1


class BadInput(RedlineError):
    """The user handed us something we cannot use: a malformed file, an unknown name, a bad option."""

    exit_code = 2
