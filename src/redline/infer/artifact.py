"""The picked backend saved as a folder that ``redline.infer.load`` turns back into a callable.

    best/
      manifest.json   backend, precision, batch, device, how to rebuild the model, the figures it was picked on
      weights.pt      the fp32 state_dict (eager, compile, int8-dynamic, tensorrt rebuild the module from it)
      model.pt2       export-aoti: the AOTInductor package (loads with no model code)
      model.onnx      onnxruntime: the graph (model.int8.onnx at int8, already quantised; ``.data`` beside it
                      past 2 GB); loads with no model code
      check.pt        one input batch and the output it gave when picked: ``Served.verify()`` compares
      NAME.py         a factory's module when it is one file (not a package), which a load imports from here

An artifact is code (a compiled model, a factory's module): ``load`` refuses a folder that someone other than
this user or root could have written or swapped (``redline.files.check_trusted``), and imports a factory from
the artifact's folder or an installed package, never from the folder the loading program runs in.

The exported graphs were measured with static shapes; the artifact exports the picked one again with its batch
dimension free and keeps that graph when it gives eager's outputs at the picked batch and at another (a model
whose code pins the batch size cannot be exported so): the artifact then takes any batch size, as the
non-exported kinds do. Otherwise it keeps the measured graph, which takes the picked batch size only, and the
manifest says why (``fixed_batch``). ONNX Runtime's TensorRT provider keeps its static graph (it builds an engine
per input shape), and Torch-TensorRT, rebuilt from the weights on load, builds its engines for the picked batch.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import torch

from redline import __version__
from redline.errors import BadInput, one_line
from redline.files import check_trusted, drop_write_for_others, kind_of, read_user_file
from redline.infer.backends import BACKENDS, Backend, Build, Runner, cast, cast_input
from redline.infer.measure import TOLERANCES, Parity, Row, compare, eager_reference
from redline.infer.models import Subject, rebuild

FORMAT = "redline-infer/1"
MANIFEST = "manifest.json"
CHECK_ROWS = 16
FILES = ("weights.pt", "check.pt")


def save(folder: Path, subject: Subject, row: Row, device: str) -> Path:
    """``row``'s backend as an artifact in ``folder`` (created; refused when it holds anything but an earlier
    artifact, so no user file is overwritten)."""
    folder = folder.expanduser()
    check_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_earlier(folder)
    files = list(FILES)
    backend = BACKENDS[row.backend]
    model_file, fixed = None, backend.pinned_batch
    if backend.exported:
        with tempfile.TemporaryDirectory(prefix="redline-infer-") as workdir:
            source = None
            if fixed is None:  # a graph no trait of its backend pins: exported again for any batch size, if it can
                source, fixed = _export_any_batch(subject, row, backend, device, Path(workdir))
            source = source or next(p for p in row.files if p.suffix in (".pt2", ".onnx"))
            # the graph and what it names beside it (an ONNX model past 2 GB keeps its weights in ``<name>.data``)
            for part in sorted(source.parent.glob(source.name + "*")):
                shutil.copyfile(part, folder / part.name)
                files.append(part.name)
        model_file = source.name
    module = None if backend.exported else factory_module(subject)
    if module is not None:  # a load imports it from here, not from wherever it runs
        shutil.copyfile(module, folder / module.name)
        files.append(module.name)
    torch.save(subject.served.inner.state_dict(), folder / "weights.pt")
    x = subject.example(row.batch, seed=1)
    with torch.inference_mode():
        expected = subject.served.to("cpu")(x)
    torch.save({"x": x, "y": check_rows(expected)}, folder / "check.pt")
    manifest = {
        "format": FORMAT,
        "redline": __version__,
        "torch": torch.__version__,
        "model": subject.name,
        "source": subject.source,
        "kind": subject.kind,
        "sample_shape": list(subject.sample_shape),
        "backend": row.backend,
        "model_file": model_file,
        "files": files,
        "precision": row.precision,
        "batch": row.batch,
        "fixed_batch": fixed,  # why it takes ``batch`` only; None: any batch size
        "device": device,
        "picked_on": {
            "p50_ms": row.p50_ms,
            "p99_ms": row.p99_ms,
            "samples_per_s": row.samples_per_s,
            "parity": dataclasses.asdict(row.parity) if row.parity else None,
        },
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    drop_write_for_others(folder)  # whatever the umask: a load refuses what others may write
    return folder


def factory_module(subject: Subject) -> Path | None:
    """The file of the module that defines ``subject``'s factory when it is one file of the user's (not a
    package, not installed), which the artifact keeps a copy of; None otherwise."""
    spec = subject.source.get("factory")
    top = sys.modules.get(spec.split(":")[0].split(".")[0]) if spec else None
    path = Path(getattr(top, "__file__", None) or "__init__.py")
    if path.name == "__init__.py" or path.suffix != ".py":
        return None
    installed = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    return None if any(path.resolve().is_relative_to(Path(p).resolve()) for p in installed) else path


def _export_any_batch(
    subject: Subject, row: Row, backend: Backend, device: str, workdir: Path
) -> tuple[Path | None, str | None]:
    """``row``'s exported ``backend`` built again with the batch dimension free, in ``workdir``, and its whole
    outputs checked against eager fp32's at the picked batch and at another (1; 3 when it was picked at 1), at the
    precision's tolerance: (its graph, None), or (None, why the measured static graph stays)."""
    tolerance = TOLERANCES[row.precision]
    module = cast(subject.served, row.precision, device)
    example = cast_input(subject.example(max(2, row.batch)).to(device), row.precision)  # export pins a size of 1
    try:
        build = Build(module, subject.served, example, row.precision, device, workdir, any_batch=True)
        runner = backend.build(build)
    except Exception as exc:  # a model whose code pins the batch size (a branch on it, a parameter per row)
        return None, f"it does not export for any batch size: {one_line(exc)}"
    for size in (row.batch, 1 if row.batch > 1 else 3):
        x = subject.example(size, seed=2).to(device)
        try:  # eager too: a model that runs at the picked batch only
            expected = eager_reference(subject, x)
            served = runner(cast_input(x, row.precision))
        except Exception as exc:
            return None, f"exported for any batch size, it fails at batch {size}: {one_line(exc, typed=False)}"
        parity = compare(served, expected, subject.kind in ("classifier", "lm"), tolerance)
        if not parity.passes(tolerance):
            return None, f"exported for any batch size, it differs from eager at batch {size}: {parity.describe()}"
    return next(p for p in runner.files if p.suffix in (".pt2", ".onnx")), None


