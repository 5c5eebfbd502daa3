"""The planner's answers for a terminal (``redline plan``): the model, hardware and goal, the ranked plans, where
the best one's memory and step time go, what was excluded; the cloud ranking; the model presets.

Each function returns what the CLI prints, a table or a list of parts (tables, which it prints through
``ui.print_table``, and lines), laid out to fit 80 columns; the words that name the user's inputs (notes) come in
already said as the command's flags.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from redline.plan.cloud import CloudRanking
from redline.plan.estimate import Estimate, mfu_peak
from redline.plan.hardware import Cluster
from redline.plan.planner import Plans
from redline.report.tables import listing
from redline.units import fmt_bytes, fmt_count, fmt_duration

BAR_WIDTH = 30  # characters of the bar of a part that takes the whole memory or step


def preset_rows() -> list[dict[str, Any]]:
    """The built-in model presets: name, parameters (None: traced), how it is profiled, its sequence length."""
    from redline.workload.presets import PRESET_NAMES, TRANSFORMER_PRESETS
    from redline.workload.transformer import count_params

    rows = []
    for name in PRESET_NAMES:
        shape = TRANSFORMER_PRESETS.get(name)
        rows.append(
            {
                "name": name,
                "params": count_params(shape) if shape else None,
                "kind": "transformer (analytic)" if shape else "traced from redline.workload.zoo",
                "seq_len": shape.seq_len if shape else None,
            }
        )
    return rows


def presets_table(rows: list[dict[str, Any]]) -> Table:
    """The presets ``--model`` takes, in the style of the plan's other tables (flush left, titled)."""
    table = listing(
        title=f"{len(rows)} model presets (redline plan --model NAME)",
        title_justify="left",
    )
    table.add_column("preset", no_wrap=True)
    table.add_column("params", no_wrap=True)
    table.add_column("sequence", no_wrap=True)
    table.add_column("profile")
    for row in rows:
        params = fmt_count(row["params"]) if row["params"] else "traced"
        table.add_row(row["name"], params, str(row["seq_len"] or "image"), row["kind"])
    return table


def _labelled(rows: list[tuple[str, RenderableType]]) -> Table:
    """Lines of text each after a label ("model", "goal", "note"), a long one wrapped under its own start rather
    than under the label."""
    table = Table.grid(padding=(0, 2))
    table.add_column(no_wrap=True)
    table.add_column()
    for label, text in rows:
        table.add_row(label, text)
    return table


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def _money(value: float | None) -> str:
    return "—" if value is None else f"${value:,.0f}"


def plans_view(plans: Plans, notes: list[str]) -> list[RenderableType]:
    """What the plans are for, the best ``ranking.top`` of them, the best one's breakdown, the exclusions and
    ``notes``: tables and lines, each printed in turn."""
    cluster, result = plans.cluster, plans.result
    parts: list[RenderableType] = [_labelled(_summary(plans))]
    if not mfu_peak(cluster, plans.best.strategy.precision):
        parts.append(Text("(no datasheet peak for this device: MFU is not shown)", style="dim"))
    parts += [_ranked_table(plans), *_breakdown(plans.best, cluster)]
    after: list[tuple[str, RenderableType]] = []
    excluded = ", ".join(f"{r['count']} {r['reason']}" for r in result.exclusions())
    if excluded:
        after.append(("excluded", excluded))
        if result.closest_misfit is not None:
            miss = result.closest_misfit
            needs = f"{miss.strategy.label()} needs {fmt_bytes(miss.memory.device_total)}"
            needs += f" of {_capacity(cluster)}"
            after.append(("nearest miss", Text(needs, style="dim")))
    after += [("note", Text(note, style="dim")) for note in notes]
    if after:
        parts.append(_labelled(after))
    return parts


def _capacity(cluster: Cluster) -> str:
    """The memory a plan must fit in: a GPU's, or on a CPU the machine's RAM (said so)."""
    return fmt_bytes(cluster.memory_bytes) + (" RAM" if cluster.on_cpu else "")


