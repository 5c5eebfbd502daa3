"""The manual's command reference, made from the CLI itself when the site is built, so it cannot drift.

An MkDocs hook (``mkdocs.yml``: ``hooks: [tools/cli_reference.py]``). A page asks for a command's reference with
a line of its own, ``<!-- redline-cli: bench -->`` (a group, ``<!-- redline-cli: queue -->``, brings each of its
sub-commands), and ``<!-- redline-cli: index -->`` lists every command with its one-line summary and the page
that documents it. The text is what ``redline COMMAND --help`` prints: the usage line, the command's help, and
each argument and option with its help and default, read from the click command tree that typer builds from
``redline.cli.main.app``. The build fails when a marker names no command, or when a command is on no page, so a
new command cannot ship undocumented.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MARKER = re.compile(r"^<!-- redline-cli: ([a-z -]+) -->$", re.MULTILINE)
CODE_SPAN = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Param:
    """One argument or option as ``--help`` shows it: its names (and value type), and its help with the default."""

    names: str
    help: str


@dataclass(frozen=True)
class Command:
    """One command of the tree: ``path`` is what follows ``redline`` (``("queue", "status")``)."""

    path: tuple[str, ...]
    usage: str
    help: str
    summary: str
    arguments: tuple[Param, ...]
    options: tuple[Param, ...]
    is_group: bool

    @property
    def name(self) -> str:
        return " ".join(("redline", *self.path))


def _params(command: Any, ctx: Any) -> tuple[tuple[Param, ...], tuple[Param, ...]]:
    """The command's arguments and options in the order ``--help`` lists them, hidden ones left out."""
    arguments, options = [], []
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        if param.param_type_name == "argument":
            # click gives arguments no help record; typer's arguments carry their help as options do
            record = param.get_help_record(ctx) if hasattr(param, "get_help_record") else None
            names = param.make_metavar(ctx) if record is None else record[0]
            arguments.append(Param(names, (record[1] if record else getattr(param, "help", None)) or ""))
        else:
            record = param.get_help_record(ctx)
            if record is not None:
                options.append(Param(record[0], record[1]))
    return tuple(arguments), tuple(options)


def _walk(command: Any, ctx: Any, path: tuple[str, ...]) -> Iterator[Command]:
    arguments, options = _params(command, ctx)
    is_group = hasattr(command, "list_commands")
    usage = command.get_usage(ctx).removeprefix("Usage:").strip()
    help_text = (command.help or "").strip()
    yield Command(path, usage, help_text, command.get_short_help_str(limit=300), arguments, options, is_group)
    if is_group:
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not getattr(sub, "hidden", False):
                yield from _walk(sub, type(ctx)(sub, info_name=name, parent=ctx), (*path, name))


def commands() -> list[Command]:
    """Every command of ``redline``, the top level first, each group before its sub-commands."""
    import typer

    from redline.cli.main import app

    root = typer.main.get_command(app)
    ctx_type = type(root.make_context("redline", ["--help"], resilient_parsing=True))
    return list(_walk(root, ctx_type(root, info_name="redline"), ()))


def _inline(text: str) -> str:
    """``text`` as HTML: escaped, with its `code spans` kept as code."""
    return CODE_SPAN.sub(r"<code>\1</code>", html.escape(text, quote=False))


def _table(title: str, params: tuple[Param, ...]) -> str:
    rows = "".join(
        f'<tr><td style="white-space: nowrap"><code>{html.escape(p.names, quote=False)}</code></td>'
        f"<td>{_inline(p.help)}</td></tr>\n"
        for p in params
    )
    return f"<table>\n<thead><tr><th>{title}</th><th>what it does</th></tr></thead>\n<tbody>\n{rows}</tbody>\n</table>"


def render(command: Command, level: int = 3) -> str:
    """The command's reference as Markdown: a heading, the usage line, the help, the arguments and options."""
    parts = [f"{'#' * level} `{command.name}`", f"```text\n{command.usage}\n```"]
    parts += [f"<p>{_inline(paragraph)}</p>" for paragraph in command.help.split("\n\n") if paragraph.strip()]
    if command.arguments:
        parts.append(_table("argument", command.arguments))
    if command.options:
        parts.append(_table("option", command.options))
    return "\n\n".join(parts) + "\n"


def option_names(text: str) -> set[str]:
    """The long and short option names (``--plan``, ``-o``) that ``text`` mentions."""
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", text))


# --- the MkDocs hook ------------------------------------------------------------------------------------------

_placed: dict[tuple[str, ...], str] = {}  # each command documented so far in this build, and the page that has it


def _by_path() -> dict[tuple[str, ...], Command]:
    return {command.path: command for command in commands()}


def _index(tree: dict[tuple[str, ...], Command], pages: dict[tuple[str, ...], str]) -> str:
    lines = ["| command | what it does |", "|---|---|"]
    for path, command in tree.items():
        if path and not command.is_group:
            link = f"[`{command.name}`]({pages[path]}#{_anchor(command.name)})" if path in pages else command.name
            lines.append(f"| {link} | {command.summary.replace('|', '&#124;')} |")
    return "\n".join(lines) + "\n"


def _anchor(name: str) -> str:
    """The id MkDocs' toc extension gives the heading `` `redline queue status` ``."""
    return re.sub(r"[^\w]+", "-", name).strip("-").lower()


def _pages_of(config: Any) -> dict[tuple[str, ...], str]:
    """Which page documents which command, read from every page's markers before any page is rendered."""
    from pathlib import Path

    tree = _by_path()
    pages: dict[tuple[str, ...], str] = {}
    for path in sorted(Path(config["docs_dir"]).rglob("*.md")):
        uri = path.relative_to(config["docs_dir"]).as_posix()
        for wanted in MARKER.findall(path.read_text()):
            key = tuple(wanted.split())
            for command_path in tree:
                if key != ("index",) and command_path[: len(key)] == key:
                    pages[command_path] = uri
    return pages


def on_config(config: Any) -> Any:
    """Start each build with no command placed (``mkdocs serve`` rebuilds in one process)."""
    _placed.clear()
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each marker on the page with the reference it names."""
    from mkdocs.exceptions import PluginError

    if not MARKER.search(markdown):
        return markdown
    tree = _by_path()

    def expand(match: re.Match[str]) -> str:
        wanted = match.group(1)
        if wanted == "index":
            return _index(tree, {path: _relative(uri, page.file.src_uri) for path, uri in _pages_of(config).items()})
        key = tuple(wanted.split())
        if key not in tree:
            raise PluginError(f"{page.file.src_uri}: `{match.group(0)}` names no redline command")
        chosen = [command for path, command in tree.items() if path[: len(key)] == key]
        for command in chosen:
            _placed[command.path] = page.file.src_uri
        return "\n".join(render(command) for command in chosen)

    return MARKER.sub(expand, markdown)


def _relative(target: str, source: str) -> str:
    import posixpath

    return posixpath.relpath(target, posixpath.dirname(source) or ".")


def on_post_build(config: Any) -> None:
    """Fail the build when a command is on no page of the manual."""
    from mkdocs.exceptions import PluginError

    missing = [command.name for command in commands() if command.path and command.path not in _placed]
    if missing:
        raise PluginError(f"no page of docs/ has a `<!-- redline-cli: ... -->` for {', '.join(missing)}")
