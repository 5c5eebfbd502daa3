"""`redline bench`: measure what this server really delivers, side by side with its physical peak."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import typer

from redline.cli import params, ui
from redline.errors import BadInput, RedlineError, one_line

if TYPE_CHECKING:
    from redline.bench.context import BenchContext
    from redline.bench.model import BenchRun
    from redline.hw.snapshot import Snapshot

SUITE_HELP = "Suites to run (default: all that need no peer): " + ", ".join(
    ["compute", "memory", "collective", "storage", "network", "dataloader"]
)


def bench(
    suites: list[str] = typer.Argument(None, help=SUITE_HELP, show_default=False),
    quick: bool = typer.Option(False, "--quick", help="Small sizes and few repeats: a minute, not ten."),
    json_out: bool = typer.Option(False, "--json", help="Print the measurements as JSON."),
    save: bool = typer.Option(False, "--save", help="Keep the results for `redline doctor --bench`."),
    device: str = typer.Option("auto", "--device", help="auto (GPUs when present), cpu, cuda or cuda:N."),
    path: str = typer.Option(".", "--path", help="storage: directory to test (a dataset's disk)."),
    serve: bool = typer.Option(False, "--serve", help="network: wait for a peer's --connect."),
    listen: str = typer.Option(
        "all", "--listen", help=f"network --serve: where to listen, {params.LISTEN_HELP}.", show_default=True
    ),
    connect: str | None = typer.Option(None, "--connect", help="network: the peer running --serve."),
    port: int = typer.Option(5211, "--port", help="network: TCP port of the peer."),
    streams: str = typer.Option("1,4,8,16", "--streams", help="network: parallel stream counts to try."),
    ranks: int | None = typer.Option(None, "--ranks", help="collective: local ranks (default: one per GPU, or 2)."),
    dataset: str | None = typer.Option(None, "--dataset", help="dataloader: 'module:factory' returning a Dataset."),
    precision: str | None = typer.Option(
        None, "--precision", help="compute: precisions to run, e.g. fp32,bf16 (default: all the device supports)."
    ),
) -> None:
    """Measure compute, memory, collectives, storage, network and data loading, against their peaks."""
    from redline.bench import store
    from redline.bench.context import BenchContext
    from redline.bench.model import BenchRun
    from redline.bench.suites import check, resolve
    from redline.hw.probe import take_snapshot

    names = resolve(list(dict.fromkeys(suites or [])))
    # under torchrun every rank runs this command; rank 0 alone reports (the collective suite gathers)
    follower = os.environ.get("RANK", "0") != "0"
    _check_suite_options(
        names, precision=precision, ranks=ranks, serve=serve, connect=connect, listen=listen, dataset=dataset
    )
    listen_host = params.listen_address("--listen", listen)
    stream_counts = _stream_counts(streams)
    if ranks is not None and ranks < 1:
        raise BadInput("--ranks must be at least 1")
    # an empty value (`--path "$DATA"` with DATA unset) is a mistake, not the default: the current folder, the
    # loopback peer and the synthetic dataset would be measured in its place
    for option, value in (("--path", path), ("--connect", connect), ("--dataset", dataset)):
        if value is not None and not value.strip():
            raise BadInput(f"{option}: an empty value")

    snapshot = take_snapshot()
    resolved_device = _resolve_device(device, snapshot)
    if not suites and resolved_device != "cpu" and (resolved_device != "cuda" or len(snapshot.gpus) < 2):
        # collectives need a peer rank: on one GPU (or a chosen cuda:N) the default run skips them
        names = [n for n in names if n != "collective"]
    ctx = BenchContext(
        quick=quick,
        device=resolved_device,
        snapshot=snapshot,
        path=path,
        serve=serve,
        listen=listen_host,
        connect=connect,
        port=port,
        streams=stream_counts,
        ranks=ranks or (_cuda_device_count() if resolved_device == "cuda" and len(snapshot.gpus) > 1 else 2),
        dataset=dataset,
    )
    if precision is not None:
        ctx.extra["precisions"] = [p.strip() for p in precision.split(",") if p.strip()]
    check(names, ctx)  # every suite's options, before the first suite runs
    fingerprint, machine = store.fingerprint(snapshot)
    run = BenchRun(
        fingerprint=fingerprint,
        machine=machine,
        taken_at=datetime.now(UTC).isoformat(timespec="seconds"),
        quick=quick,
    )
    failures = _run_suites(names, ctx, run, show_progress=not (json_out or follower))
    if follower:
        return
    _report(run, json_out=json_out, save=save)
    if failures:
        raise typer.Exit(max(failures))


def _check_suite_options(
    names: list[str],
    *,
    precision: str | None,
    ranks: int | None,
    serve: bool,
    connect: str | None,
    listen: str,
    dataset: str | None,
) -> None:
    """Refuse what this run would do wrong or ignore: suites other than collectives under torchrun (each
    rank would run them), and an option of a suite the run leaves out."""
    if "RANK" in os.environ and names != ["collective"]:
        raise BadInput(
            "under torchrun only `redline bench collective` makes sense: other suites would run once per rank"
        )
    _refuse_options_of_other_suites(
        names,
        {
            "compute": {"--precision": precision is not None},
            "collective": {"--ranks": ranks is not None},
            "network": {"--serve": serve, "--connect": connect is not None, "--listen": listen != "all"},
            "dataloader": {"--dataset": dataset is not None},
        },
    )


def _stream_counts(streams: str) -> list[int]:
    """``--streams`` as sorted distinct counts, each at least 1."""
    try:
        counts = sorted({int(s) for s in streams.split(",") if s.strip()})
    except ValueError:
        raise BadInput(f"--streams takes comma-separated counts like 1,4,8, not {streams!r}") from None
    if not counts or counts[0] < 1:
        raise BadInput("--streams needs counts of at least 1")
    return counts


def _run_suites(names: list[str], ctx: BenchContext, run: BenchRun, *, show_progress: bool) -> list[int]:
    """Run each suite into ``run``; the exit codes of those that failed. With several suites one suite's failure
    is reported and the others still run; a single suite's is raised."""
    from redline.bench.suites import run_suite

    failures: list[int] = []
    with ui.progress_bar(enabled=show_progress) as progress:
        ctx.progress = progress
        for name in names:
            try:
                run.measurements.extend(run_suite(name, ctx))
            except RedlineError as exc:
                if len(names) == 1:
                    raise
                # one suite's problem (no peer, too few GPUs) must not throw away the others' figures
                ui.error(f"{name}: {exc}")
                failures.append(exc.exit_code)
            except Exception as exc:  # a CUDA/driver error in one suite: report it, keep the rest
                if len(names) == 1:
                    raise
                ui.error(f"{name} failed: {one_line(exc)}")
                failures.append(1)
    return failures