def _summary(plans: Plans) -> list[tuple[str, RenderableType]]:
    """The model, the hardware, the ceilings the estimates use and the goal, one labelled line each."""
    profile, cluster, goal = plans.profile, plans.cluster, plans.goal
    precision = plans.best.strategy.precision
    ceiling = cluster.matmul[precision]
    goal_text = f"global batch {goal.global_batch}"
    if profile.sample_unit == "sequence":
        per_step = goal.global_batch * profile.tokens_per_sample
        goal_text += f" x {profile.tokens_per_sample} tokens = {fmt_count(per_step)} tokens per step"
    if goal.tokens:
        goal_text += f"; {fmt_count(goal.tokens)} tokens in all"
    elif goal.samples:
        goal_text += f"; {fmt_count(goal.samples)} samples in all"
    if cluster.on_cpu:  # one process: no second device to talk to
        hardware = f"{cluster.device}, this machine's CPU ({_capacity(cluster)})"
        link = ""
    else:
        hardware = (
            f"{cluster.gpus} x {cluster.device} ({cluster.nodes} node{'s' if cluster.nodes > 1 else ''}, "
            f"{fmt_bytes(cluster.memory_bytes)} each)"
        )
        link = f"; GPU-GPU {cluster.intra.busbw_bytes_per_s / 1e9:.4g} GB/s ({cluster.intra.source})"
    return [
        (
            "model",
            f"{profile.name} ({profile.method}, {profile.source}): {fmt_count(profile.params_total)} params, "
            f"{fmt_count(profile.training_flops_per_sample)} training FLOPs per {profile.sample_unit}",
        ),
        ("hardware", hardware),
        (
            "ceilings",
            f"{precision} matmul {ceiling.value / 1e12:.4g} TFLOP/s ({ceiling.source}); "
            f"memory {cluster.memory_bandwidth.value / 1e9:.4g} GB/s ({cluster.memory_bandwidth.source}){link}",
        ),
        ("goal", goal_text),
    ]


def _ranked_table(plans: Plans) -> Table:
    """The best plans, one row each. The strategy wraps at its words (never inside one); the numbers never wrap;
    the time to train and the cost are shown only where the request gives them (a run's length, a price), so
    that the usual table fits 80 columns."""
    sequences = plans.profile.sample_unit == "sequence"
    leaders = plans.leaders
    title = f"best of {len(plans.ranked)} that fit"
    table = listing(title=title, title_justify="left")
    table.add_column("#", justify="right", no_wrap=True)
    longest_word = max(len(word) for e in leaders for word in e.strategy.label().split())
    table.add_column("strategy", min_width=longest_word)
    columns: list[tuple[str, Callable[[Estimate], str]]] = [
        ("mem/process" if plans.cluster.on_cpu else "mem/GPU", lambda e: fmt_bytes(e.memory.device_total)),
        ("step", lambda e: fmt_duration(e.time.total)),
        (
            "tokens/s" if sequences else "samples/s",
            lambda e: fmt_count(e.tokens_per_s if sequences else e.samples_per_s),
        ),
        ("MFU", lambda e: _pct(e.mfu)),
    ]
    if any(e.time_to_train_s for e in leaders):
        columns.append(("time to train", lambda e: fmt_duration(e.time_to_train_s) if e.time_to_train_s else "—"))
    if any(e.cost_usd is not None for e in leaders):
        columns.append(("cost", lambda e: _money(e.cost_usd)))
    for header, _ in columns:
        table.add_column(header, justify="right", no_wrap=True)
    for index, e in enumerate(leaders, 1):
        table.add_row(str(index), e.strategy.label(), *(cell(e) for _, cell in columns))
    return table


