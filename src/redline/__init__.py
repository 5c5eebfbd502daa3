"""redline: make a GPU server deliver the compute it should.

Importing this package is cheap on purpose: it never imports torch, never loads NVML and never touches
CUDA (tests/unit/test_import.py keeps it so). The parts load what they need when they are used.
"""

__version__ = "0.1.0"
