"""Checkpoint and resume: bit-identical resume, atomic saves under SIGKILL, fallback, DDP and FSDP2 on 2 ranks."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ranks import spawn_ranks
from redline.env import REDLINE_TEST_SLOW_SAVE_S
from redline.errors import BadInput
from redline.runtime import checkpoint
from redline.runtime.checkpoint import Checkpointer, CheckpointWarning

# One training loop for the in-process tests, the killed processes and their references. Dropout draws from
# the global generator, so a resume is bit-identical only if the RNG states come back too; each step's data
# comes from a generator seeded with the step, so the data position is the step.
TRAIN_SCRIPT = '''
import os, sys, time
import torch
from torch import nn
from redline.env import REDLINE_TEST_SLOW_SAVE_S
from redline.runtime.checkpoint import Checkpointer


def build(init_seed):
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, step):
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def run(steps, ckpt_dir=None, init_seed=0, stop_at=None, pause_after=None, slow_at=None):
    """Train to ``steps`` (resuming from ``ckpt_dir`` when it has a checkpoint, saving after every step);
    ``stop_at``: return after that step's save; ``pause_after``/``slow_at``: hang after/inside that save."""
    model, optimizer, scheduler = build(init_seed)
    torch.manual_seed(1234)  # the training randomness (dropout), restored from a checkpoint on resume
    checkpointer = Checkpointer(ckpt_dir) if ckpt_dir else None
    start = 0
    if checkpointer is not None:
        restored = checkpointer.load_latest(model=model, optimizer=optimizer, scheduler=scheduler)
        if restored is not None:
            start = restored[1]["next_step"]
            print("resumed", start, flush=True)
    for step in range(start, steps):
        train_step(model, optimizer, scheduler, step)
        if checkpointer is not None:
            if step + 1 == slow_at:
                os.environ[REDLINE_TEST_SLOW_SAVE_S] = "60"
                print("saving", step + 1, flush=True)
            checkpointer.save(step + 1, model=model, optimizer=optimizer, scheduler=scheduler,
                              extra={"next_step": step + 1})
            print("saved", step + 1, flush=True)
            if step + 1 == pause_after:
                time.sleep(60)
            if step + 1 == stop_at:
                break
    return model


if __name__ == "__main__":
    out, steps, ckpt_dir, init_seed, pause_after, slow_at = sys.argv[1:]
    model = run(int(steps), ckpt_dir or None, init_seed=int(init_seed),
                pause_after=int(pause_after) or None, slow_at=int(slow_at) or None)
    torch.save(model.state_dict(), out)
    print("done", flush=True)
