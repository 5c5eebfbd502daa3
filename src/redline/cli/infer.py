"""`redline infer`: run a model every way this server can serve it (eager, torch.compile, AOTInductor, ONNX
Runtime, TensorRT, int8), time each at each batch size, check its outputs against eager fp32, and keep the
fastest that meets the latency SLO and parity."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from redline.cli import ui

MAX_BATCH = 65536
MAX_ITERS = 1000  # timed calls per backend and batch (the measure's own ceiling)
MAX_NEW_TOKENS = 4096

if TYPE_CHECKING:
    from redline.infer.generate import GenerationRow
    from redline.infer.measure import Row


def infer(
    model: str | None = typer.Option(
        None, "--model", "-m", help="A preset, a Hugging Face config.json, or package.module:factory (as `plan -m`)."
    ),
    weights: Path | None = typer.Option(
        None, "--weights", help="Trained weights: a torch.save'd state_dict, or a `redline run` checkpoint folder."
    ),
    batch: str = typer.Option("1,8,32", "--batch", help="Batch sizes to measure, comma-separated."),
    seq_len: int | None = typer.Option(None, "--seq-len", help="Tokens per sequence (language models; default 128)."),
    input_shape: str | None = typer.Option(None, "--input-shape", help="One sample's shape, 3,224,224."),
    precision: str = typer.Option("fp32", "--precision", help="fp32, bf16, fp16 or int8 (dynamic, linear layers)."),
    latency_slo: str | None = typer.Option(None, "--latency-slo", help="The p99 latency a pick must meet: 20ms."),
    backends: str | None = typer.Option(
        None, "--backends", help="Comma-separated (default: every one that applies; see --list-backends)."
    ),
    device: str = typer.Option("auto", "--device", help="auto (a GPU when there is one), cpu or cuda."),
    iters: int = typer.Option(20, "--iters", help="Timed calls per backend and batch, at least."),
    generate: int = typer.Option(
        32, "--generate", help="Decoder LMs: new tokens to time prefill and decode with (0: skip)."
    ),
    output: Path | None = typer.Option(None, "-o", "--output", help="Save the pick here (a folder) to serve it."),
    html: Path | None = typer.Option(None, "--html", help="Write an HTML report (a latency plot) here."),
    list_backends: bool = typer.Option(False, "--list-backends", help="List the backends and whether each can run."),
    json_output: bool = typer.Option(False, "--json", help="Every measurement and the pick as JSON."),
) -> None:
    """Make a model serve fast on this machine: every backend measured, parity checked, the fastest kept."""
    from redline.capability import require_torch

    require_torch("redline infer")
    from redline.infer.backends import PRECISIONS

    if precision not in PRECISIONS:
        from redline.errors import BadInput

        raise BadInput(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    where = _device(device)
    if precision == "int8" and where == "cuda":
        from redline.errors import BadInput

        raise BadInput("--precision int8 is dynamic quantisation, which runs on the CPU: add --device cpu")
    if list_backends:
        _list(where, precision, json_output)
        return
    if model is None:
        from redline.errors import BadInput
        from redline.workload.model_spec import FORMS

        raise BadInput(f"give the model as -m SPEC: {FORMS}")
    batches, slo_ms = _checked(batch, latency_slo, iters, generate)
    _check_targets(output, html)
    from redline.cli.params import parse_input_shape
    from redline.infer.measure import Settings, selected
    from redline.infer.models import load_subject

    chosen = selected(_names(backends), where)
    subject = load_subject(model, weights=weights, seq_len=seq_len, input_shape=parse_input_shape(input_shape))
    settings = Settings(
        batches, precision=precision, device=where, iters=iters, max_iters=MAX_ITERS, latency_slo_ms=slo_ms
    )
    prompt = _prompt_tokens(subject, generate) if subject.kind == "lm" and generate else 0
    rows, best, generated, saved = _run(subject, chosen, settings, prompt, generate, output, quiet=json_output)
    if html is not None:
        from redline.infer.report import GENERATOR, html_report
        from redline.report.output import write_output

        write_output(html, html_report(subject.name, rows, best, generated, settings), marker=GENERATOR)
    if json_output:
        ui.print_json(_to_json(subject.name, settings, rows, best, generated, saved))
    else:
        _print(subject.name, settings, rows, best, generated, saved)
    if best is None:
        raise typer.Exit(1)


def _run(
    subject: Any, chosen: list, settings: Any, prompt: int, generate: int, output: Path | None, quiet: bool
) -> tuple[list[Row], Row | None, list[GenerationRow], Path | None]:
    """Every backend measured, the pick, a decoder's generation timed, the pick saved: under a progress bar."""
    from redline.infer.measure import measure, pick, scratch

    with scratch() as workdir, ui.progress_bar(enabled=not quiet) as progress:
        runnable = sum(b.absent(settings.device, settings.precision) is None for b in chosen)
        steps = (runnable + 1) * len(settings.batches) + 1  # each build, each batch's timing, then generation
        done = [0]

        def advance(what: str) -> None:
            progress(what, done[0], steps)
            done[0] += 1

        rows = measure(subject, chosen, settings, Path(workdir), advance)
        best = pick(rows)
        generated = []
        if prompt:
            from redline.infer.generate import generation

            advance(f"generation: {generate} tokens, eager and compiled")
            generated = generation(subject, 1, prompt, generate, settings.device)[0]
        saved = None
        if output is not None and best is not None:
            from redline.infer.artifact import save

            saved = save(output, subject, best, settings.device)
    return rows, best, generated, saved


