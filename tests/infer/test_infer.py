"""`redline infer`: parity rejects a broken backend, the pick honours the SLO, the saved artifact reloads in a fresh
process and matches, missing optional backends are one line, bad input exits 2, and the whole command end to end."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from redline.errors import BadInput
from redline.infer import artifact, backends, generate
from redline.infer.backends import Backend, Runner
from redline.infer.generate import generation
from redline.infer.measure import TOLERANCES, Row, Settings, compare, measure, pick, selected
from redline.infer.models import load_subject

HERE = Path(__file__).resolve().parent
TINY_GPT2 = {
    "model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 300, "n_positions": 64,
    "bos_token_id": 0, "eos_token_id": 0,
}  # fmt: skip
QUICK = Settings((2,), iters=2, min_s=0.0)


@pytest.fixture
def nets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))


def _python(code: str, *args: str, cwd: Path = HERE) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "REDLINE_DEBUG"} | {"COLUMNS": "120"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=900,
    )


# ----------------------------------------------------------------------------------------------------- parity


def test_a_backend_whose_outputs_are_wrong_is_reported_and_never_picked(nets: None, tmp_path: Path) -> None:
    """The broken backend answers with constants: by far the fastest, and excluded for parity."""

    def broken(build: backends.Build) -> Runner:
        wrong = torch.ones(build.example.shape[0], 10)
        return Runner(lambda x: wrong)

    subject = load_subject("tiny_nets:classifier")
    chosen = [*selected(["eager"], "cpu"), Backend("broken", "answers without computing", broken)]
    rows = measure(subject, chosen, QUICK, tmp_path)
    by_name = {r.backend: r for r in rows}
    assert by_name["broken"].status == "parity"
    assert "outputs differ from eager fp32" in by_name["broken"].note
    assert by_name["broken"].samples_per_s > by_name["eager"].samples_per_s  # fastest, still not picked
    assert pick(rows) is by_name["eager"]


def test_parity_figures_and_the_tolerance_of_each_precision() -> None:
    reference = torch.tensor([[1.0, -4.0, 2.0], [0.5, 3.0, -1.0]])
    exact = compare(reference.clone(), reference, classes=True)
    assert (exact.max_abs, exact.max_rel, exact.top1) == (0.0, 0.0, 1.0)
    drifted = compare(reference + 0.04, reference, classes=True)  # 0.04 over a largest magnitude of 4: 1e-2
    assert drifted.max_rel == pytest.approx(0.01)
    assert not drifted.passes(TOLERANCES["fp32"]) and drifted.passes(TOLERANCES["bf16"])
    flipped = compare(torch.tensor([[1.0, -4.0, 2.0], [3.0, 0.5, -1.0]]), reference, classes=True)
    assert flipped.top1 == 0.5 and not flipped.passes(TOLERANCES["int8"])
    assert compare(torch.full((2, 3), float("nan")), reference, classes=False).max_rel == float("inf")
    assert compare(torch.zeros(3, 2), reference, classes=True).max_rel == float("inf")  # a wrong shape


def test_top1_leaves_out_near_ties_an_allowed_error_may_flip() -> None:
    reference = torch.tensor([[1.0, 1.0005, -3.0], [5.0, 0.0, -5.0]])  # row 0: a near-tie; row 1 decides
    flipped_tie = torch.tensor([[1.0005, 1.0, -3.0], [5.0, 0.0, -5.0]])
    assert compare(flipped_tie, reference, classes=True).top1 == 0.5  # every row, without a tolerance
    within = compare(flipped_tie, reference, classes=True, tolerance=TOLERANCES["fp32"])
    assert within.top1 == 1.0 and within.passes(TOLERANCES["fp32"])  # 5e-4 / 5 apart: inside fp32's 1e-3
    flipped_clear = torch.tensor([[1.0, 1.0005, -3.0], [0.0, 5.0, -5.0]])
    assert compare(flipped_clear, reference, classes=True, tolerance=TOLERANCES["int8"]).top1 == 0.0


def test_a_language_model_serves_the_next_token_s_logits(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_GPT2))
    subject = load_subject(str(tmp_path / "config.json"), seq_len=16)
    x = subject.example(3)
    with torch.inference_mode():
        served = subject.served(x)
        every = subject.served.inner(input_ids=x, use_cache=False).logits
    assert served.shape == (3, 1, 300)
    assert torch.allclose(served, every[:, -1:], atol=1e-6)


def test_int8_quantises_gpt2_s_conv1d_projections_too(tmp_path: Path) -> None:
    """Hugging Face's GPT-2 keeps its projections in Conv1D (a linear layer stored in x out), which torch's
    quantiser does not know: cast turns them into nn.Linear first, so every projection is int8."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_GPT2))
    subject = load_subject(str(tmp_path / "config.json"), seq_len=16)
    quantised = backends.cast(subject.served, "int8", "cpu")
    kinds = [type(m).__name__ for m in quantised.modules()]
    assert "Conv1D" not in kinds
    assert kinds.count("Linear") == 4 * TINY_GPT2["n_layer"] + 1  # c_attn, c_proj, c_fc, mlp c_proj; lm_head
    assert all(
        type(m).__module__.startswith("torch.ao.nn.quantized")
        for m in quantised.modules()
        if type(m).__name__ == "Linear"
    )
    x = subject.example(2)
    with torch.inference_mode():
        parity = compare(quantised(x), subject.served(x), classes=True, tolerance=TOLERANCES["int8"])
    assert parity.passes(TOLERANCES["int8"]), parity


