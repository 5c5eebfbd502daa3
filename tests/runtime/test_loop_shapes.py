"""Loops as people write them: one ``micro_batches()`` call per epoch (PyTorch's MNIST example, its DDP tutorial,
Accelerate's examples all loop over epochs themselves), ``run.epochs(n)``, and code that runs once per optimizer
step. Each is checked against the same training as one call for the whole run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from redline.errors import BadInput
from redline.plan.strategy import Strategy
from redline.runtime.config import RunConfig
from redline.runtime.prepare import prepare

SAMPLES, BATCH, EPOCHS = 48, 8, 3
STEPS_PER_EPOCH = SAMPLES // BATCH


def make_run(tmp_path: Path, name: str, **settings):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, 8, generator=generator), torch.randn(SAMPLES, 1, generator=generator)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    plan = RunConfig(strategy=Strategy(precision="fp32", micro_batch=BATCH))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    metrics = tmp_path / f"{name}.jsonl"
    run = prepare(model, optimizer, loader, plan=plan, metrics_path=str(metrics), **settings)
    return run, model, metrics


def train(run, batches) -> None:
    for x, y in batches:
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def steps_written(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def test_one_call_per_epoch_trains_and_records_as_one_call_for_the_run(tmp_path: Path) -> None:
    """The loop of PyTorch's examples: the metrics used to stop after the first call (4 of 12 steps written)."""
    whole, whole_model, _ = make_run(tmp_path, "whole")
    train(whole, whole.micro_batches(epochs=EPOCHS))

    per_epoch, model, metrics = make_run(tmp_path, "per-epoch")
    for epoch in range(EPOCHS):
        train(per_epoch, per_epoch.micro_batches(epochs=epoch + 1))
        assert per_epoch.epoch == epoch + 1

    assert torch.equal(weights(model), weights(whole_model))
    assert steps_written(metrics) == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    assert per_epoch.summary["steps"] == EPOCHS * STEPS_PER_EPOCH


def test_epochs_yields_each_epoch_once_and_micro_batches_inside_trains_that_epoch(tmp_path: Path) -> None:
    whole, whole_model, _ = make_run(tmp_path, "whole")
    train(whole, whole.micro_batches(epochs=EPOCHS))

    run, model, metrics = make_run(tmp_path, "epochs")
    seen = []
    for epoch in run.epochs(EPOCHS):
        train(run, run.micro_batches())
        seen.append((epoch, run.step))
    assert seen == [(e, (e + 1) * STEPS_PER_EPOCH) for e in range(EPOCHS)]
    assert torch.equal(weights(model), weights(whole_model))
    assert len(steps_written(metrics)) == EPOCHS * STEPS_PER_EPOCH


def test_epochs_ends_where_an_epoch_is_left_unfinished(tmp_path: Path) -> None:
    run, _, _ = make_run(tmp_path, "break")
    seen = []
    for epoch in run.epochs(EPOCHS):
        seen.append(epoch)
        for index, (x, y) in enumerate(run.micro_batches()):
            with run.accumulate():
                run.backward(nn.functional.mse_loss(run.model(x), y))
            if index == 1:
                break
    assert seen == [0]  # not the same epoch again, forever
    assert run.step == 2


def test_a_scheduler_given_an_epoch_interval_steps_once_per_epoch(tmp_path: Path) -> None:
    """StepLR over epochs passed as ``scheduler=`` used to step at every optimizer step (0.1 -> 2.4e-5 in 12
    steps instead of 0.0125)."""
    decay = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # noqa: E731
    run, _, _ = make_run(tmp_path, "per-epoch-lr", scheduler=decay, scheduler_interval="epoch")
    rates = []
    for _ in run.epochs(EPOCHS):
        train(run, run.micro_batches())
        rates.append(run.optimizer.param_groups[0]["lr"])
    assert rates == [0.05 * 0.5 ** (epoch + 1) for epoch in range(EPOCHS)]


def test_a_scheduler_interval_is_step_or_epoch(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="scheduler_interval must be one of step, epoch, not 'batch'"):
        make_run(tmp_path, "bad", scheduler_interval="batch")


def test_state_without_state_dict_is_refused_for_checkpointing(tmp_path: Path) -> None:
    run, _, _ = make_run(tmp_path, "registered")
    with pytest.raises(BadInput, match="int has no state_dict"):
        run.register_for_checkpointing(3)


def test_the_steps_a_schedule_needs_are_known_before_the_first_step(tmp_path: Path) -> None:
    run, _, _ = make_run(tmp_path, "counted")
    assert (run.steps_per_epoch, run.total_steps(EPOCHS)) == (STEPS_PER_EPOCH, EPOCHS * STEPS_PER_EPOCH)
    train(run, run.micro_batches(epochs=EPOCHS))
    assert run.step == run.total_steps(EPOCHS)
    capped, _, _ = make_run(tmp_path, "capped", max_steps=4)
    assert capped.total_steps(EPOCHS) == 4


