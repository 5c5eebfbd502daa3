"""Optional packages, probed in one place and imported lazily, so ``import redline`` stays light.

torch and transformers are optional: commands that need them say so in one line instead of failing.
Nothing here initialises CUDA.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from redline.errors import BadInput


def is_available(package: str) -> bool:
    """Whether ``package`` can be imported, without importing it."""
    return importlib.util.find_spec(package) is not None


def torch_is_cpu_only() -> bool:
    """Whether the installed torch is a CPU-only build, read from its version (``2.13.0+cpu``, as the PyTorch
    index names them) without importing it. False when unknown: builds without the label may have CUDA."""
    try:
        return importlib.metadata.version("torch").partition("+")[2] == "cpu"
    except importlib.metadata.PackageNotFoundError:
        return False


def require_torch(what: str) -> None:
    """Raise a one-line BadInput naming ``what`` needs PyTorch when torch is not installed."""
    if not is_available("torch"):
        raise BadInput(f"{what} needs PyTorch: install the build that fits this machine (pip install torch)")


def require_transformers(what: str) -> None:
    """Raise a one-line BadInput naming ``what`` needs transformers, and the extra that installs it."""
    if not is_available("transformers"):
        raise BadInput(f"{what} needs Hugging Face transformers: the hf extra: pip install transformers")
