"""Option values that several commands take, parsed one way: where to listen, which port, the runtime's
settings (``redline run`` and ``redline plan``)."""

from __future__ import annotations

import functools
import inspect
import ipaddress
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from redline.errors import BadInput
from redline.units import parse_count, parse_duration

T = TypeVar("T")

EVERY_INTERFACE = "0.0.0.0"
LISTEN_HELP = "an IP address of this machine, 'localhost', or 'all' (every IPv4 interface; '::' for IPv6 too)"


def listen_address(option: str, value: str) -> str:
    """The address to bind for ``value``: an IP literal, 'localhost' or 'all'.

    Nothing else: socket libraries read '0', '', '*' or a hostname as "every interface" or resolve it in ways
    nobody meant, and a server that exposes a machine's telemetry must only do so when asked in plain words.
    """
    text = value.strip()
    if text == "all":
        return EVERY_INTERFACE
    if text == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise BadInput(f"{option} takes {LISTEN_HELP}, not {value!r}") from None


def tcp_port(option: str, value: int, *, allow_zero: bool = False) -> int:
    """A TCP port number, 1-65535 (0 too where the system may pick one)."""
    low = 0 if allow_zero else 1
    if not low <= value <= 65535:
        raise BadInput(f"{option} {value} is not a TCP port ({low}-65535)")
    return value


def with_runtime_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command`` taking, besides its own options, one per runtime setting that has a flag
    (``runtime.config.SETTINGS``: the one table ``redline run`` and ``redline plan`` share). The command's own
    ``runtime`` parameter receives the settings given, as {keyword: value}; an option left out is not there."""
    from redline.runtime.config import SETTINGS

    flagged = [s for s in SETTINGS if s.flag is not None]
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "runtime"]
    added = [
        inspect.Parameter(
            s.keyword,
            inspect.Parameter.KEYWORD_ONLY,
            default=typer.Option(None, _declaration(s), help=s.help, show_default=False),
            annotation=_optional(s.type),
        )
        for s in flagged
    ]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        given = {s.keyword: kwargs.pop(s.keyword) for s in flagged}
        return command(**kwargs, runtime={k: v for k, v in given.items() if v is not None})

    # what typer reads the options from (functools' wrapper type does not declare the attribute)
    wrapper.__signature__ = inspect.Signature([*own, *added])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in (*own, *added)}
    return wrapper


def _declaration(setting: Any) -> str:
    """A boolean setting is a pair of switches (``--compile/--no-compile``); the rest take a value."""
    if setting.type is bool:
        return f"{setting.flag}/--no-{setting.flag[2:]}"
    return setting.flag


def _optional(kind: Any) -> Any:
    """The option's type: the setting's, None allowed (an option not given)."""
    return kind if type(None) in typing.get_args(kind) else kind | None


def parsed(parse: Callable[[str], T], option: str, text: str | None) -> T | None:
    """``option``'s value read by ``parse`` (``parse_bytes``, ``parse_duration``...); its ValueError becomes one
    line of BadInput naming the option; None (not given) stays None."""
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError as exc:
        raise BadInput(f"{option}: {exc}") from None


def count_option(option: str, text: str | None) -> float | None:
    """A count such as 1B, 300M or 2e9 (``parse_count``); None stays None."""
    return parsed(parse_count, option, text)


def parse_input_shape(text: str | None) -> tuple[int, ...] | None:
    """--input-shape: sizes like 3,224,224 (or 3x224x224), each at least 1; None stays None."""
    if text is None:
        return None
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise BadInput(f"--input-shape '{text}' is not a list of positive sizes like 3,224,224")
    return shape


def deadline_s(text: str) -> float:
    """--deadline: 90s, 10m, 36h, 7d; a bare number counts hours."""
    try:
        return parse_duration(text, bare_unit_s=3600)  # a bare number is hours
    except ValueError as exc:
        raise BadInput(f"--deadline {exc}") from None