@pytest.mark.slow
def test_onnx_runtime_refuses_to_fall_back_to_another_provider(nets: None, tmp_path: Path) -> None:
    subject = load_subject("tiny_nets:classifier")
    path = backends.onnx_export(subject.served, subject.example(2), tmp_path / "model.onnx")
    assert backends.onnx_runner(path, ["CPUExecutionProvider"])(subject.example(2)).shape == (2, 10)
    with pytest.raises(RuntimeError, match="runs this graph on CPUExecutionProvider, not TensorrtExecutionProvider"):
        backends.onnx_runner(path, ["TensorrtExecutionProvider", "CPUExecutionProvider"])


def test_a_backend_that_fails_while_timed_is_reported_and_the_rest_go_on(nets: None, tmp_path: Path) -> None:
    def flaky(build: backends.Build) -> Runner:
        calls = [0]

        def run(x: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if calls[0] > 4:  # the first call and the warm-up pass; a timed one fails
                raise RuntimeError("out of memory in call 5")
            return build.module(x)

        return Runner(run)

    chosen = [*selected(["eager"], "cpu"), Backend("flaky", "fails in its fifth call", flaky)]
    rows = measure(load_subject("tiny_nets:classifier"), chosen, QUICK, tmp_path)
    by_name = {r.backend: r for r in rows}
    assert by_name["flaky"].status == "failed" and "while timed: RuntimeError: out of memory" in by_name["flaky"].note
    assert by_name["eager"].status == "ok" and by_name["eager"].calls >= QUICK.iters
    assert pick(rows) is by_name["eager"]


def test_int8_dynamic_quantisation_passes_at_its_own_tolerance(nets: None, tmp_path: Path) -> None:
    rows = measure(load_subject("tiny_nets:classifier"), selected(["int8-dynamic"], "cpu"), QUICK, tmp_path)
    int8 = next(r for r in rows if r.backend == "int8-dynamic")
    assert int8.precision == "int8" and int8.status == "ok", int8.note
    assert 0 < int8.parity.max_rel <= TOLERANCES["int8"].max_rel  # quantised: not exact, within tolerance


def test_the_pick_is_the_fastest_within_the_latency_slo() -> None:
    fast = Row("compile", 32, "fp32", "ok", p99_ms=40.0, samples_per_s=900.0, meets_slo=False)
    slow = Row("eager", 1, "fp32", "ok", p99_ms=5.0, samples_per_s=300.0, meets_slo=True)
    failed = Row("export-aoti", 1, "fp32", "failed", "no export")
    assert pick([fast, slow, failed]) is slow
    assert pick([fast]) is None
    fast.meets_slo = None  # no SLO given
    assert pick([fast, slow]) is fast


# -------------------------------------------------------------------------------------------------- artifact


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "onnxruntime", "int8-dynamic"])
def test_the_saved_artifact_reloads_in_a_fresh_process_and_matches(nets: None, tmp_path: Path, backend: str) -> None:
    subject = load_subject("tiny_nets:classifier")
    rows = measure(subject, selected([backend], "cpu"), QUICK, tmp_path / "work")
    row = next(r for r in rows if r.backend == backend)
    assert row.status == "ok", row.note
    folder = artifact.save(tmp_path / "best", subject, row, "cpu")
    assert artifact.read_manifest(folder)["fixed_batch"] is None  # ONNX Runtime's graph exported for any batch
    x = subject.example(3, seed=7)  # picked at batch 2
    torch.save(x, tmp_path / "x.pt")
    done = _python(
        """
        import sys, torch
        from redline.infer import load
        served = load(sys.argv[1])
        ok, parity = served.verify()
        assert ok, parity
        torch.save(served(torch.load(sys.argv[2])), sys.argv[3])
        """,
        str(folder),
        str(tmp_path / "x.pt"),
        str(tmp_path / "y.pt"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.inference_mode():
        expected = subject.served(x)
    tolerance = TOLERANCES[row.precision]
    assert compare(torch.load(tmp_path / "y.pt"), expected, classes=True).passes(tolerance)


@pytest.mark.slow
def test_an_aot_inductor_artifact_needs_no_model_code_and_takes_any_batch(nets: None, tmp_path: Path) -> None:
    """Measured at batch 2 (a static graph), saved exported again with the batch free: run where the model's code
    cannot be imported, it verifies and serves batches of 3 and 1 as eager does."""
    subject = load_subject("tiny_nets:classifier")
    rows = measure(subject, selected(["export-aoti"], "cpu"), QUICK, tmp_path / "work")
    row = next(r for r in rows if r.backend == "export-aoti")
    assert row.status == "ok", row.note
    folder = artifact.save(tmp_path / "best", subject, row, "cpu")
    assert (folder / "model.pt2").is_file() and artifact.read_manifest(folder)["fixed_batch"] is None
    x = subject.example(3, seed=7)
    torch.save(x, tmp_path / "x.pt")
    done = _python(  # run from a folder where tiny_nets cannot be imported: the package is the whole model
        """
        import sys, torch
        from redline.infer import load
        served = load(sys.argv[1])
        x = torch.load(sys.argv[2])
        print(served.verify()[0], served.batch)
        torch.save((served(x), served(x[:1])), sys.argv[3])
        """,
        str(folder),
        str(tmp_path / "x.pt"),
        str(tmp_path / "y.pt"),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "True None"
    three, one = torch.load(tmp_path / "y.pt")
    with torch.inference_mode():
        expected = subject.served(x)
    assert three.shape == (3, 10) and one.shape == (1, 10)
    assert compare(three, expected, classes=True).passes(TOLERANCES["fp32"])
    assert compare(one, expected[:1], classes=True).passes(TOLERANCES["fp32"])


def test_a_model_that_pins_its_batch_is_saved_for_that_batch_and_says_why(nets: None, tmp_path: Path) -> None:
    """A model whose code works at batch 2 only does not export for any batch: the artifact keeps the measured
    graph, its manifest says why, and the loaded artifact refuses another batch size in one line."""
    subject = load_subject("tiny_nets:pinned_batch")
    rows = measure(subject, selected(["onnxruntime"], "cpu"), QUICK, tmp_path / "work")
    row = next(r for r in rows if r.backend == "onnxruntime")
    assert row.status == "ok", row.note
    folder = artifact.save(tmp_path / "best", subject, row, "cpu")
    assert artifact.read_manifest(folder)["fixed_batch"].startswith("it does not export for any batch size: ")
    served = artifact.load(folder)
    assert served.batch == 2 and served.verify()[0]
    with pytest.raises(ValueError, match="this onnxruntime artifact takes batches of 2, not 3"):
        served(torch.zeros(3, 16))


def test_a_graph_for_any_batch_that_is_wrong_at_another_batch_is_not_saved(
    nets: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exported backend whose any-batch graph is right at the picked batch and wrong at batch 1: the measured
    static graph is saved instead, and the manifest says why. An artifact saved before graphs were exported for
    any batch (no ``fixed_batch`` in its manifest) takes its batch only."""
    subject = load_subject("tiny_nets:classifier")

    def build(spec: backends.Build) -> Runner:
        assert spec.any_batch and spec.example.shape[0] == 2
        graph = spec.workdir / "model.onnx"
        graph.write_bytes(b"any batch")
        return Runner(lambda x: spec.module(x) * (1.0 if x.shape[0] == 2 else 2.0), (graph,))

    # the registered record with another build: its traits (an exported graph, any batch) are what save reads
    wrong = dataclasses.replace(backends.BACKENDS["onnxruntime"], summary="wrong at other sizes", build=build)
    monkeypatch.setitem(backends.BACKENDS, "onnxruntime", wrong)
    (tmp_path / "static").mkdir()
    (tmp_path / "static" / "model.onnx").write_bytes(b"static")
    row = Row("onnxruntime", 2, "fp32", "ok", files=(tmp_path / "static" / "model.onnx",))
    folder = artifact.save(tmp_path / "best", subject, row, "cpu")
    manifest = artifact.read_manifest(folder)
    assert manifest["fixed_batch"].startswith("exported for any batch size, it differs from eager at batch 1: ")
    assert (folder / "model.onnx").read_bytes() == b"static"
    del manifest["fixed_batch"]
    assert artifact.Artifact(folder, manifest, Runner(lambda x: x), "cpu", classes=True).batch == 2
    # Torch-TensorRT is rebuilt on load for the picked batch: it says so, and takes that batch only
    folder = artifact.save(tmp_path / "trt", subject, Row("tensorrt", 4, "fp32", "ok"), "cpu")
    manifest = artifact.read_manifest(folder)
    assert manifest["fixed_batch"].startswith("Torch-TensorRT's engines are built for one input shape")
    assert artifact.Artifact(folder, manifest, Runner(lambda x: x), "cpu", classes=True).batch == 4


def test_saving_refuses_a_folder_that_holds_other_files(nets: None, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    row = Row("eager", 1, "fp32", "ok")
    with pytest.raises(BadInput, match="not empty and holds no redline artifact"):
        artifact.save(tmp_path, load_subject("tiny_nets:classifier"), row, "cpu")
    assert (tmp_path / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------------------------- an artifact is code


@pytest.fixture
def eager_artifact(nets: None, tmp_path: Path) -> Path:
    """The eager pick of tiny_nets:classifier saved as an artifact (its factory's module copied into it)."""
    subject = load_subject("tiny_nets:classifier")
    row = next(r for r in measure(subject, selected(["eager"], "cpu"), QUICK, tmp_path / "work") if r.status == "ok")
    return artifact.save(tmp_path / "best", subject, row, "cpu")


def test_an_artifact_others_may_write_is_refused_before_it_is_read(eager_artifact: Path) -> None:
    weights = eager_artifact / "weights.pt"
    weights.chmod(0o664)
    with pytest.raises(BadInput) as caught:
        artifact.load(eager_artifact)
    assert str(caught.value) == (
        f"refusing artifact {eager_artifact}: {weights} is writable by its group (mode 0664), and it runs as code "
        f"here: chmod -R go-w {eager_artifact}"
    )
    weights.chmod(0o644)
    assert artifact.load(eager_artifact).verify()[0]


def test_root_refuses_an_artifact_another_user_owns(eager_artifact: Path, stranger: int) -> None:
    os.chown(eager_artifact / "weights.pt", stranger, stranger)  # they could have put anything in it
    with pytest.raises(BadInput, match=f"weights.pt belongs to redline-stranger \\(uid {stranger}\\)"):
        artifact.load(eager_artifact)


PLANTED = """
import pathlib
pathlib.Path(__file__).with_name("planted-ran").touch()
from torch import nn
def classifier():
    return nn.Linear(16, 10), (16,)
"""
LOAD = """
import sys
from redline.errors import BadInput
from redline.infer import load
try:
    print(load(sys.argv[1]).verify()[0])
except BadInput as exc:
    print(exc)
"""


@pytest.mark.slow
def test_a_factory_module_planted_in_the_current_folder_is_never_imported(eager_artifact: Path, tmp_path: Path) -> None:
    """Loaded by `python -c` (whose sys.path starts with the current folder) from a folder where someone left a
    module of the factory's name: the artifact's own copy is imported; without it, nothing."""
    here = tmp_path / "elsewhere"
    here.mkdir()
    (here / "tiny_nets.py").write_text(PLANTED)
    done = _python(LOAD, str(eager_artifact), cwd=here)
    assert not (here / "planted-ran").exists()
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-3000:]
    assert "tiny_nets.py" in artifact.read_manifest(eager_artifact)["files"]
    (eager_artifact / "tiny_nets.py").unlink()
    done = _python(LOAD, str(eager_artifact), cwd=here)
    assert done.stdout.strip() == (
        "factory tiny_nets:classifier: cannot import tiny_nets: ModuleNotFoundError: No module named 'tiny_nets' "
        f"(an artifact's factory comes from {eager_artifact} or an installed package)"
    ), done.stderr[-3000:]
    assert not (here / "planted-ran").exists()


SWAPPED_AFTER_THE_CHECK = """
import os, sys
from redline.infer import artifact, load
real = artifact.check_trusted
def check_then_repoint(path, what):  # what the link's owner can do once the check has passed
    checked = real(path, what)
    os.unlink(sys.argv[1])
    os.symlink(sys.argv[2], sys.argv[1])
    return checked
artifact.check_trusted = check_then_repoint
print(load(sys.argv[1]).verify()[0])
"""


def test_an_artifact_loads_from_the_folder_checked_not_from_a_link_repointed_since(
    eager_artifact: Path, tmp_path: Path
) -> None:
    theirs = tmp_path / "theirs"
    shutil.copytree(eager_artifact, theirs)
    (theirs / "tiny_nets.py").write_text(PLANTED)  # their factory module: runs when imported
    link = tmp_path / "current"
    link.symlink_to(eager_artifact)
    done = _python(SWAPPED_AFTER_THE_CHECK, str(link), str(theirs), cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-3000:]
    assert not (theirs / "planted-ran").exists()


# ------------------------------------------------------------------------------------------ optional backends


def test_missing_optional_backends_are_one_line_each(monkeypatch: pytest.MonkeyPatch) -> None:
    listed = run_cli("infer", "--list-backends", "--json")
    assert listed.returncode == 0, listed.stderr
    absent = {b["name"]: b["absent"] for b in json.loads(listed.stdout)["backends"]}
    assert absent["eager"] is None and absent["onnxruntime"] is None  # installed for the tests
    for name in ("tensorrt", "onnxruntime-trt"):
        assert absent[name] and "\n" not in absent[name]
    monkeypatch.setattr(backends, "is_available", lambda package: package != "onnxruntime")
    reason = backends.BACKENDS["onnxruntime"].absent("cpu", "fp32")
    assert reason.startswith("needs onnxruntime") and "\n" not in reason


@pytest.mark.slow
def test_a_run_without_onnxruntime_says_so_and_goes_on() -> None:
    done = _python(
        """
        import sys
        sys.modules["onnxruntime"] = None  # as if not installed: find_spec answers None
        sys.argv = ["redline", "infer", "-m", "tiny_nets:classifier", "--backends", "onnxruntime,tensorrt",
                    "--batch", "1", "--iters", "2"]
        from redline.cli.main import main
        main()
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "onnxruntime: absent: needs onnxruntime" in done.stdout
    assert "tensorrt: absent: needs Torch-TensorRT" in done.stdout
    assert "pick: eager at batch 1" in done.stdout.replace("\n", " ")


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "no-such-model"], "unknown model 'no-such-model'"),
        (["-m", "tiny_nets:classifier", "--batch", "0"], "--batch '0' is not a list of positive batch sizes"),
        (["-m", "tiny_nets:classifier", "--batch", "1,x"], "--batch '1,x' is not a list"),
        (["-m", "tiny_nets:classifier", "--batch", "100000000"], "is past what one call serves"),
        (["-m", "tiny_nets:classifier", "--precision", "fp64"], "--precision must be one of"),
        (["-m", "tiny_nets:classifier", "--latency-slo", "soon"], "--latency-slo 'soon' is not a latency"),
        (["-m", "tiny_nets:classifier", "--backends", "warp"], "unknown backend(s) warp"),
        (["-m", "tiny_nets:classifier", "--backends", ","], "--backends is empty"),
        (["-m", "tiny_nets:classifier", "--device", "tpu"], "--device must be auto, cpu or cuda"),
        (["-m", "tiny_nets:classifier", "--weights", "missing.pt"], "no such file or directory"),
        (["-m", "tiny_nets:no_shape"], "does not say its input's shape"),
        (["-m", "tiny_nets:strings", "--backends", "eager"], "serving needs a tensor"),
        (["-m", "gpt2", "--seq-len", "5000"], "longer than gpt2's 1024 positions"),
        (["-m", "t5-3b"], "encoder-decoder"),
        (["-m", "tiny_nets:nothing"], "has no attribute nothing"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    done = run_cli("infer", *args, "--iters", "1", cwd=HERE)
    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert message in lines[0], lines[0]


@pytest.mark.slow
def test_generation_that_leaves_no_prompt_is_refused_before_measuring(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_GPT2))
    done = run_cli("infer", "-m", str(tmp_path / "config.json"), "--generate", "64", "--backends", "eager")
    assert done.returncode == 2 and done.stdout == "", (done.stdout[-2000:], done.stderr[-2000:])
    # the last line is redline's (transformers' and torchao's import warnings may come before it)
    assert done.stderr.strip().splitlines()[-1] == "redline: --generate 64 leaves no room for a prompt in 64 positions"


def test_weights_of_another_model_are_refused_and_the_output_folder_kept(tmp_path: Path) -> None:
    torch.save({"weight": torch.zeros(3, 3)}, tmp_path / "other.pt")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    wrong = run_cli("infer", "-m", "tiny_nets:classifier", "--weights", str(tmp_path / "other.pt"), cwd=HERE)
    assert wrong.returncode == 2 and "does not fit this model" in wrong.stderr, wrong.stderr
    taken = run_cli("infer", "-m", "tiny_nets:classifier", "-o", str(tmp_path / "out"), cwd=HERE)
    assert taken.returncode == 2 and "not empty and holds no redline artifact" in taken.stderr, taken.stderr
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


# ------------------------------------------------------------------------------------------------- weights


def test_trained_weights_load_from_a_state_dict_and_from_a_run_checkpoint(nets: None, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    trained = load_subject("tiny_nets:classifier").served.inner
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.mul_(3.0)
    torch.save({"model": trained.state_dict(), "step": 10}, tmp_path / "trained.pt")
    step = tmp_path / "ckpt" / "step-00000010"
    dcp.save({"model": trained.state_dict()}, checkpoint_id=str(step), no_dist=True)
    (step / "COMPLETE").write_text("{}")
    for weights in (tmp_path / "trained.pt", step, tmp_path / "ckpt"):
        loaded = load_subject("tiny_nets:classifier", weights=weights).served.inner
        for name, value in trained.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], value), (weights, name)
    (step / ".metadata").chmod(0o666)  # a pickle anyone could have replaced: not read
    with pytest.raises(BadInput, match=f"^refusing --weights checkpoint directory {tmp_path / 'ckpt'}: "):
        load_subject("tiny_nets:classifier", weights=tmp_path / "ckpt")


class RunsACommand:
    """What a replaced ``.metadata`` can hold: unpickling it runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_weights_load_from_the_checkpoint_checked_not_from_a_link_repointed_since(
    nets: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.checkpoint as dcp

    from redline import files

    trained = load_subject("tiny_nets:classifier").served.inner
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.mul_(3.0)
    for folder in (tmp_path / "ours", tmp_path / "theirs"):
        dcp.save({"model": trained.state_dict()}, checkpoint_id=str(folder), no_dist=True)
    ran = tmp_path / "ran"
    (tmp_path / "theirs" / ".metadata").write_bytes(pickle.dumps(RunsACommand(f"touch {ran}")))
    link = tmp_path / "current"
    link.symlink_to(tmp_path / "ours")
    real = files.check_trusted

    def check_then_repoint(path, what):  # what the link's owner can do once the check has passed
        checked = real(path, what)
        link.unlink()
        link.symlink_to(tmp_path / "theirs")
        return checked

    monkeypatch.setattr(files, "check_trusted", check_then_repoint)
    loaded = load_subject("tiny_nets:classifier", weights=link).served.inner
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.state_dict().items())
    assert not ran.exists()


# ---------------------------------------------------------------------------------------------- generation


@pytest.mark.slow
def test_compiled_generation_with_a_static_cache_gives_eager_s_tokens(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_GPT2))
    subject = load_subject(str(tmp_path / "config.json"), seq_len=16)
    rows, tokens = generation(subject, batch=1, prompt_tokens=8, new_tokens=6, device="cpu", repeats=1)
    assert [r.mode for r in rows] == ["eager", "compile"]
    for row in rows:
        assert row.status == "ok", row.note
        assert row.agreement == 1.0
        assert row.prefill_ms > 0 and row.decode_tokens_per_s > 0
    # the cached tokens are the model's: greedy over the whole sequence, recomputed without a cache, gives them
    sequence = subject.example(1)[:, :8]
    with torch.inference_mode():
        for _ in range(6):
            logits = subject.served.inner(input_ids=sequence, use_cache=False).logits
            sequence = torch.cat([sequence, logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(tokens, sequence[:, 8:])


def test_generation_interleaves_the_modes_and_times_the_eager_prefill_as_one_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finding: compiled prefill 12x eager's, while the prefill runs eager in both modes. Each mode's
    generations ran back to back and each took its own best prefill, so whatever loaded the machine during one
    mode's runs showed as that mode's prefill. Now the modes take turns and the one prefill is both modes'
    median; the row says what its mode compiles."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_GPT2))
    subject = load_subject(str(tmp_path / "config.json"), seq_len=16)
    calls: list[str] = []
    # (prefill s, decode s) of each call in order: cold eager, cold compile, then the rounds; the compiled mode's
    # prefills slow, as a neighbour's load during its runs would make them
    times = iter([(0.01, 1.0), (0.01, 30.0), *[(0.010, 0.2), (0.120, 0.1)] * 3])

    def fake(model: object, prefill: object, decode: object, ids: torch.Tensor, new: int, *rest: object) -> tuple:
        calls.append("eager" if decode is prefill else "compile")
        prefill_s, decode_s = next(times)
        return prefill_s, decode_s, torch.zeros(ids.shape[0], new, dtype=torch.long)

    monkeypatch.setattr(generate, "_generate", fake)
    rows, tokens = generation(subject, batch=2, prompt_tokens=8, new_tokens=5, device="cpu", repeats=3)
    assert calls == ["eager", "compile"] * 4  # the cold ones, then three rounds taking turns
    eager, compiled = rows
    assert eager.prefill_ms == compiled.prefill_ms == pytest.approx(65.0)  # the median of the six timed prefills
    assert (eager.compiled, compiled.compiled) == ("nothing", "decode step")
    assert eager.decode_tokens_per_s == pytest.approx(2 * 4 / 0.2) and compiled.decode_tokens_per_s == 80.0
    assert compiled.cold_s is not None and compiled.agreement == 1.0 and tokens is not None


# ------------------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_infer_end_to_end_on_a_language_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_GPT2))
    done = run_cli(
        "infer", "-m", str(tmp_path / "config.json"), "--seq-len", "16", "--batch", "1,2",
        "--backends", "compile,onnxruntime", "--iters", "3", "--generate", "4", "--latency-slo", "10s",
        "-o", str(tmp_path / "best"), "--html", str(tmp_path / "report.html"), "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    statuses = {(r["backend"], r["batch"]): r["status"] for r in report["rows"]}
    assert statuses == {(b, n): "ok" for b in ("eager", "compile", "onnxruntime") for n in (1, 2)}
    eager = [r for r in report["rows"] if r["backend"] == "eager"]
    assert all(r["latency_vs_eager"] == 1.0 and r["calls"] >= 3 and r["meets_slo"] for r in eager)
    for r in report["rows"]:  # of one statistic: the speed-up is samples/s over eager's at the batch
        base = next(e for e in eager if e["batch"] == r["batch"])
        assert r["speedup_vs_eager"] == pytest.approx(r["samples_per_s"] / base["samples_per_s"])
        assert r["speedup_vs_eager"] * r["latency_vs_eager"] == pytest.approx(1.0)
    assert report["pick"] is not None and report["saved"] == str(tmp_path / "best")
    assert [g["mode"] for g in report["generation"]] == ["eager", "compile"]
    manifest = json.loads((tmp_path / "best" / "manifest.json").read_text())
    assert (manifest["backend"], manifest["batch"]) == (report["pick"]["backend"], report["pick"]["batch"])
    assert report["saved_fixed_batch"] is None  # eager and compile take any batch, and GPT-2 exports for any
    assert "redline infer report" in (tmp_path / "report.html").read_text()
    again = run_cli(  # an artifact folder is replaced by the next run
        "infer", "-m", str(tmp_path / "config.json"), "--seq-len", "16", "--batch", "1", "--backends", "eager",
        "--iters", "1", "--generate", "0", "-o", str(tmp_path / "best"),
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert "pick: eager at batch 1" in again.stdout.replace("\n", " ")