def _names(backends: str | None) -> list[str] | None:
    from redline.errors import BadInput

    if backends is None:
        return None
    names = [name.strip() for name in backends.split(",") if name.strip()]
    if not names:
        raise BadInput("--backends is empty: name one or more, or leave it out for every one that applies")
    return names


def _device(device: str) -> str:
    import torch

    from redline.errors import BadInput

    if device not in ("auto", "cpu", "cuda"):
        raise BadInput(f"--device must be auto, cpu or cuda, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda: this machine has no CUDA GPU that torch can use")
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def _checked(batch: str, latency_slo: str | None, iters: int, generate: int) -> tuple[tuple[int, ...], float | None]:
    """The batch sizes and the SLO in ms, each bad option a line."""
    from redline.errors import BadInput
    from redline.units import parse_duration

    try:
        batches = tuple(int(part) for part in batch.split(",") if part.strip())
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise BadInput(f"--batch '{batch}' is not a list of positive batch sizes like 1,8,32")
    if max(batches) > MAX_BATCH:
        raise BadInput(f"--batch {max(batches)} is past what one call serves (at most {MAX_BATCH})")
    if not 1 <= iters <= MAX_ITERS or not 0 <= generate <= MAX_NEW_TOKENS:
        raise BadInput(f"--iters must be 1 to {MAX_ITERS} and --generate 0 to {MAX_NEW_TOKENS}")
    slo_ms = None
    if latency_slo is not None:
        text = latency_slo.strip().lower()
        try:
            slo_ms = float(text[:-2]) if text.endswith("ms") else parse_duration(text, bare_unit_s=1e-3) * 1e3
        except ValueError:
            slo_ms = -1.0
        if not 0 < slo_ms < float("inf"):
            raise BadInput(f"--latency-slo '{latency_slo}' is not a latency like 20ms or 0.5s")
    return tuple(dict.fromkeys(batches)), slo_ms


def _check_targets(output: Path | None, html: Path | None) -> None:
    from redline.infer.artifact import check_folder
    from redline.infer.report import GENERATOR
    from redline.report.output import check_target

    if html is not None:
        check_target(html, marker=GENERATOR)
    if output is not None:
        check_folder(output.expanduser())


