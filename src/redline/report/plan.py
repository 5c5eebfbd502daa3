"""The planner's answers for a terminal (``redline plan``): the model, hardware and goal, the ranked plans, where
the best one's memory and step time go, what was excluded; the cloud ranking; the model presets.

Each function returns a renderable for the CLI to print; the words that name the user's inputs (notes) come in
already said as the command's flags.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group, JustifyMethod, RenderableType
from rich.table import Table
from rich.text import Text

from redline.plan.cloud import CloudRanking
from redline.plan.estimate import Estimate, mfu_peak
from redline.plan.hardware import Cluster
from redline.plan.planner import Plans
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
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for column in ("preset", "params", "sequence", "profile"):
        table.add_column(column)
    for row in rows:
        params = fmt_count(row["params"]) if row["params"] else "traced"
        table.add_row(row["name"], params, str(row["seq_len"] or "image"), row["kind"])
    return table


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def _money(value: float | None) -> str:
    return "—" if value is None else f"${value:,.0f}"


def plans_view(plans: Plans, notes: list[str]) -> Group:
    """What the plans are for, the best ``ranking.top`` of them, the best one's breakdown, the exclusions and
    ``notes``."""
    profile, cluster, goal, result = plans.profile, plans.cluster, plans.goal, plans.result
    precision = plans.best.strategy.precision
    ceiling = cluster.matmul[precision]
    lines: list[RenderableType] = [
        f"model     {profile.name} ({profile.method}, {profile.source}): {fmt_count(profile.params_total)} params, "
        f"{fmt_count(profile.training_flops_per_sample)} training FLOPs per {profile.sample_unit}",
        f"hardware  {cluster.gpus} x {cluster.device} ({cluster.nodes} node{'s' if cluster.nodes > 1 else ''}, "
        f"{fmt_bytes(cluster.memory_bytes)} each)",
        f"ceilings  {precision} matmul {ceiling.value / 1e12:.4g} TFLOP/s ({ceiling.source}); "
        f"memory {cluster.memory_bandwidth.value / 1e9:.4g} GB/s ({cluster.memory_bandwidth.source}); "
        f"GPU-GPU {cluster.intra.busbw_bytes_per_s / 1e9:.4g} GB/s ({cluster.intra.source})",
    ]
    goal_text = f"global batch {goal.global_batch}"
    if profile.sample_unit == "sequence":
        per_step = goal.global_batch * profile.tokens_per_sample
        goal_text += f" x {profile.tokens_per_sample} tokens = {fmt_count(per_step)} tokens per step"
    if goal.tokens:
        goal_text += f"; {fmt_count(goal.tokens)} tokens in all"
    elif goal.samples:
        goal_text += f"; {fmt_count(goal.samples)} samples in all"
    lines.append(f"goal      {goal_text}")
    if not mfu_peak(cluster, precision):
        lines.append(Text("(no datasheet peak for this device: MFU is not shown)", style="dim"))
    lines += [_ranked_table(plans), *_breakdown(plans.best, cluster)]
    excluded = ", ".join(f"{r['count']} {r['reason']}" for r in result.exclusions())
    if excluded:
        lines.append(f"excluded  {excluded}")
        if result.closest_misfit is not None:
            miss = result.closest_misfit
            lines.append(
                Text(
                    f"          nearest miss: {miss.strategy.label()} needs {fmt_bytes(miss.memory.device_total)} "
                    f"of {fmt_bytes(cluster.memory_bytes)}",
                    style="dim",
                )
            )
    lines += [Text(f"note: {note}", style="dim") for note in notes]
    return Group(*lines)


def _ranked_table(plans: Plans) -> Table:
    sequences = plans.profile.sample_unit == "sequence"
    title = f"best of {len(plans.ranked)} that fit"
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, title=title, title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("#", "right"),
        ("strategy", "left"),
        ("memory/GPU", "right"),
        ("step", "right"),
        ("tokens/s" if sequences else "samples/s", "right"),
        ("MFU", "right"),
        ("time to train", "right"),
        ("cost", "right"),
    )
    for column, justify in columns:
        table.add_column(column, justify=justify)
    for index, e in enumerate(plans.leaders, 1):
        table.add_row(
            str(index),
            e.strategy.label(),
            fmt_bytes(e.memory.device_total),
            fmt_duration(e.time.total),
            fmt_count(e.tokens_per_s if sequences else e.samples_per_s),
            _pct(e.mfu),
            fmt_duration(e.time_to_train_s) if e.time_to_train_s else "—",
            _money(e.cost_usd),
        )
    return table


def _breakdown(best: Estimate, cluster: Cluster) -> list[str]:
    """Where the best plan's memory and step time go, a bar per part (parts of none left out)."""
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
    lines = [
        f"memory of #1: {fmt_bytes(memory.device_total)} of {fmt_bytes(cluster.memory_bytes)} "
        f"(torch max_memory_allocated ~ {fmt_bytes(memory.allocated)})"
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


def cloud_view(found: CloudRanking, model: str, deadline: str | None) -> Group:
    """The best ``ranking.top`` cloud options for ``model`` (``deadline``: as the user wrote it), and where the
    prices come from."""
    title = f"{len(found.options)} instance/node options where {model} fits, by {found.ranking.rank_by}"
    if deadline:
        title += f", finishing within {deadline}"
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, title=title, title_justify="left")
    for column in ("#", "provider", "instance", "nodes", "GPUs", "$/h", "strategy", "MFU", "time", "cost"):
        table.add_column(column, justify="left" if column in ("provider", "instance", "strategy") else "right")
    for index, o in enumerate(found.leaders, 1):
        table.add_row(
            str(index),
            o.provider,
            o.instance,
            str(o.nodes),
            str(o.gpus),
            f"{o.price_usd_per_hour:,.2f}" + ("" if o.price_verified else "*"),
            o.best.strategy.label(),
            _pct(o.best.mfu),
            fmt_duration(o.time_s),
            _money(o.cost_usd),
        )
    lines: list[RenderableType] = [table]
    if not all(o.price_verified for o in found.leaders):
        lines.append(Text("* the catalog flags this price as unverified: check it with the provider", style="dim"))
    dates = ", ".join(sorted({o.price_date for o in found.options}))
    sources = f"on-demand prices as of {dates}; global batch {found.goal.global_batch}; `redline catalog instances`"
    lines.append(Text(f"{sources} for sources", style="dim"))
    return Group(*lines)
