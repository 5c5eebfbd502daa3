"""redline: make a GPU server deliver the compute it should.

Importing this package is cheap on purpose: it never imports torch, never loads NVML and never touches
CUDA (tests/test_import.py keeps it so). The parts load what they need when they are used.
"""

__version__ = "0.1.0"


def prepare(*args, **kwargs):  # the signature and documentation live in redline.runtime.prepare
    """Apply a plan to your model, optimizer and DataLoader: see ``redline.runtime.prepare.prepare``."""
    from redline.runtime.prepare import prepare as _prepare

    return _prepare(*args, **kwargs)
