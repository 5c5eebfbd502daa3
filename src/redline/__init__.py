"""redline: make a GPU server deliver the compute it should.

Importing this package is cheap on purpose: it never imports torch, never loads NVML and never touches
CUDA (tests/test_import.py keeps it so). The parts load what they need when they are used: ``prepare`` is
defined in a torch-free module with its real signature and imports the runtime when called.
"""

from redline.runtime.api import prepare

__version__ = "0.1.0"

__all__ = ["__version__", "prepare"]
