"""How redline asks NVML anything: every call goes through ``Query``, which turns each "cannot say" into None.

NVML answers "not supported" for whole families of queries depending on the board (a GeForce has no
ECC, a PCIe card no NVLink, anything before Hopper no fabric state), the driver (an old driver lacks
newer entry points) and the bindings (an old nvidia-ml-py lacks newer functions). Those answers are
data, not failures, so ``Query`` turns them into ``None`` the way nvitop's ``nvmlQuery(default=NA)``
does. Only two answers change the flow: NVML failing to start or going away (``NvmlGone``) and
GPU_IS_LOST (the GPU fell off the bus: ``GpuLost``, ask it nothing more). Anything else unexpected
becomes ``None`` plus a one-line note; an error that says something about the GPU itself
(CORRUPTED_INFOROM, RESET_REQUIRED, TIMEOUT, UNKNOWN, GPU_IS_LOST...) is also recorded in that GPU's
``health_errors``, so the doctor can judge it without parsing notes.
"""

from __future__ import annotations

import re
from typing import Any

from redline.errors import one_line
from redline.hw.sysfs import SysFs

# NVML errors that mean "this GPU, driver or binding cannot answer that": the field is simply absent.
_ABSENT_ERRORS = (
    "NVMLError_NotSupported",
    "NVMLError_FunctionNotFound",  # the driver is older than the call
    "NVMLError_NoPermission",  # containers and non-root users are refused some counters
    "NVMLError_InvalidArgument",  # e.g. an NVLink index past the GPU's last link
    "NVMLError_NotFound",
    "NVMLError_NoData",
    "NVMLError_NotReady",
    "NVMLError_ArgumentVersionMismatch",  # a versioned struct newer than the driver
    "NVMLError_Deprecated",
)
# NVML errors that say something about the GPU's health: the field is absent, the error is noted and
# also recorded in Gpu.health_errors. GPU_IS_LOST is one too, handled on its own (it ends the GPU's probe).
# Any other error (a binding or OS problem: Uninitialized, InsufficientSize, OperatingSystem...) is only
# noted.
_HEALTH_ERRORS = (
    "NVMLError_ResetRequired",
    "NVMLError_CorruptedInforom",
    "NVMLError_InsufficientPower",  # an external power cable missing or loose
    "NVMLError_IrqIssue",
    "NVMLError_Timeout",
    "NVMLError_Unknown",  # what a GPU in trouble often answers; never evidence of "not supported"
    "NVMLError_Memory",
    "NVMLError_InsufficientResources",
)
# NVML errors that mean NVML itself went away under a running reader: the kernel module was unloaded or
# reloaded (a driver upgrade, a GPU reset by the operator), or the library and module no longer match.
# Every call on every GPU would fail the same way, so a live reader stops and starts NVML again later.
_GONE_ERRORS = (
    "NVMLError_Uninitialized",
    "NVMLError_DriverNotLoaded",
    "NVMLError_LibRmVersionMismatch",
    "NVMLError_LibraryNotFound",
)
# Absent answers that stay absent while the driver runs: a live reader asks once and then no more.
# (NoData, NotReady... can change from one second to the next, so they are asked again.)
_PERMANENTLY_ABSENT_ERRORS = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound", "NVMLError_NoPermission")


class GpuLost(Exception):
    """NVML answered GPU_IS_LOST: the GPU fell off the bus and every further call would say so again."""


class NvmlGone(Exception):
    """NVML would not start, or stopped answering altogether (see ``_GONE_ERRORS``).

    ``code`` is one of ``GpuSection.error_code``'s values where NVML would not start, else "gone".
    """

    def __init__(self, message: str, code: str = "gone") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def load_bindings() -> Any | None:
    """The ``pynvml`` module, or None where nvidia-ml-py is not installed. Imported on demand rather than
    with this module, so that ``import redline`` works on machines without the bindings."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class Query:
    """Calls NVML on behalf of one GPU (or the system) and turns every "cannot say" into None.

    ``health`` is the GPU's ``health_errors``, where errors about the GPU's health are recorded; None for
    system-wide and pair queries, which belong to no one GPU (those errors are only noted). ``fs`` reads
    what NVML leaves to /proc and /sys.
    """

    # errors that end the whole reader (NvmlGone); none for the one-shot probe, which reports them as notes
    gone: tuple[type[BaseException], ...] = ()

    def __init__(
        self, nvml: Any, notes: list[str], where: str, fs: SysFs, health: dict[str, str] | None = None
    ) -> None:
        self.nvml = nvml
        self.notes = notes
        self.where = where
        self.fs = fs
        self.health = health
        self._absent = _error_classes(nvml, _ABSENT_ERRORS)
        self._health = _error_classes(nvml, _HEALTH_ERRORS)

    def __call__(self, fn_name: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:  # the bindings are older than the call
            return None
        try:
            value = fn(*args, **kwargs)
        except self.nvml.NVMLError_GpuIsLost as exc:
            self._unhealthy(fn_name, exc)
            raise GpuLost from None
        except self.gone as exc:
            raise NvmlGone(f"{fn_name}: {describe_error(self.nvml, exc)}") from None
        except self._absent as exc:
            self._absent_answer(fn_name, args, kwargs, exc)
            return None
        except self._health as exc:
            self._unhealthy(fn_name, exc)
            return None
        except Exception as exc:
            self.note(f"{fn_name}: {describe_error(self.nvml, exc)}")
            return None
        return as_text(value)

    def _absent_answer(self, fn_name: str, args: tuple[Any, ...], kwargs: dict[str, Any], exc: BaseException) -> None:
        """NVML said it cannot answer this call; the probe needs no more than the None it returns."""

    def _unhealthy(self, fn_name: str, exc: BaseException) -> None:
        self.note(f"{fn_name}: {describe_error(self.nvml, exc)}")
        if self.health is not None:
            self.health.setdefault(fn_name, error_name(exc))

    def first(self, fn_names: tuple[str, ...], *args: Any) -> Any:
        """The first answer from equivalent calls, newest first (e.g. a _v2 and its original)."""
        for fn_name in fn_names:
            value = self(fn_name, *args)
            if value is not None:
                return value
        return None

    def const(self, name: str, fallback: int) -> int:
        return getattr(self.nvml, name, fallback)

    def enum_name(self, what: str, table: tuple[tuple[str, int, str], ...], value: int | None) -> str | None:
        """redline's name for an NVML enum value; a value newer than this table is noted and read as None."""
        if value is None:
            return None
        for const, fallback, name in table:
            if self.const(const, fallback) == value:
                return name
        self.note(f"{what} {value} is not one redline knows (a newer driver?)")
        return None

    def note(self, text: str) -> None:
        self.notes.append(f"{self.where}: {text}")