def check_folder(folder: Path) -> None:
    """Refuse (BadInput) a file, or a folder holding anything but an earlier artifact: no user file is replaced."""
    if folder.exists() and not folder.is_dir():
        raise BadInput(f"{folder} is {kind_of(folder.stat().st_mode)}: an artifact is saved as a folder")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / MANIFEST).exists():
        raise BadInput(f"{folder} is not empty and holds no redline artifact: choose a new folder")


def _remove_earlier(folder: Path) -> None:
    """The files of the artifact ``folder`` held, which a new one replaces (nothing else in it is touched)."""
    try:
        earlier = json.loads(read_user_file(folder / MANIFEST, "artifact manifest"))
    except (BadInput, json.JSONDecodeError):
        return
    for name in earlier.get("files", []):
        if "/" not in name and name not in ("", ".", ".."):
            (folder / name).unlink(missing_ok=True)
    (folder / MANIFEST).unlink()


def check_rows(y: torch.Tensor) -> torch.Tensor:
    """The first rows of an output, each whole along its last dimension (so top-1 still means something): a
    language model's logits at batch 32 would be hundreds of MB."""
    return y.detach().float().cpu().reshape(-1, y.shape[-1] if y.dim() else 1)[:CHECK_ROWS].clone()


class Artifact:
    """A loaded artifact: call it on a batch (on the CPU or the device it was picked on)."""

    def __init__(self, folder: Path, manifest: dict[str, Any], runner: Runner, device: str, classes: bool) -> None:
        self.folder = folder
        self.manifest = manifest
        self.runner = runner
        self.device = device
        self.classes = classes

    @property
    def batch(self) -> int | None:
        """The one batch size it takes (a graph or engine built for that batch only: ``fixed_batch`` says why),
        None where any will do."""
        why = self.manifest.get("fixed_batch", "saved by an earlier redline")  # which saved every graph static
        return self.manifest["batch"] if BACKENDS[self.manifest["backend"]].one_shape and why is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch is not None and x.shape[0] != self.batch:
            backend = self.manifest["backend"]
            raise ValueError(f"this {backend} artifact takes batches of {self.batch}, not {x.shape[0]}")
        return self.runner(cast_input(x.to(self.device), self.manifest["precision"]))

    def verify(self) -> tuple[bool, Parity]:
        """The saved input through this artifact against the fp32 output saved with it, at its tolerance."""
        check = torch.load(self.folder / "check.pt", map_location="cpu", weights_only=True)
        tolerance = TOLERANCES[self.manifest["precision"]]
        parity = compare(check_rows(self(check["x"])), check["y"], self.classes, tolerance)
        return parity.passes(tolerance), parity


def read_manifest(folder: Path) -> dict[str, Any]:
    """The artifact's manifest (BadInput where ``folder`` holds none this redline reads)."""
    try:
        manifest = json.loads(read_user_file(folder / MANIFEST, "artifact manifest"))
    except (BadInput, json.JSONDecodeError) as exc:
        raise BadInput(f"{folder}: not a redline inference artifact ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise BadInput(f"{folder}: artifact format {manifest.get('format')!r}, this redline reads {FORMAT}")
    if manifest.get("backend") not in BACKENDS:
        raise BadInput(f"{folder}: an artifact of backend {manifest.get('backend')!r}, which this redline lacks")
    return manifest


def load(path: str | Path, device: str | None = None) -> Artifact:
    """An artifact ``redline infer -o`` wrote, ready to call. ``device`` defaults to the one it was picked on."""
    trusted = check_trusted(Path(path).expanduser(), "artifact")  # before any of it is read: it holds code
    if trusted is None:
        raise BadInput(f"no such artifact: {path}")
    folder = trusted.path  # as checked: the path given may cross a symlink repointed since
    manifest = read_manifest(folder)
    device = device or manifest["device"]
    backend, precision = BACKENDS[manifest["backend"]], manifest["precision"]
    classes = manifest["kind"] in ("classifier", "lm")
    if device == "cuda" and not torch.cuda.is_available():
        raise BadInput(f"{folder}: picked on a GPU, and torch sees none here: load it with device='cpu'")
    trusted.confirm("artifact")  # still the folder checked, just before its code loads
    if backend.load_graph is not None:
        runner = backend.load_graph(folder / manifest["model_file"], manifest["device"], device)
        return Artifact(folder, manifest, runner, device, classes)
    subject = rebuild(manifest["source"], tuple(manifest["sample_shape"]), folder)
    subject.served.inner.load_state_dict(torch.load(folder / "weights.pt", map_location="cpu", weights_only=True))
    module = cast(subject.served, precision, device)
    x = cast_input(subject.example(manifest["batch"]).to(device), precision)
    runner = backend.build(Build(module, subject.served, x, precision, device, folder))
    return Artifact(folder, manifest, runner, device, classes)