def _prompt_tokens(subject: Any, new_tokens: int) -> int:
    """The prompt a decoder's generation is timed with: the sequence length, less what the new tokens need of
    its positions; refused before anything is measured when they leave none."""
    from redline.errors import BadInput
    from redline.infer.models import position_count

    positions = position_count(subject.hf_config)
    prompt = min(subject.sample_shape[0], positions - new_tokens) if positions else subject.sample_shape[0]
    if prompt < 1:
        raise BadInput(f"--generate {new_tokens} leaves no room for a prompt in {positions} positions")
    return prompt


def _list(device: str, precision: str, json_output: bool) -> None:
    from redline.infer.backends import BACKENDS, default_backends

    defaults = default_backends(device)
    listed = [
        {
            "name": b.name,
            "summary": b.summary,
            "absent": b.absent(device, precision),
            "default": b.name in defaults,
        }
        for b in BACKENDS.values()
    ]
    if json_output:
        ui.print_json({"device": device, "precision": precision, "backends": listed})
        return
    from redline.infer.report import plain_table

    table = plain_table(f"backends on {device} at {precision}", ("backend", "what", "here"))
    for entry in listed:
        here = "yes" if entry["absent"] is None else f"no: {entry['absent']}"
        here += "" if entry["default"] else " (not by default)"
        table.add_row(str(entry["name"]), str(entry["summary"]), here)
    ui.print_table(table)


def _to_json(name: str, settings: Any, rows: list[Row], best: Row | None, generated: list, saved: Path | None) -> dict:
    import dataclasses

    from redline.infer.artifact import read_manifest
    from redline.infer.measure import speedups

    speedup = speedups(rows)

    def row_json(row: Row) -> dict:
        data = dataclasses.asdict(row)
        del data["files"]  # in the run's scratch folder, gone when it ends (-o keeps the pick's)
        # both of p50 latency at the row's batch: eager's over the row's (2.0: twice as fast), and its inverse
        ratio = speedup.get((row.backend, row.batch))
        data["speedup_vs_eager"] = ratio
        data["latency_vs_eager"] = None if ratio is None else 1 / ratio
        return data

    return {
        "model": name,
        "device": settings.device,
        "precision": settings.precision,
        "batches": list(settings.batches),
        "latency_slo_ms": settings.latency_slo_ms,
        "rows": [row_json(r) for r in rows],
        "pick": None if best is None else {"backend": best.backend, "batch": best.batch},
        "generation": [dataclasses.asdict(g) for g in generated],
        "saved": str(saved) if saved else None,
        # why the saved exported graph takes its batch size only; None: it takes any (or nothing was saved)
        "saved_fixed_batch": read_manifest(saved)["fixed_batch"] if saved else None,
    }


def _print(name: str, settings: Any, rows: list[Row], best: Row | None, generated: list, saved: Path | None) -> None:
    from redline.infer import report

    ui.print_table(report.speed_table(name, settings, rows, best))
    _footnotes(report.SPEED_NOTES)
    ui.print_table(report.build_table(rows, best))
    _footnotes(report.BUILD_NOTES)
    for line in report.notes(rows):
        ui.console.print(ui.dim(f"  {line}"))
    if generated:
        ui.print_table(report.generation_table(generated))
        _footnotes(report.GENERATION_NOTES)
        for g in generated:
            if g.status != "ok":
                ui.console.print(ui.dim(f"  generation, {g.mode}: {g.note}"))
    ui.console.print(report.verdict(rows, best, settings))
    if saved is not None:
        from redline.infer.artifact import read_manifest

        manifest = read_manifest(saved)
        batches = "any batch size" if manifest["fixed_batch"] is None else f"batches of {manifest['batch']} only"
        ui.console.print(f"saved to {saved}: redline.infer.load('{saved}') serves it, {batches}")
        if manifest["fixed_batch"] is not None:
            ui.console.print(ui.dim(f"  {manifest['fixed_batch']}"))


def _footnotes(lines: tuple[str, ...]) -> None:
    """A table's notes, dim, under it; then a blank line before the next table."""
    for line in lines:
        ui.console.print(ui.dim(f"  {line}"))
    ui.console.print()
