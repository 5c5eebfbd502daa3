"""Load a user's model factory from a ``package.module:callable`` spec.

The factory takes no arguments and returns an ``nn.Module``, or ``(module, example_input_shape)`` where the
shape is one sample's, without the batch dimension. It is imported the way ``python -m`` would import it: the
current directory comes first on ``sys.path``. A factory that an inference artifact names is imported from the
artifact's own folder or an installed package only (``folder``): never from whatever folder the program that
loads the artifact runs in. Every way this can go wrong is a ``BadInput`` of one line that names the spec and the
cause.

``load_factory`` only imports; the returned ``build`` calls the factory, so that ``trace_module`` can call it
under its fake-tensor mode and the model costs no memory::

    trace_module(load_factory("mypkg.models:build"), None, name="build", source="mypkg.models:build")
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from redline.errors import BadInput, one_line
from redline.workload.model_spec import parse_factory

Build = Callable[[], tuple[Any, tuple[int, ...] | None]]


def load_factory(spec: str, *, folder: str | os.PathLike[str] | None = None) -> Build:
    """Import ``spec``'s module and find its callable; return a ``build()`` that calls it and checks the result.

    ``build()`` returns ``(module, input_shape or None)``. Raises ``BadInput`` for a malformed spec, a module
    that does not import, a missing or non-callable attribute, and (from ``build``) a factory that raises or
    returns something other than an ``nn.Module``. ``folder``: import from there or an installed package, not
    from the current directory (an artifact's factory).
    """
    parsed = parse_factory(spec)
    spec, module_name, attribute = parsed.text, parsed.module, parsed.factory
    if folder is None:
        _cwd_importable()
    where = "" if folder is None else f" (an artifact's factory comes from {folder} or an installed package)"
    try:
        with contextlib.nullcontext() if folder is None else _only_from(Path(folder)):
            module = importlib.import_module(module_name)
    except (Exception, SystemExit) as error:  # ImportError, SyntaxError, a script that calls sys.exit on import
        raise BadInput(f"factory {spec}: cannot import {module_name}: {one_line(error)}{where}") from error
    factory: Any = module
    for part in attribute.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError:
            raise BadInput(f"factory {spec}: {module_name} has no attribute {attribute}") from None
    if not callable(factory):
        raise BadInput(f"factory {spec}: {attribute} is a {type(factory).__name__}, not a callable")

    def build() -> tuple[Any, tuple[int, ...] | None]:
        try:
            built = factory()
        except BadInput:
            raise
        except Exception as error:
            raise BadInput(f"factory {spec} raised {one_line(error)}") from error
        return _check_result(spec, built)

    return build


def _check_result(spec: str, built: Any) -> tuple[Any, tuple[int, ...] | None]:
    from torch import nn  # only once a factory has run: loading a spec should not pay for torch

    shape = None
    if isinstance(built, tuple):
        if len(built) != 2 or not isinstance(built[0], nn.Module):
            raise BadInput(f"factory {spec} returned a tuple; expected (nn.Module, input_shape)")
        built, shape = built
        if not isinstance(shape, tuple | list) or not all(isinstance(d, int) and d > 0 for d in shape):
            raise BadInput(f"factory {spec} returned input shape {shape!r}; expected a tuple of positive integers")
        shape = tuple(shape)
    if not isinstance(built, nn.Module):
        raise BadInput(f"factory {spec} returned {type(built).__name__}, not an nn.Module")
    return built, shape


def _cwd_importable() -> None:
    """Put the current directory first on sys.path, as ``python -m`` does, unless it already is there."""
    cwd = os.getcwd()
    if not any(entry in ("", ".", cwd) for entry in sys.path):
        sys.path.insert(0, cwd)


@contextlib.contextmanager
def _only_from(folder: Path) -> Iterator[None]:
    """``sys.path`` for one import: ``folder`` first, then every entry but the current directory ('', '.' and
    its own path all mean it: ``python -c`` and a shell's PYTHONPATH=. put it there), restored after."""
    saved = list(sys.path)
    here = os.path.realpath(os.getcwd())
    sys.path[:] = [str(folder)] + [e for e in saved if e not in ("", ".") and os.path.realpath(e) != here]
    try:
        yield
    finally:
        sys.path[:] = saved