def error_name(exc: BaseException) -> str:
    """NVML's name for an error, as in its header: NVMLError_CorruptedInforom -> 'CORRUPTED_INFOROM'.

    pynvml names each NVMLError subclass by camel-casing the NVML_ERROR_* constant, so undoing that gives
    the constant back without a table to keep in step with the bindings. An NVMLError with a code the
    bindings do not know reads 'ERROR_<code>'; anything else is its class name ('RuntimeError').
    """
    name = type(exc).__name__
    if name.startswith("NVMLError_"):
        return re.sub(r"(?<!^)(?=[A-Z])", "_", name.removeprefix("NVMLError_")).upper()
    if name == "NVMLError":
        return f"ERROR_{getattr(exc, 'value', '?')}"
    return name


def _error_classes(nvml: Any, names: tuple[str, ...]) -> tuple[type[BaseException], ...]:
    """The binding's exception classes by name; an older binding may lack some."""
    return tuple(getattr(nvml, name) for name in names if hasattr(nvml, name))


def describe_error(nvml: Any, exc: BaseException) -> str:
    if isinstance(exc, nvml.NVMLError):
        return str(exc)
    return f"{one_line(exc)}"


def as_text(value: Any) -> Any:
    """Old bindings (and struct fields in every binding) hand back bytes where we want str."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


# Why NVML will not start, for rules (GpuSection.error_code) and for the user: each has a known fix.
_INIT_ERRORS = (
    ("NVMLError_LibraryNotFound", "library_not_found", "NVML library not found (no NVIDIA driver)"),
    (
        "NVMLError_DriverNotLoaded",
        "driver_not_loaded",
        "NVIDIA driver not loaded (the nvidia kernel module is not running)",
    ),
    (
        "NVMLError_LibRmVersionMismatch",
        "driver_mismatch",
        "NVIDIA driver/library version mismatch: the driver was upgraded but the old kernel module "
        "is still loaded; reboot or reload the nvidia kernel modules",
    ),
    (
        "NVMLError_NoPermission",
        "no_permission",
        "no permission to use NVML (cannot open the /dev/nvidia* devices)",
    ),
)


def init_error(nvml: Any, exc: BaseException) -> tuple[str, str]:
    """(error_code, message) for an nvmlInit that failed."""
    for class_name, code, message in _INIT_ERRORS:
        cls = getattr(nvml, class_name, None)
        if cls is not None and isinstance(exc, cls):
            return code, message
    return "other", f"NVML failed to start: {describe_error(nvml, exc)}"


class LiveQuery(Query):
    """A ``Query`` for a reader that asks the same questions every second for hours.

    Two differences from the probe's: an error that says NVML itself is gone raises ``NvmlGone`` (the
    reader must stop and start NVML again, see ``_GONE_ERRORS``); and a call NVML answered "not supported"
    (or "no permission") is not asked again, since the answer will not change while the driver runs and
    a GeForce card would otherwise spend a third of its calls on ECC and GPM questions.
    """

    def __init__(self, nvml: Any, notes: list[str], where: str, fs: SysFs) -> None:
        super().__init__(nvml, notes, where, fs)
        self.gone = _error_classes(nvml, _GONE_ERRORS)
        self._never = _error_classes(nvml, _PERMANENTLY_ABSENT_ERRORS)
        self._skip: set[tuple[Any, ...]] = set()  # bounded: one entry per distinct call this reader makes

    def __call__(self, fn_name: str, *args: Any, **kwargs: Any) -> Any:
        if self._skip and _call_key(fn_name, args, kwargs) in self._skip:
            return None
        return super().__call__(fn_name, *args, **kwargs)

    def _absent_answer(self, fn_name: str, args: tuple[Any, ...], kwargs: dict[str, Any], exc: BaseException) -> None:
        if isinstance(exc, self._never):
            self._skip.add(_call_key(fn_name, args, kwargs))


def _call_key(fn_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What tells one call from another on the same GPU: its name and plain-number arguments (the clock
    type, the sensor, a memory struct version); the handle is the same for every call of one ``LiveQuery``."""
    numbers = tuple(a for a in args if isinstance(a, int))
    named = tuple((k, v) for k, v in kwargs.items() if isinstance(v, int))
    return (fn_name, numbers, named)
