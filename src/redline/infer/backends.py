"""The ways to run a served model, each built from the same fp32 module and one example batch.

A backend turns ``Served`` (one tensor in, one out) into a ``Runner`` for one batch shape: eager PyTorch,
``torch.compile`` (its default mode and max-autotune), ``torch.export`` + AOTInductor (an ahead-of-time
compiled ``.pt2`` package), ONNX export + ONNX Runtime (the CPU provider here, CUDA's and TensorRT's on a GPU),
Torch-TensorRT, and dynamic int8 quantisation of the linear layers. Optional ones (onnxruntime, torch_tensorrt,
a GPU) say in one line why they cannot run (``Backend.absent``) instead of failing.

Precision is applied before a backend sees the module (``cast``): bf16/fp16 convert the weights (and float
inputs); int8 swaps ``nn.Linear`` for dynamically quantised ones (int8 weights, activations quantised per call)
with torch's ``quantize_dynamic`` for the PyTorch backends, and with ONNX Runtime's own ``quantize_dynamic`` on the
exported graph for ONNX Runtime. The shapes are static: each batch size is built (exported, compiled) anew, and
that build is the cold start a server pays for it. The exported graphs can also be built for any batch size
(``Build.any_batch``): how an artifact saves them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from redline.capability import is_available
from redline.errors import BadInput

TENSORRT_PROVIDER = "TensorrtExecutionProvider"
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32}


@dataclasses.dataclass
class Build:
    """What a backend is built from: the module (precision applied, on the device), one batch, a folder."""

    module: nn.Module
    float_module: nn.Module  # the fp32 original: ONNX Runtime quantises from it (torch's int8 layers do not export)
    example: torch.Tensor
    precision: str
    device: str
    workdir: Path  # where an export writes its files (kept when the backend is picked)
    any_batch: bool = False  # exported graphs: the batch dimension free (from 1), not the example's size


def batch_free(build: Build) -> tuple[dict[int, torch.export.Dim], ...] | None:
    """torch.export's ``dynamic_shapes`` for the one input: its first dimension any size from 1, or None (every
    size as the example's). The example itself must have 2 or more rows: export pins a dimension of size 0 or 1."""
    return ({0: torch.export.Dim("batch", min=1)},) if build.any_batch else None


class Runner:
    """A built backend: call it on a batch of the shape it was built for. ``files`` are what an artifact keeps."""

    def __init__(self, call: Callable[[torch.Tensor], torch.Tensor], files: tuple[Path, ...] = ()) -> None:
        self.call = call
        self.files = files

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.call(x)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way to run a served model, and its traits: the measurement, the listing and the artifact read these,
    never the backend's name."""

    name: str
    summary: str
    build: Callable[[Build], Runner]
    absent: Callable[[str, str], str | None] = lambda device, precision: None  # why not here, else None
    fixed_precision: str | None = None  # int8-dynamic is int8 whatever --precision says
    default_on_cpu: bool = True  # max-autotune searches GEMM templates for many minutes on a CPU: opt-in there
    # an exported graph that an artifact keeps and loads with no model code: (the graph's file, the device it was
    # picked on, the device to run on) -> a runner; None: an artifact rebuilds the model and builds it again
    load_graph: Callable[[Path, str, str], Runner] | None = None
    # why its artifact takes the picked batch size only, whatever the model; None: any batch size (an exported
    # graph: where the model exports with its batch dimension free, which the artifact tries)
    pinned_batch: str | None = None

    @property
    def exported(self) -> bool:
        return self.load_graph is not None

    @property
    def one_shape(self) -> bool:
        """Whether its artifact may take the picked batch size only (``fixed_batch`` in the manifest says)."""
        return self.exported or self.pinned_batch is not None


def cast(module: nn.Module, precision: str, device: str) -> nn.Module:
    """A copy of ``module`` at ``precision`` on ``device`` (the fp32 original stays the reference)."""
    module = copy.deepcopy(module).to(device)
    if precision == "int8":
        _conv1d_as_linear(module)
        # torch.ao's eager quantisation warns that it moves to torchao; torchao's int8 layers are fast only under
        # torch.compile, while these (fbgemm's kernels) are fast in eager on the CPU, so they stay for now
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", (DeprecationWarning, UserWarning))
            return torch.ao.quantization.quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8)
    return module.to(DTYPES[precision])


def _conv1d_as_linear(module: nn.Module) -> None:
    """Hugging Face's ``Conv1D`` (GPT-2's projections: a linear layer whose weight is stored in x out) swapped
    for the ``nn.Linear`` it is, in place, so that quantisation finds it."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ != "Conv1D" or not hasattr(child, "nf"):
                continue
            weight, bias = child.weight, child.bias
            if not isinstance(weight, torch.Tensor):  # not Hugging Face's Conv1D after all: left as it is
                continue
            inputs, outputs = weight.shape
            linear = nn.Linear(inputs, outputs, bias=bias is not None, device=weight.device)
            with torch.no_grad():
                linear.weight.copy_(weight.t())
                if isinstance(bias, torch.Tensor):
                    linear.bias.copy_(bias)
            setattr(parent, name, linear)


def cast_input(x: torch.Tensor, precision: str) -> torch.Tensor:
    """Float inputs take the weights' dtype; token ids stay integers."""
    return x.to(DTYPES[precision]) if x.is_floating_point() else x


