"""Sentences that name the planner's inputs, so that each front end names them as its user knows them.

The planner's checks and notes speak of its inputs by their field names (``tensor``, ``global_batch``,
``calibration.micro_batch``); ``redline plan`` says its flags instead (``--tp``, ``--global-batch``,
``--calibrate-micro-batch``). A ``Message`` keeps the sentence with the names as ``{field}`` placeholders and the
values apart, so that one sentence serves both: ``str()`` of a refusal says the field, and the CLI renders the same
words with its flag table (``Message.render``). A value is never read as a placeholder, whatever it holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

from redline.errors import BadInput

# a field name, or a parameter's field (``calibration.micro_batch``)
_PLACEHOLDER = re.compile(r"\{([a-z_][a-z_.]*)\}")


@dataclass(frozen=True)
class Message:
    """A sentence with ``{name}`` placeholders: a key of ``values`` is replaced by its value, any other name is an
    input's name, replaced by what the reader calls it (``render``'s ``naming``, else the name itself)."""

    template: str
    values: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def plain(cls, text: str) -> Message:
        """A sentence that names no input, taken as it is (braces and all)."""
        return cls("{text}", {"text": text})

    @property
    def names(self) -> tuple[str, ...]:
        """The inputs the sentence names, in order of first mention."""
        found = (name for name in _PLACEHOLDER.findall(self.template) if name not in self.values)
        return tuple(dict.fromkeys(found))

    def render(self, naming: Mapping[str, str] | None = None) -> str:
        """The sentence with each value filled in and each input called as ``naming`` says (default: its name)."""
        called = naming or {}

        def fill(match: re.Match[str]) -> str:
            key = match[1]
            return str(self.values[key]) if key in self.values else called.get(key, key)

        return _PLACEHOLDER.sub(fill, self.template)

    def __str__(self) -> str:
        return self.render()


class PlanInputError(BadInput, ValueError):
    """A planner input the planner cannot use (exit code 2, as any bad input). ``field`` is the input it is about;
    ``str()`` names the inputs by their fields, ``render(naming)`` as a front end calls them. A ValueError too:
    a value out of its range, as Python's own checks say it."""

    def __init__(self, message: Message, field: str | None = None) -> None:
        self.message = message
        self.field = field if field is not None else message.names[0]
        super().__init__(message.render())

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.message, self.field)  # made again from its parts, not from the rendered text

    def render(self, naming: Mapping[str, str]) -> str:
        """The message with the inputs called as ``naming`` says (a front end's names, such as the CLI's flags)."""
        return self.message.render(naming)


def refuse(template: str, *, field: str | None = None, **values: Any) -> PlanInputError:
    """The error for ``template`` (see ``Message``), about ``field`` (default: the first input it names)."""
    return PlanInputError(Message(template, values), field)


def refuse_field(name: str, rest: str, **values: Any) -> PlanInputError:
    """The error for a sentence that starts with the input ``name`` and goes on with ``rest`` (a template)."""
    return refuse("{" + name + "} " + rest, **values)


def check_integral(name: str, value: Any) -> None:
    """``value`` is a whole number (not a bool, not a float that happens to be whole)."""
    if not isinstance(value, Integral) or isinstance(value, bool):
        raise refuse_field(name, "must be a whole number, not {value}", value=repr(value))


def check_whole(name: str, value: Any, minimum: int) -> None:
    """``value`` is None (left to the planner) or a whole number of at least ``minimum``."""
    if value is None:
        return
    check_integral(name, value)
    if value < minimum:
        raise refuse_field(name, "must be at least {minimum}, not {value}", minimum=minimum, value=value)


def check_choice(name: str, value: str | None, known: Iterable[str]) -> None:
    """``value`` is None (left to the planner) or one of ``known``."""
    known = tuple(known)
    if value is not None and value not in known:
        raise refuse_field(name, "'{value}' is not one of {known}", value=value, known=", ".join(known))
