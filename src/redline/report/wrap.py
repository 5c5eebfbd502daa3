"""Lines of values for a terminal of any width: wrapped between values, never inside one.

Rich wraps a line of text at any space, so a status line like "disk r/w 328.4 MiB/s 3.8 MiB/s" can end at
"disk r/w" with its figures on the next line, and a sentence can end at "1544" with "MHz" below it. ``Values``
lays out a list of values ("key value" items, or the words of a sentence with each number kept with its unit)
at the width it is drawn at: as many whole values on a line as fit, the rest on indented lines below, the way
``ls`` fills its columns. Only a value wider than the whole line is broken, as nothing else can show it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.text import Text

# words that read as the unit of the number before them: "1544 MHz", "40.0 s", "90 °C"
UNITS = frozenset(
    {"s", "ms", "us", "µs", "ns", "min", "h", "d", "W", "kW", "kWh", "J", "°C", "Hz", "kHz", "MHz", "GHz", "%"}
    | {"B", "kB", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB", "B/s", "kB/s", "MB/s", "GB/s", "TB/s"}
    | {"KiB/s", "MiB/s", "GiB/s", "TiB/s", "FLOP/s", "TFLOP/s", "GFLOP/s", "samples/s", "tokens/s", "lanes"}
)
# words that name the number after them: "GPU 2", "rank 5", "step 23"
NAMES = frozenset({"GPU", "GPUs", "rank", "ranks", "step", "steps", "Xid", "gen", "port", "pid"})
_NUMBER = re.compile(r"^[~≈<>+-]?\d[\d.,:/x-]*%?[,;:.)]*$")
_TRAILING = ",;:.)"


def prose(text: str) -> list[str]:
    """The words of ``text``, a number joined with its unit, a name with its number and an arrow with both its
    sides ("SM clock 1980 → 1544 MHz" is ["SM", "clock", "1980 → 1544 MHz"]): the values of a sentence."""
    words: list[str] = []
    for word in text.split():
        if words and _belongs_to_previous(words[-1], word):
            words[-1] += " " + word
        else:
            words.append(word)
    return words


def _belongs_to_previous(previous: str, word: str) -> bool:
    last = previous.rsplit(" ", 1)[-1]
    if word == "→" or last == "→":
        return True
    if _NUMBER.match(last) and not last.endswith(tuple(_TRAILING)):
        return word.rstrip(_TRAILING) in UNITS
    return last in NAMES and bool(_NUMBER.match(word))


@dataclass(frozen=True)
class Values:
    """``values`` on one line, ``separator`` between them, wrapped between values at the width drawn at; a
    continuation line starts ``indent`` spaces in, so a reader sees it belongs to the line above."""

    values: Sequence[str | Text]
    separator: str = " | "
    indent: int = 2
    style: str = ""

    def lines(self, width: int) -> list[Text]:
        """The values laid out ``width`` columns wide."""
        lines: list[Text] = []
        line: Text | None = None
        for value in self.values:
            text = value if isinstance(value, Text) else Text(value)
            if line is not None and line.cell_len + len(self.separator) + text.cell_len <= width:
                line.append(self.separator)
            else:
                if line is not None:
                    lines.append(line)
                line = Text(" " * self.indent if lines else "", style=self.style)
            line.append_text(text)
        return [*lines, line] if line is not None else lines

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from self.lines(options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        """As narrow as its widest value (indented), as wide as all of them on one line."""
        sizes = [value.cell_len if isinstance(value, Text) else Text(value).cell_len for value in self.values]
        whole = sum(sizes) + len(self.separator) * max(len(sizes) - 1, 0)
        return Measurement(min(max(sizes, default=0) + self.indent, whole), whole).clamp(max_width=options.max_width)
