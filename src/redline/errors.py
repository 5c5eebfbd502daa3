"""Errors that reach the user as one line and an exit code, never as a traceback, and any exception told in one
line (`one_line`)."""


class RedlineError(Exception):
    """Something the user can act on; the CLI prints the message alone and exits with ``exit_code``."""

    exit_code = 1


class BadInput(RedlineError):
    """The user handed us something we cannot use: a malformed file, an unknown name, a bad option."""

    exit_code = 2


def one_line(exc: BaseException, *, typed: bool = True, limit_chars: int = 300) -> str:
    """``exc`` as one line for an error message, a note or a table cell: ``Type: headline``.

    The headline is the first non-blank line of the exception's text with its runs of whitespace made one
    space: a worker's re-raised traceback, a compiler's log or a library's paragraph of advice keeps the line
    that says what went wrong and drops the rest, which one line of output cannot hold. ``typed=False`` leaves
    the type out where the caller's words already say what failed (a network error after the URL); an
    exception with no text is its type's name either way. A line longer than ``limit_chars`` is cut, ending in
    "...".
    """
    lines = (" ".join(line.split()) for line in str(exc).splitlines())
    headline = next((line for line in lines if line), "")
    if not headline:
        text = type(exc).__name__
    elif typed:
        text = f"{type(exc).__name__}: {headline}"
    else:
        text = headline
    return text if len(text) <= limit_chars else text[: limit_chars - 3] + "..."
