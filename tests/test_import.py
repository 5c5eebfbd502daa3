"""`import redline` stays light: no torch, no NVML, no CUDA. The CLI's start-up must not pay for them either."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "pynvml", "numpy", "pydantic")


def modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.split())


def test_import_redline_loads_nothing_heavy():
    loaded = modules_after("import redline")
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}


def test_cli_and_doctor_rules_load_without_torch_or_nvml():
    loaded = modules_after("import redline.cli.main\nfrom redline.doctor.engine import all_rules\nall_rules()")
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "pynvml")}


def test_every_module_of_plan_and_doctor_loads_nothing_heavy():
    """The planner and the doctor run where no torch is installed; only calibration (which runs real steps)
    imports torch, inside the function that measures."""
    code = (
        "import importlib, pkgutil\n"
        "import redline.plan, redline.doctor, redline.doctor.rules\n"
        "for package in (redline.plan, redline.doctor, redline.doctor.rules):\n"
        "    for module in pkgutil.iter_modules(package.__path__):\n"
        "        importlib.import_module(f'{package.__name__}.{module.name}')"
    )
    loaded = modules_after(code)
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}


def test_probe_software_does_not_initialise_cuda():
    code = (
        "from redline.hw.software import probe_software\n"
        "from redline.hw.sysfs import SysFs\n"
        "probe_software(SysFs('/'))\n"
        "import torch\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_redline_prepare_shows_its_real_signature_and_docstring_without_torch():
    """``help(redline.prepare)`` used to show ``(*args, **kwargs)``: the signature lives in a torch-free module."""
    code = (
        "import inspect, json, sys, redline\n"
        "signature = inspect.signature(redline.prepare)\n"
        "print(json.dumps([(p.name, p.kind.name, p.default is p.empty or p.default) "
        "for p in signature.parameters.values()]))\n"
        "assert 'loss_fn' in redline.prepare.__doc__ and signature.return_annotation == 'Run'\n"
        "assert not {m for m in sys.modules if m.split('.')[0] == 'torch'}, 'inspecting prepare imported torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    required = True  # no default
    assert [tuple(p) for p in json.loads(out)] == [
        ("model", "POSITIONAL_OR_KEYWORD", required),
        ("optimizer", "POSITIONAL_OR_KEYWORD", required),
        ("data", "POSITIONAL_OR_KEYWORD", required),
        ("plan", "KEYWORD_ONLY", None),
        ("scheduler", "KEYWORD_ONLY", None),
        ("loss_fn", "KEYWORD_ONLY", None),
        ("overrides", "VAR_KEYWORD", required),
    ]


def test_redline_prepare_is_the_runtimes_prepare():
    """One function, whichever way it is imported (the runtime's module re-exports it)."""
    code = "import redline\nfrom redline.runtime.prepare import prepare\nassert redline.prepare is prepare\n"
    subprocess.run([sys.executable, "-c", code], check=True)