'''


@pytest.fixture(scope="module")
def train_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("script") / "train.py"
    path.write_text(TRAIN_SCRIPT)
    return path


@pytest.fixture(scope="module")
def loop(train_script):
    """The script's functions, for training in this process."""
    return runpy.run_path(str(train_script))


def weights_equal(a: nn.Module | dict, b: nn.Module | dict) -> bool:
    a = a.state_dict() if isinstance(a, nn.Module) else a
    b = b.state_dict() if isinstance(b, nn.Module) else b
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------- a checkpoint is code


class RunsACommand:
    """What a replaced ``.metadata`` can hold: unpickling it runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def planted(tmp_path: Path, loop) -> tuple[Path, Path, Path]:
    """A checkpoint whose ``.metadata`` runs ``touch ran`` when read: (its directory, the metadata, ran)."""
    model, optimizer, _ = loop["build"](0)
    folder = tmp_path / "ckpt"
    Checkpointer(folder).save(1, model=model, optimizer=optimizer)
    metadata = folder / "step-00000001" / ".metadata"
    ran = tmp_path / "ran"
    metadata.write_bytes(pickle.dumps(RunsACommand(f"touch {ran}")))
    return folder, metadata, ran


def test_a_checkpoint_others_may_write_is_refused_before_its_pickle_runs(tmp_path, loop):
    folder, metadata, ran = planted(tmp_path, loop)
    metadata.chmod(0o666)  # anyone on the server may have replaced it
    model, optimizer, _ = loop["build"](0)
    with pytest.raises(BadInput) as caught:
        Checkpointer(folder).load_latest(model=model, optimizer=optimizer)
    assert str(caught.value) == (
        f"refusing checkpoint directory {folder}: {metadata} is writable by its group and everyone (mode 0666), "
        f"and it runs as code here: chmod -R go-w {folder}"
    )
    assert not ran.exists()


def test_root_refuses_to_resume_from_a_checkpoint_another_user_owns(tmp_path, loop, stranger):
    folder, _, ran = planted(tmp_path, loop)
    for path in (folder, *folder.rglob("*")):
        os.chown(path, stranger, stranger)
    model, optimizer, _ = loop["build"](0)
    with pytest.raises(BadInput) as caught:
        Checkpointer(folder).load_latest(model=model, optimizer=optimizer)
    assert str(caught.value) == (
        f"refusing checkpoint directory {folder}: it belongs to redline-stranger (uid {stranger}), not to you or "
        "root, and it runs as code here: copy what you trust into a folder of your own"
    )
    assert not ran.exists()


def checked_then(monkeypatch, change) -> None:
    """The resume's trust check passes as it would, and then ``change()`` runs: what another user (or a
    race with one) does between the check and the load."""
    real = checkpoint.check_trusted

    def check_then_change(path, what):
        result = real(path, what)
        change()
        return result

    monkeypatch.setattr(checkpoint, "check_trusted", check_then_change)


def test_a_symlink_repointed_after_the_check_does_not_change_what_loads(tmp_path, loop, monkeypatch):
    """The resume loads from the folder the check resolved the link to, never from the link again."""
    model, optimizer, _ = loop["build"](0)
    ours = tmp_path / "ours"
    Checkpointer(ours).save(1, model=model, optimizer=optimizer)
    theirs, _, ran = planted(tmp_path / "theirs", loop)
    link = tmp_path / "latest"
    link.symlink_to(ours)
    checked_then(monkeypatch, lambda: (link.unlink(), link.symlink_to(theirs)))
    assert Checkpointer(link).load_latest(model=model, optimizer=optimizer)[0] == 1
    assert not ran.exists()


def test_a_folder_made_after_the_check_is_not_resumed_from(tmp_path, loop, monkeypatch):
    """Nothing was there to check: nothing is loaded, even when a folder of checkpoints appears meanwhile."""
    made, _, ran = planted(tmp_path / "theirs", loop)
    folder = tmp_path / "ckpt"
    checked_then(monkeypatch, lambda: made.rename(folder))
    model, optimizer, _ = loop["build"](0)
    assert Checkpointer(folder).load_latest(model=model, optimizer=optimizer) is None
    assert not ran.exists()


def test_a_checkpoint_saved_under_a_loose_umask_is_still_one_this_user_may_resume(tmp_path, loop):
    model, optimizer, _ = loop["build"](0)
    before = os.umask(0o002)  # a shared server's habit: everything group-writable
    try:
        Checkpointer(tmp_path / "ckpt").save(1, model=model, optimizer=optimizer)
    finally:
        os.umask(before)
    saved = tmp_path / "ckpt" / "step-00000001"
    assert all(not p.stat().st_mode & 0o022 for p in (saved.parent, saved, *saved.iterdir()))
    assert Checkpointer(tmp_path / "ckpt").load_latest(model=model, optimizer=optimizer)[0] == 1


# --------------------------------------------------------------------------------------------- one process


def test_resume_is_bit_identical(tmp_path, loop):
    uninterrupted = loop["run"](8)
    loop["run"](8, tmp_path, stop_at=3)
    assert Checkpointer(tmp_path).latest_step() == 3

    # the dropout masks matter: with the RNG re-seeded after the load the run ends elsewhere
    model, optimizer, scheduler = loop["build"](7)
    Checkpointer(tmp_path).load_latest(model=model, optimizer=optimizer, scheduler=scheduler)
    torch.manual_seed(99)
    for step in range(3, 8):
        loop["train_step"](model, optimizer, scheduler, step)
    assert not weights_equal(model, uninterrupted)

    resumed = loop["run"](8, tmp_path, init_seed=7)  # another init and another RNG state before the load
    assert weights_equal(resumed, uninterrupted)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000007", "step-00000008"]


def test_rng_scaler_scheduler_and_extra_come_back(tmp_path, loop):
    model, optimizer, scheduler = loop["build"](0)
    loop["train_step"](model, optimizer, scheduler, 0)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    scaler.scale(torch.ones(()))  # the scale exists from the first scaled loss on
    scaler.update(new_scale=128.0)
    extra = {"epoch": 2, "batch_in_epoch": 17, "micro_batch": 4, "accumulation": 8, "note": [1, "a"]}
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(1, model=model, optimizer=optimizer, scaler=scaler, scheduler=scheduler, extra=extra)
    expected = (torch.rand(3), random.random(), np.random.rand(2))

    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    model2, optimizer2, scheduler2 = loop["build"](3)
    scaler2 = torch.amp.GradScaler("cpu")
    step, extra2 = checkpointer.load_latest(model=model2, optimizer=optimizer2, scaler=scaler2, scheduler=scheduler2)
    assert (step, extra2) == (1, extra)
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1]
    assert np.array_equal(np.random.rand(2), expected[2])
    assert scaler2.get_scale() == 128.0
    assert scheduler2.state_dict() == scheduler.state_dict()
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert weights_equal(model2, model)


def test_saving_before_the_first_step_leaves_the_optimizer_untouched(tmp_path, loop):
    # DCP's get_state_dict initialises an empty optimizer with a step: Adam's step count would become 1
    model, optimizer, scheduler = loop["build"](0)
    Checkpointer(tmp_path).save(0, model=model, optimizer=optimizer, scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert not optimizer.state
    model2, optimizer2, scheduler2 = loop["build"](1)
    assert Checkpointer(tmp_path).load_latest(model=model2, optimizer=optimizer2) == (0, {})
    assert not optimizer2.state
    for m, o, s in ((model, optimizer, scheduler), (model2, optimizer2, scheduler2)):
        torch.manual_seed(0)
        loop["train_step"](m, o, s, 0)
    assert weights_equal(model, model2)


def test_keep_partial_leftovers_and_replaced_steps(tmp_path, loop):
    model, optimizer, scheduler = loop["build"](0)
    checkpointer = Checkpointer(tmp_path, keep=3)
    (tmp_path / "step-00000009.partial").mkdir(parents=True)  # a save killed part-way
    (tmp_path / "step-00000009.partial" / "rank-00000.pt").write_bytes(b"half")
    for step in range(1, 6):
        loop["train_step"](model, optimizer, scheduler, step)
        path = checkpointer.save(step, model=model, optimizer=optimizer)
    assert path == tmp_path / "step-00000005"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004", "step-00000005"]
    marker = json.loads((path / "COMPLETE").read_text())
    assert marker["step"] == 5 and marker["world_size"] == 1 and marker["redline_version"] and marker["time"]

    checkpointer.save(5, model=model, optimizer=optimizer, extra={"again": True})  # the same step: replaced
    assert checkpointer.load_latest(model=model, optimizer=optimizer) == (5, {"again": True})
    with pytest.warns(CheckpointWarning, match="newer than step 2"):
        checkpointer.save(2, model=model, optimizer=optimizer)  # a run that did not resume: it is the newest
    assert checkpointer.latest_step() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]


@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata", "rank-00000.pt", "COMPLETE"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(tmp_path, loop, victim):
    model, optimizer, scheduler = loop["build"](0)
    checkpointer = Checkpointer(tmp_path)
    for step in (1, 2):
        loop["train_step"](model, optimizer, scheduler, step)
        checkpointer.save(step, model=model, optimizer=optimizer, extra={"step": step})
        if step == 1:
            at_step_1 = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / "step-00000002" / victim
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)

    model2, optimizer2, _ = loop["build"](1)
    with pytest.warns(CheckpointWarning, match="step-00000002 does not load .* falls back"):
        assert checkpointer.load_latest(model=model2, optimizer=optimizer2) == (1, {"step": 1})
    assert weights_equal(model2, at_step_1)


def test_no_checkpoint_that_loads_is_bad_input(tmp_path, loop):
    model, optimizer, _ = loop["build"](0)
    Checkpointer(tmp_path).save(1, model=model, optimizer=optimizer)
    (tmp_path / "step-00000001" / "__0_0.distcp").write_bytes(b"")
    with (
        pytest.warns(CheckpointWarning),
        pytest.raises(BadInput, match=re.escape(f"no checkpoint in {tmp_path} loads")),
    ):
        Checkpointer(tmp_path).load_latest(model=model, optimizer=optimizer)
    # a model the checkpoint does not fit fails the same way, with the reason in one line
    other = nn.Linear(3, 3)
    with pytest.warns(CheckpointWarning), pytest.raises(BadInput) as info:
        Checkpointer(tmp_path).load_latest(model=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    assert "\n" not in str(info.value)


def test_a_checkpoint_of_a_newer_format_is_not_loaded_but_named(tmp_path, loop):
    """A newer redline may lay the state out otherwise (format 3 split packed tensor-parallel parameters into
    their projections): its checkpoint is skipped, with its format said, not misread."""
    from redline.runtime.checkpoint import FORMAT, MARKER

    model, optimizer, _ = loop["build"](0)
    Checkpointer(tmp_path).save(1, model=model, optimizer=optimizer)
    marker = tmp_path / "step-00000001" / MARKER
    assert json.loads(marker.read_text())["format"] == FORMAT
    marker.write_text(json.dumps(json.loads(marker.read_text()) | {"format": FORMAT + 1}))
    with (
        pytest.warns(CheckpointWarning),
        pytest.raises(BadInput, match=f"its format {FORMAT + 1} is not one this redline reads"),
    ):
        Checkpointer(tmp_path).load_latest(model=model, optimizer=optimizer)


def test_empty_or_missing_directory_has_no_checkpoint(tmp_path, loop):
    model, optimizer, _ = loop["build"](0)
    for directory in (tmp_path / "missing", tmp_path):
        assert Checkpointer(directory).latest_step() is None
        assert Checkpointer(directory).load_latest(model=model, optimizer=optimizer) is None
    (tmp_path / "step-00000004.partial").mkdir()  # only a save that never completed
    assert Checkpointer(tmp_path).load_latest(model=model, optimizer=optimizer) is None


def test_a_foreign_directory_is_bad_input(tmp_path, loop):
    model, optimizer, _ = loop["build"](0)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0")
    checkpointer = Checkpointer(tmp_path)
    for call in (
        checkpointer.latest_step,
        lambda: checkpointer.load_latest(model=model, optimizer=optimizer),
        lambda: checkpointer.save(1, model=model, optimizer=optimizer),
    ):
        with pytest.raises(BadInput, match="is not a redline checkpoint directory"):
            call()
    with pytest.raises(BadInput, match="is a regular file, not a folder"):
        Checkpointer(tmp_path / "config.json").latest_step()
    with pytest.raises(BadInput, match="at least 1"):
        Checkpointer(tmp_path, keep=0)
    with pytest.raises(BadInput, match="JSON"):
        Checkpointer(tmp_path / "new").save(1, model=model, optimizer=optimizer, extra={"t": torch.ones(1)})


# ----------------------------------------------------------------------------------------- killed processes


def start(script: Path, out: Path, steps: int, ckpt_dir: Path | str = "", init_seed=0, pause_after=0, slow_at=0):
    """The training script in its own process; a resumed one gets another ``init_seed`` than the first."""
    env = {k: v for k, v in os.environ.items() if k != REDLINE_TEST_SLOW_SAVE_S}
    args = [str(out), str(steps), str(ckpt_dir), str(init_seed), str(pause_after), str(slow_at)]
    return subprocess.Popen(
        [sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def wait_for_line(proc: subprocess.Popen, line: str, timeout_s: float = 60) -> list[str]:
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = proc.stdout.readline()
        if not got:
            raise AssertionError(f"the child ended before {line!r}: {''.join(seen)}")
        seen.append(got)
        if got.strip() == line:
            return seen
    raise AssertionError(f"no {line!r} within {timeout_s} s: {''.join(seen)}")


@pytest.mark.slow
def test_sigkill_between_and_during_saves_then_resume_matches(tmp_path, train_script, loop):
    steps = 8
    ckpt = tmp_path / "ckpt"
    child = None
    try:
        # (a) killed between saves: after step 3's save, before step 4's
        child = start(train_script, tmp_path / "unused.pt", steps, ckpt, pause_after=3)
        wait_for_line(child, "saved 3")
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        assert Checkpointer(ckpt).latest_step() == 3

        # (b) resumed, then killed inside step 6's save: its files are written, COMPLETE is not
        child = start(train_script, tmp_path / "unused.pt", steps, ckpt, init_seed=11, slow_at=6)
        lines = wait_for_line(child, "saving 6")
        assert lines[0].strip() == "resumed 3"
        rank_file = ckpt / "step-00000006.partial" / "rank-00000.pt"
        deadline = time.monotonic() + 30
        while not rank_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank_file.exists()
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000004", "step-00000005", "step-00000006.partial"]
    assert Checkpointer(ckpt).latest_step() == 5

    # resumed once more, to the end (in this process, sparing a third start of torch), like a run never killed
    resumed = loop["run"](steps, ckpt, init_seed=12)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000007", "step-00000008"]
    assert weights_equal(resumed, loop["run"](steps))


# --------------------------------------------------------------------------------------------------- 2 ranks

# Each rank trains STEPS steps saving at SAVE_AT, then a fresh model (another init, another RNG state) loads
# that checkpoint and trains to STEPS again: DDP, ZeRO-1 (DDP and ZeroRedundancyOptimizer), then FSDP2
# (fully_shard per Linear and the root).
RANK_SCRIPT = """
import os
import sys
import warnings
import torch
import torch.distributed as dist
from torch import nn
from redline.runtime.checkpoint import Checkpointer

STEPS, SAVE_AT = 6, 3
rank, world, base = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv[1]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=world)


def build(mode, init_seed):
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    if mode in ("ddp", "zero1"):
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if mode == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.05)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def train(model, optimizer, scheduler, steps):
    for step in steps:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * world + rank))
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def full(model):
    state = model.state_dict()
    if hasattr(model, "module"):
        return {k.removeprefix("module."): v.clone() for k, v in state.items()}
    return {k: v.full_tensor() for k, v in state.items()}  # FSDP2: DTensors, gathered on every rank


try:
    results = {}
    for mode in sys.argv[2:]:
        checkpointer = Checkpointer(f"{base}/{mode}")
        model, optimizer, scheduler = build(mode, 0)
        torch.manual_seed(100 + rank)  # each rank's own dropout masks
        train(model, optimizer, scheduler, range(SAVE_AT))
        checkpointer.save(SAVE_AT, model=model, optimizer=optimizer, scheduler=scheduler, extra={"rank": rank})
        at_save = full(model)
        train(model, optimizer, scheduler, range(SAVE_AT, STEPS))

        model2, optimizer2, scheduler2 = build(mode, 1)
        torch.manual_seed(7)
        restored = checkpointer.load_latest(model=model2, optimizer=optimizer2, scheduler=scheduler2)
        train(model2, optimizer2, scheduler2, range(SAVE_AT, STEPS))
        results[mode] = {"restored": restored, "at_save": at_save, "full": full(model), "resumed": full(model2)}

    # one rank cannot read its file of the newest checkpoint: every rank falls back to the one before
    checkpointer = Checkpointer(f"{base}/fallback")
    model, optimizer, scheduler = build("ddp", 0)
    for step in (1, 2):
        train(model, optimizer, scheduler, [step])
        checkpointer.save(step, model=model, optimizer=optimizer, scheduler=scheduler, extra={"step": step})
    if rank == 1:
        open(f"{base}/fallback/step-00000002/rank-00001.pt", "wb").close()
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = checkpointer.load_latest(model=model, optimizer=optimizer, scheduler=scheduler)
    results["fallback"] = {"restored": restored, "warnings": [str(w.message) for w in caught]}
    torch.save(results, f"{base}/rank{rank}.pt")
    dist.barrier()  # leave together: a gloo group torn down under a busy peer can abort it
finally:
    dist.destroy_process_group()
"""


def fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Run RANK_SCRIPT on 2 gloo ranks once for the tests below; (base directory, each rank's results)."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    base = tmp_path_factory.mktemp("ranks")
    script = base / "rank.py"
    script.write_text(RANK_SCRIPT)
    modes = ["ddp", "zero1", "fsdp"] if fsdp2_available() else ["ddp", "zero1"]
    spawn_ranks(script, 2, store=base / "store", args=[str(base), *modes])
    return base, [torch.load(base / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.ranks
@pytest.mark.parametrize("mode", ["ddp", "zero1", "fsdp"])
def test_two_ranks_save_and_resume(two_ranks, mode, loop):
    base, results = two_ranks
    if mode not in results[0]:
        pytest.skip("FSDP2 fully_shard is not available in this torch build")
    for rank, result in enumerate(r[mode] for r in results):
        assert result["restored"] == (3, {"rank": rank})  # each rank's own extra
        assert weights_equal(result["resumed"], result["full"])
    assert weights_equal(results[0][mode]["full"], results[1][mode]["full"])

    # another world size: one process without a process group loads what 2 ranks wrote (FSDP: resharded)
    model, optimizer, _ = loop["build"](5)
    if mode == "zero1":  # each rank's optimizer shard is its own: no resharding
        with pytest.warns(CheckpointWarning), pytest.raises(BadInput, match="ZeroRedundancyOptimizer"):
            Checkpointer(base / mode).load_latest(model=model, optimizer=optimizer)
        return
    with pytest.warns(CheckpointWarning, match="written by 2 ranks and is loaded by 1"):
        restored = Checkpointer(base / mode).load_latest(model=model, optimizer=optimizer)
    assert restored == (3, {"rank": 0})
    assert weights_equal(model, results[0][mode]["at_save"])


@pytest.mark.ranks
def test_two_ranks_fall_back_together_when_one_cannot_read_its_file(two_ranks):
    _, results = two_ranks
    for result in (r["fallback"] for r in results):
        assert result["restored"] == (1, {"step": 1})
    assert any("step-00000002 does not load (rank 1: " in message for message in results[0]["fallback"]["warnings"])
    assert not results[1]["fallback"]["warnings"]  # rank 0 speaks for all