# ---------------------------------------------------------------------------------------------- the backends


def _eager(build: Build) -> Runner:
    return Runner(build.module)


def _compile(mode: str | None) -> Callable[[Build], Runner]:
    def compiled(build: Build) -> Runner:
        # static shapes, as the exported backends have them; the caller resets dynamo's caches between batch
        # sizes (Inductor's on-disk caches stay: the cold start is a restart's on this machine)
        return Runner(torch.compile(build.module, mode=mode, dynamic=False))

    return compiled


def _aoti(build: Build) -> Runner:
    """torch.export's graph, compiled ahead of time by Inductor into a package that loads without Python code."""
    from torch._inductor import aoti_compile_and_package, aoti_load_package

    with torch.inference_mode(False), torch.no_grad():
        program = torch.export.export(build.module, (build.example,), strict=False, dynamic_shapes=batch_free(build))
    path = aoti_compile_and_package(program, package_path=str(build.workdir / "model.pt2"))
    return Runner(aoti_load_package(path), (Path(path),))


def _aoti_load(path: Path, picked_on: str, device: str) -> Runner:
    """A saved AOTInductor package: its kernels were compiled for the device it was picked on, and run there only."""
    if device != picked_on:
        raise BadInput(f"{path.parent}: an AOTInductor package compiled for {picked_on}, not {device}")
    from torch._inductor import aoti_load_package

    return Runner(aoti_load_package(str(path)))


def _onnx_absent(device: str, precision: str, provider: str = "CPUExecutionProvider") -> str | None:
    if not (is_available("onnxruntime") and is_available("onnx") and is_available("onnxscript")):
        return (
            "needs onnxruntime, onnx and onnxscript: pip install onnxruntime onnx onnxscript, the infer extra "
            "(onnxruntime-gpu on a GPU)"
        )
    import onnxruntime

    wanted = "CUDAExecutionProvider" if device == "cuda" and provider == "CPUExecutionProvider" else provider
    if wanted not in onnxruntime.get_available_providers():
        return f"onnxruntime {onnxruntime.__version__} has no {wanted} here"
    if precision == "bf16":
        return "ONNX Runtime's inputs and outputs go through NumPy, which has no bfloat16"
    if device == "cpu" and precision == "fp16":
        return "ONNX Runtime's CPU provider has few fp16 kernels: it runs fp32 and int8 on the CPU"
    if device == "cuda" and precision == "int8":
        return "int8 here is dynamic quantisation, which ONNX Runtime runs on the CPU"
    return None


def onnx_export(module: nn.Module, example: torch.Tensor, path: Path, dynamic_shapes: tuple | None = None) -> Path:
    """The module as an ONNX graph at ``path`` (torch.export's exporter, with ONNX Script's optimiser);
    ``dynamic_shapes`` as torch.export takes them (``batch_free``). Those go through ``torch.export`` first, which
    raises where the code pins a free dimension: the ONNX exporter would export again with the dimension narrowed
    or pinned, say nothing, and leave it free in the graph, where ONNX Runtime would run sizes outside the range
    the graph is right for."""
    # the exporter reports its stages on stdout, which is the CLI's (and --json's): kept off it
    with torch.inference_mode(False), torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        model: nn.Module | torch.export.ExportedProgram = module
        if dynamic_shapes is not None:
            model = torch.export.export(module, (example,), strict=False, dynamic_shapes=dynamic_shapes)
        program = torch.onnx.export(
            model, (example,), dynamo=True, input_names=["x"], output_names=["y"], verbose=False
        )
    if program is None:  # documented to come with dynamo=True (None is the TorchScript exporter's answer)
        raise RuntimeError("torch.onnx.export(dynamo=True) returned no ONNX program")
    program.save(str(path))
    return path


def _onnxruntime(provider: str | None) -> Callable[[Build], Runner]:
    def build_session(build: Build) -> Runner:
        # ONNX Runtime quantises its own graph: at int8 the fp32 module is exported, then quantised
        module = build.float_module if build.precision == "int8" else build.module
        path = onnx_export(module, build.example, build.workdir / "model.onnx", batch_free(build))
        if build.precision == "int8":
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantized = build.workdir / "model.int8.onnx"
            large = path.with_name(path.name + ".data").exists()  # past protobuf's 2 GB: weights beside the graph
            quantize_dynamic(str(path), str(quantized), weight_type=QuantType.QInt8, use_external_data_format=large)
            path = quantized
        return onnx_runner(path, session_providers(provider, build.device))

    return build_session