def test_optimizer_stepped_is_true_after_each_batchs_last_micro_batch(tmp_path: Path) -> None:
    run, _, _ = make_run(tmp_path, "accumulated", accumulation=2)
    stepped = []
    for x, y in run.micro_batches():
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))
        stepped.append(run.optimizer_stepped)
    assert stepped == [False, True] * STEPS_PER_EPOCH
    assert run.step == STEPS_PER_EPOCH


PER_EPOCH_SCRIPT = """
import os, sys, time
import torch
from torch import nn
import redline

ckpt, out, gate, style = sys.argv[1:5]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn({samples}, 8, generator=g), torch.randn({samples}, 1, generator=g))
loader = torch.utils.data.DataLoader(data, batch_size={batch}, shuffle=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # per epoch, as the MNIST example


class Evaluations:  # state of the script's own, checkpointed with the run's
    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {{"count": self.count}}

    def load_state_dict(self, state):
        self.count = state["count"]


evaluations = Evaluations()
run = redline.prepare(model, optimizer, loader, checkpoint_dir=ckpt, scheduler=decay, scheduler_interval="epoch")
run.register_for_checkpointing(evaluations)
epochs = run.epochs({epochs}) if style == "epochs" else range({epochs})
for epoch in epochs:
    print(f"epoch {{epoch}} starts at step {{run.step}}", file=sys.stderr, flush=True)
    for x, y in run.micro_batches(epochs=None if style == "epochs" else epoch + 1):
        with run.accumulate():
            run.backward(nn.functional.mse_loss(run.model(x), y))
        if run.step == {stop_at} and gate != "-":  # hold until the test has signalled: an event, not a delay
            print("holding", file=sys.stderr, flush=True)
            while not os.path.exists(gate):
                time.sleep(0.02)
    evaluations.count += 1
print(f"lr {{optimizer.param_groups[0]['lr']}} after {{evaluations.count}} evaluations", file=sys.stderr)
torch.save(model.state_dict(), out)
"""


def test_sigterm_in_the_second_epoch_of_a_per_epoch_loop_checkpoints_and_resumes_at_that_epoch(
    tmp_path: Path,
) -> None:
    """SIGTERM in the second call used to end the run with no checkpoint (exit 143, the handlers gone with the
    first call); resumed through ``run.epochs``, the loop starts at the epoch and batch it stopped in and ends
    at the uninterrupted run's weights, its StepLR stepped once per epoch (not decayed again for the epochs
    before the stop) and the script's own registered state restored."""
    stop_at = STEPS_PER_EPOCH + 2  # in the second epoch
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(PER_EPOCH_SCRIPT).format(samples=SAMPLES, batch=BATCH, epochs=EPOCHS, stop_at=stop_at)
    )
    env = {k: v for k, v in os.environ.items() if k != "REDLINE_DEBUG"}

    def launch(name: str, gate: str, style: str) -> subprocess.Popen:
        argv = [sys.executable, str(script), str(tmp_path / "ckpt"), str(tmp_path / f"{name}.pt"), gate, style]
        return subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, cwd=tmp_path)

    whole = launch("whole", "-", "range")
    _, whole_log = whole.communicate(timeout=600)
    assert whole.returncode == 0, whole_log
    finished = f"lr {0.05 * 0.5**EPOCHS} after {EPOCHS} evaluations"
    assert finished in whole_log, whole_log
    # the uninterrupted run had its own checkpoint folder: start the interrupted one in a fresh one
    (tmp_path / "ckpt").rename(tmp_path / "ckpt-whole")

    stopped = launch("stopped", str(tmp_path / "gate"), "range")
    try:
        for line in iter(stopped.stderr.readline, ""):
            if line.startswith("holding"):
                break
        stopped.send_signal(signal.SIGTERM)
        (tmp_path / "gate").touch()
        _, rest = stopped.communicate(timeout=600)
    finally:
        stopped.kill()
    assert stopped.returncode == 128 + signal.SIGTERM, rest
    stopped_at = stop_at + 1  # the request takes effect at the end of the step after it came
    assert f"stopped after step {stopped_at}" in rest, rest

    resumed = launch("resumed", "-", "epochs")
    _, log = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, log
    starts = [line for line in log.splitlines() if line.startswith("epoch ")]
    assert starts == [f"epoch 1 starts at step {stopped_at}", f"epoch 2 starts at step {2 * STEPS_PER_EPOCH}"], log
    assert finished in log, log
    whole_weights = torch.load(tmp_path / "whole.pt")
    resumed_weights = torch.load(tmp_path / "resumed.pt")
    assert all(torch.equal(whole_weights[k], resumed_weights[k]) for k in whole_weights)
