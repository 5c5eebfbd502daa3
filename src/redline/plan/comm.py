"""Time of collectives with the alpha-beta model, written with nccl-tests' bus bandwidth.

For a ring over n ranks moving a buffer of S bytes (Thakur, Rabenseifner and Gropp 2005; Patarasuk and
Yuan 2009), each rank sends and receives

- all-reduce: 2(n-1)/n x S
- all-gather, reduce-scatter: (n-1)/n x S  (S is the full, unsharded buffer)

so with ``busbw`` the per-rank bandwidth that nccl-tests reports (NVIDIA/nccl-tests doc/PERFORMANCE.md),
``t = alpha + factor(n) x S / busbw``. Calculon's constants for alpha: 10 us over NVLink, 20 us over
InfiniBand. Alpha is charged once per collective, as Calculon does, not 2(n-1) times as a textbook ring
would: NCCL pipelines a collective's steps and its LL/LL128 protocols hide most per-hop latency, and at
the message sizes training moves (megabytes) the bandwidth term dominates either way.

Across nodes we assume NCCL's hierarchical pattern: the intra-node part over NVLink/PCIe and the
inter-node part over each GPU's share of the node's network (rail-optimised NICs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Collective = Literal["all_reduce", "all_gather", "reduce_scatter"]

# bytes each rank moves, as a multiple of (n-1)/n x S
_TRAFFIC = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}


@dataclass(frozen=True)
class Link:
    """An interconnect as the collectives see it."""

    busbw_bytes_per_s: float  # achievable nccl-tests bus bandwidth per GPU at large messages
    latency_s: float  # fixed cost of one collective (alpha)
    source: str  # "catalog: NVLink 900 GB/s x 0.8", "bench all_reduce 2026-11-29", "assumed 400 Gbit/s"


def ring_s(kind: Collective, size_bytes: float, ranks: int, link: Link) -> float:
    """One ring collective of ``size_bytes`` over ``ranks`` GPUs on one kind of link."""
    if ranks <= 1 or size_bytes <= 0:
        return 0.0
    return link.latency_s + _TRAFFIC[kind] * (ranks - 1) / ranks * size_bytes / link.busbw_bytes_per_s


def collective_s(
    kind: Collective,
    size_bytes: float,
    *,
    ranks_per_node: int,
    nodes: int,
    intra: Link,
    inter: Link | None,
    gpus_per_node: int,
) -> float:
    """A collective over a group of ``ranks_per_node`` GPUs on each of ``nodes`` nodes: the sum of
    ``collective_parts_s``."""
    return sum(
        collective_parts_s(
            kind,
            size_bytes,
            ranks_per_node=ranks_per_node,
            nodes=nodes,
            intra=intra,
            inter=inter,
            gpus_per_node=gpus_per_node,
        )
    )


def collective_parts_s(
    kind: Collective,
    size_bytes: float,
    *,
    ranks_per_node: int,
    nodes: int,
    intra: Link,
    inter: Link | None,
    gpus_per_node: int,
) -> tuple[float, float]:
    """(inside the nodes, across them) seconds of a collective over ``ranks_per_node`` GPUs on each of
    ``nodes`` nodes; apart because they cost the compute they overlap differently (NVLink copies run on the
    GPU's SMs, the network's on the NIC).

    Within a node it is a ring over the intra-node link. Across nodes NCCL first works inside each node and
    then moves each GPU's 1/ranks_per_node share over the network; every GPU of the node drives its own
    share of the node's bandwidth (``inter`` is per node), because the other groups (other tensor-parallel
    ranks) run the same collective at the same time.
    """
    within = ring_s(kind, size_bytes, ranks_per_node, intra)
    if nodes <= 1:
        return within, 0.0
    if inter is None:
        raise ValueError("a collective across nodes needs an inter-node link")
    return within, ring_s(kind, size_bytes / ranks_per_node, nodes, network_share(inter, gpus_per_node))


def network_share(inter: Link, gpus_per_node: int) -> Link:
    """One GPU's share of a node's network: every GPU of the node drives its own share at once."""
    return Link(inter.busbw_bytes_per_s / gpus_per_node, inter.latency_s, inter.source)


def p2p_s(size_bytes: float, link: Link) -> float:
    """A point-to-point send (pipeline stages): one hop at the link's bandwidth."""
    return 0.0 if size_bytes <= 0 else link.latency_s + size_bytes / link.busbw_bytes_per_s