def _breakdown(best: Estimate, cluster: Cluster) -> list[str]:
    """Where the best plan's memory and step time go, a bar per part (parts of none left out: on a CPU the CUDA
    context, NCCL and cuBLAS's workspaces)."""
    memory, time = best.memory, best.time
    parts = [
        ("weights", memory.weights),
        ("gradients", memory.grads),
        ("optimizer", memory.optimizer),
        ("compute copies", memory.weight_copies),
        ("activations", memory.activations),
        ("backward working set", memory.temporary),
        ("embedding table grads", memory.table_grads),
        ("comm buffers", memory.comm_buffers),
        ("cuBLAS workspaces", memory.workspaces),
        ("allocator margin", memory.fragmentation),
        ("CUDA context + NCCL", memory.cuda_context + memory.nccl),
    ]
    # what PyTorch would report of the tensors' peak; on a CPU it keeps no such count
    measure = "tensors at the peak" if cluster.on_cpu else "torch max_memory_allocated"
    lines = [
        f"memory of #1: {fmt_bytes(memory.device_total)} of {_capacity(cluster)} "
        f"({measure} ~ {fmt_bytes(memory.allocated)})"
    ]
    lines += [_bar(name, fmt_bytes(value), value / memory.device_total) for name, value in parts if value > 0]
    steps = [
        ("compute", time.compute),
        ("pipeline bubble", time.bubble),
        ("data-parallel comm", time.data_parallel_comm),
        ("tensor-parallel comm", time.tensor_parallel_comm),
        ("pipeline comm", time.pipeline_comm),
        ("optimizer step", time.optimizer),
    ]
    lines.append(f"step time of #1: {fmt_duration(time.total)} (exposed parts)")
    lines += [_bar(name, fmt_duration(value), value / time.total) for name, value in steps if value > 0]
    return lines


def _bar(name: str, amount: str, share: float) -> str:
    return f"  {name:>22} {amount:>10}  {'█' * max(1, round(BAR_WIDTH * share))}"


def cloud_view(found: CloudRanking, model: str, deadline: str | None) -> list[RenderableType]:
    """The best ``ranking.top`` cloud options for ``model`` (``deadline``: as the user wrote it), the strategy each
    runs (under the table, by rank: a strategy is too long for a column beside the prices), and where the prices
    come from."""
    title = f"{len(found.options)} instance/node options where {model} fits, by {found.ranking.rank_by}"
    if deadline:
        title += f", finishing within {deadline}"
    table = listing(title=title, title_justify="left")
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("provider", no_wrap=True)
    table.add_column("instance", no_wrap=True)
    for column in ("GPUs", "$/h", "MFU", "time", "cost"):
        table.add_column(column, justify="right", no_wrap=True)
    for index, o in enumerate(found.leaders, 1):
        table.add_row(
            str(index),
            o.provider,
            o.instance,
            str(o.gpus) if o.nodes == 1 else f"{o.nodes}x{o.gpus // o.nodes}",
            f"{o.price_usd_per_hour:,.2f}" + ("" if o.price_verified else "*"),
            _pct(o.best.mfu),
            fmt_duration(o.time_s),
            _money(o.cost_usd),
        )
    parts: list[RenderableType] = [table]
    parts.append(_labelled([(f"#{i} runs", o.best.strategy.label()) for i, o in enumerate(found.leaders, 1)]))
    notes: list[str] = []
    if any(o.nodes > 1 for o in found.leaders):
        notes.append("GPUs 2x8: 2 nodes of 8 GPUs; $/h: all nodes together")
    if not all(o.price_verified for o in found.leaders):
        notes.append("* the catalog flags this price as unverified: check it with the provider")
    dates = ", ".join(sorted({o.price_date for o in found.options}))
    notes.append(f"global batch {found.goal.global_batch}; on-demand prices as of {dates}")
    notes.append("where each price comes from: `redline catalog instances --json`")
    parts += [Text(note, style="dim") for note in notes]
    return parts