def _report(run: BenchRun, *, json_out: bool, save: bool) -> None:
    """Print the measurements, then keep them for the doctor when asked."""
    from redline.bench import store
    from redline.bench.suites import rerun_command

    if json_out:
        ui.print_json(run.to_dict())
    else:
        ui.print_measurements(run.measurements)
    if save and run.measurements:
        try:  # after printing: a full or read-only REDLINE_HOME must not cost the user the figures
            saved = store.save(run)
        except OSError as exc:
            raise BadInput(f"could not save the results under {store.runs_dir()}: {exc.strerror or exc}") from None
        ui.warn(f"saved to {saved}; `redline doctor --bench` reads it")
        busy = [m for m in run.measurements if m.busy_host]
        if busy:  # kept, marked: the doctor and the planner see the mark; an idle rerun replaces them
            total = len(run.measurements)
            which = (
                f"{len(busy)} of the {total} figures were"
                if len(busy) < total
                else "the figure was"
                if total == 1
                else f"all {total} figures were"
            )
            ui.warn(
                f"{which} measured while {busy[0].extra['host_cpu']['summary']}: saved marked as taken on a busy "
                f"host, so the doctor and the planner know they understate this machine; rerun `{rerun_command(busy)}` "
                "when it is idle"
            )


def _refuse_options_of_other_suites(names: list[str], given: dict[str, dict[str, bool]]) -> None:
    """An option of a suite this run leaves out would be ignored in silence: say so instead."""
    for suite, options in given.items():
        named = [option for option, present in options.items() if present]
        if named and suite not in names:
            raise BadInput(
                f"{' and '.join(named)} {'applies' if len(named) == 1 else 'apply'} to the {suite} suite, which this "
                f"run leaves out ({', '.join(names)}): `redline bench {suite} {' '.join(named)} ...`"
            )


def _cuda_device_count() -> int:
    """GPUs torch can use (CUDA_VISIBLE_DEVICES applied); NVML counts every GPU in the box."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _resolve_device(device: str, snapshot: Snapshot) -> str:
    from redline.errors import BadInput

    if device == "auto":
        if not snapshot.gpus:
            return "cpu"
        if _cuda_device_count() == 0:  # NVML sees GPUs, torch cannot use them (CPU build, hidden devices)
            ui.warn("GPUs present but PyTorch cannot use them (CPU build or CUDA_VISIBLE_DEVICES): benching the CPU")
            return "cpu"
        return "cuda"
    if device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if device.startswith("cuda") and not snapshot.gpus:
            raise BadInput(f"--device {device}: no NVIDIA GPU found ({snapshot.gpu.error or 'NVML sees none'})")
        return device
    raise BadInput(f"--device takes auto, cpu, cuda or cuda:N, not {device!r}")
