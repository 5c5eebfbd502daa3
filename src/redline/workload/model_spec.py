"""The model a user names (``--model SPEC``), read one way for plan, tune and infer.

SPEC is, in this order (docs/plan.md and ``redline plan --help``):

1. a preset name (``redline plan --list-models``), in any case;
2. a Hugging Face ``config.json``: a path that ends in ``.json``, or any file or folder that exists (a folder
   holds its ``config.json``);
3. ``package.module:factory``, a callable that returns an ``nn.Module``.

A path is tried before a factory, so a file whose name holds a colon is still that file. Parsing looks at the
file system only to tell a path from a factory: nothing is read, imported or built here.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

from redline.errors import BadInput
from redline.workload.presets import PRESET_NAMES

# the three forms, as every message that asks for a model names them
FORMS = "a preset, a Hugging Face config.json, or package.module:factory"

_FACTORY = re.compile(r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<factory>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$")


class ModelKind(enum.Enum):
    PRESET = "preset"
    CONFIG = "config"
    FACTORY = "factory"


@dataclass(frozen=True)
class ModelSpec:
    """One parsed SPEC: its kind and the part of it that kind needs."""

    kind: ModelKind
    text: str  # the SPEC as given, without surrounding blanks: what messages and plan files quote
    preset: str = ""  # PRESET: its name, lower case (a key of workload.presets)
    path: Path | None = None  # CONFIG: the file or folder, ~ expanded
    module: str = ""  # FACTORY: the module to import, "mypkg.models"
    factory: str = ""  # FACTORY: the callable's name in it, dotted for an attribute of an attribute


def parse_model_spec(text: str) -> ModelSpec:
    """``text`` as a preset, a config path or a factory, tried in that order; BadInput naming the three forms
    when it is none of them, or when it has a colon but is not ``package.module:factory``."""
    spec = text.strip()
    if spec.lower() in PRESET_NAMES:
        return ModelSpec(ModelKind.PRESET, spec, preset=spec.lower())
    path = Path(spec).expanduser()
    if spec and (path.suffix == ".json" or path.exists()):
        return ModelSpec(ModelKind.CONFIG, spec, path=path)
    if ":" in spec:
        return parse_factory(spec)
    raise BadInput(
        f"unknown model '{text}': not a preset ({', '.join(PRESET_NAMES)}), not a config.json path, "
        "not package.module:factory"
    )


def parse_factory(text: str) -> ModelSpec:
    """``text`` as ``package.module:factory`` alone (an inference artifact's saved factory, which is never a
    path); BadInput when it is malformed."""
    spec = text.strip()
    match = _FACTORY.match(spec)
    if match is None:
        raise BadInput(f"bad factory spec {text!r}: expected package.module:callable, e.g. mypkg.models:build")
    return ModelSpec(ModelKind.FACTORY, spec, module=match["module"], factory=match["factory"])