def _onnx_load(provider: str | None) -> Callable[[Path, str, str], Runner]:
    def load(path: Path, picked_on: str, device: str) -> Runner:
        return onnx_runner(path, session_providers(provider, device))

    return load


def session_providers(provider: str | None, device: str) -> list[str]:
    """The providers to ask for, best first (ONNX Runtime falls back along the list)."""
    if provider is not None:
        return [provider, "CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]


def onnx_runner(path: Path, providers: list[str]) -> Runner:
    """An ONNX Runtime session on ``path``, on the first of ``providers`` or not at all (ONNX Runtime would fall
    back along the list quietly, and measure another provider under this one's name): tensors in and out
    through NumPy (host memory; no I/O binding yet)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    # idle intra-op threads spin by default, taking the cores from whatever runs next: the backends timed
    # after it in a round, the application's own threads in a server
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    available = set(onnxruntime.get_available_providers())
    session = onnxruntime.InferenceSession(str(path), options, providers=[p for p in providers if p in available])
    if session.get_providers()[0] != providers[0]:
        raise RuntimeError(f"ONNX Runtime runs this graph on {session.get_providers()[0]}, not {providers[0]}")

    def run(x: torch.Tensor) -> torch.Tensor:
        (y,) = session.run(["y"], {"x": x.detach().cpu().numpy()})
        return torch.from_numpy(y).to(x.device)

    return Runner(run, (path,))


def _torch_tensorrt(build: Build) -> Runner:
    import torch_tensorrt

    dtype = DTYPES[build.precision]
    compiled = torch_tensorrt.compile(
        build.module, ir="dynamo", inputs=[build.example], enabled_precisions={dtype}, min_block_size=1
    )
    return Runner(compiled)


def _gpu_only(what: str) -> Callable[[str, str], str | None]:
    def absent(device: str, precision: str) -> str | None:
        if device != "cuda":
            return f"{what} runs on an NVIDIA GPU, and there is none here"
        return None

    return absent


def _tensorrt_absent(device: str, precision: str) -> str | None:
    if not is_available("torch_tensorrt"):
        return "needs Torch-TensorRT: pip install torch-tensorrt (the build matching this torch)"
    if precision == "int8":
        return "int8 through TensorRT needs calibration data: not run"
    return _gpu_only("Torch-TensorRT")(device, precision)


def _int8_absent(device: str, precision: str) -> str | None:
    if device != "cpu":
        return "torch's dynamic int8 linear layers run on the CPU only"
    if precision == "int8":
        return "the same as eager at --precision int8"
    return None


def _ort_trt_absent(device: str, precision: str) -> str | None:
    return _gpu_only("ONNX Runtime's TensorRT provider")(device, precision) or _onnx_absent(
        device, precision, TENSORRT_PROVIDER
    )


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("eager", "PyTorch eager, inference mode (the reference)", _eager),
        Backend("compile", "torch.compile, default mode (Inductor)", _compile(None)),
        Backend(
            "compile-max-autotune",
            "torch.compile, mode max-autotune (searches kernel configs; CUDA graphs on a GPU)",
            _compile("max-autotune"),
            default_on_cpu=False,
        ),
        Backend("export-aoti", "torch.export + AOTInductor package (.pt2)", _aoti, load_graph=_aoti_load),
        Backend(
            "onnxruntime",
            "ONNX export + ONNX Runtime (CPU or CUDA provider)",
            _onnxruntime(None),
            _onnx_absent,
            load_graph=_onnx_load(None),
        ),
        Backend(
            "onnxruntime-trt",
            "ONNX export + ONNX Runtime's TensorRT provider",
            _onnxruntime(TENSORRT_PROVIDER),
            _ort_trt_absent,
            load_graph=_onnx_load(TENSORRT_PROVIDER),
            pinned_batch="ONNX Runtime's TensorRT provider builds an engine per input shape: the measured one is kept",
        ),
        Backend(
            "tensorrt",
            "Torch-TensorRT (dynamo)",
            _torch_tensorrt,
            _tensorrt_absent,
            pinned_batch="Torch-TensorRT's engines are built for one input shape: on load, for the picked batch",
        ),
        Backend("int8-dynamic", "int8 linear layers, dynamic activation scales", _eager, _int8_absent, "int8"),
    )
}
REFERENCE = "eager"  # the backend every other is checked and timed against


def default_backends(device: str) -> list[str]:
    return [name for name, b in BACKENDS.items() if device == "cuda" or b.default_on_cpu]


def named(names: list[str]) -> list[Backend]:
    """The backends ``names`` names, in order; BadInput, one line, for any this redline does not know."""
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise BadInput(f"unknown backend(s) {', '.join(unknown)}; known: {', '.join(BACKENDS)}")
    return [BACKENDS[n] for n in names]
