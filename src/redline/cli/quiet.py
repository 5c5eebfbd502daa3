"""Third-party messages that make a working command look broken, kept off the terminal for every command.

Each one below was seen on stderr of a command that worked (``redline plan`` on a Hugging Face config.json,
``redline infer --backends onnxruntime``) with torch 2.13, torchao 0.18 and transformers 5.25, and none is about
anything the user did or can change: each is one library telling its own developers about another. Each is
matched by its logger or warning category and the start of its own words, so that everything else these
libraries say (a real failure, a warning about the user's model) still gets through, and redline's own warnings
are never touched. ``REDLINE_DEBUG=1`` lets all of them through, for a bug report.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from redline.env import REDLINE_DEBUG

# (logger, how its message starts): log records dropped
KNOWN_LOG_NOISE: tuple[tuple[str, str], ...] = (
    # torchao, which transformers imports when it is installed, tries to load its CUDA kernels at import and
    # says so for each .so that does not match this machine (a CPU build of torch): redline never uses them
    ("torchao", "Failed to load "),
    # ... and while it imports it registers enums with torch's pytree, which torch says is deprecated (a note
    # to torchao's developers, printed in torch's log format as if a warning of the command's)
    ("torch.utils._pytree", "%s is an Enum subclass and is now natively supported"),
    # torch.onnx's exporter, at each export, names the torchvision operators it skips when torchvision is not
    # installed (four lines per export); a model that uses one of them fails its export with its own error
    ("torch.onnx._internal.exporter._registration", "torchvision is not installed"),
)

# (category, how its message starts, the module that warns, or None: any): warnings ignored
KNOWN_WARNING_NOISE: tuple[tuple[type[Warning], str, str | None], ...] = (
    # the module tracker inside PyTorch's FlopCounterMode and MemTracker, which the workload tracer runs, warns
    # "please file a bug to PyTorch" when a module is entered again before it returns (a Llama config's traced
    # model does it). The tracer reads their totals (the FLOPs, the step's peak), never their per-module tree,
    # and splits the model into blocks with hooks of its own
    (UserWarning, "The module hierarchy tracking maybe be messed up", r"torch\.distributed\._tools\.mod_tracker"),
    # torch's pytree deprecates LeafSpec; its own export (ONNX, torch.export) still makes one when it copies a
    # tree spec, which Python attributes to copyreg
    (FutureWarning, "`isinstance(treespec, LeafSpec)` is deprecated", None),
)


class _DropKnown(logging.Filter):
    """Drops a logger's records whose message (before its arguments are put in) starts with ``start``."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


@contextmanager
def third_party_noise_silenced() -> Iterator[None]:
    """Within it, the known noise above is dropped (unless ``REDLINE_DEBUG`` is set); on leaving, the logging
    and warning filters are as they were (the CLI's tests run commands in process)."""
    if os.environ.get(REDLINE_DEBUG):
        yield
        return
    # a filter on the logger that emits: torch resets the levels of its loggers as it imports, never their filters
    dropped = [(logging.getLogger(name), _DropKnown(start)) for name, start in KNOWN_LOG_NOISE]
    with warnings.catch_warnings():
        for category, start, module in KNOWN_WARNING_NOISE:
            warnings.filterwarnings("ignore", message=re.escape(start), category=category, module=module or "")
        for logger, drop in dropped:
            logger.addFilter(drop)
        try:
            yield
        finally:
            for logger, drop in dropped:
                logger.removeFilter(drop)
