"""DeepSeek-V3's runtime in the cost model (DeepSeek-AI 2024, arXiv 2412.19437, §3.2-3.3), as plain arithmetic
on the quantities `plan.cost` computes: the node-limited all-to-all of expert parallelism, DualPipe's bubble,
overlap and two stages per rank, and which GEMMs run in FP8 (torch-free).

* Node-limited all-to-all (§3.2.2): the experts of a routing group lie on one node, a token picks its experts in
  at most `moe_topk_groups` groups, so it crosses InfiniBand once per remote node it targets and NVLink forwards
  it inside that node to each expert's GPU; the two links run at once, the slower sets the time.
* DualPipe (§3.2.1): each rank holds two stages (k and p − 1 − k, micro-batches entering from both ends), so its
  parameters double and its work is the mean of the two stages'; a forward chunk's communication runs while
  another micro-batch's backward computes, so communication costs only what exceeds the computation; the fill
  and drain take (p/2 − 1) micro-batch times where 1F1B takes (p − 1) (the report's Table 2, without its −3W
  credit for split weight gradients).
* FP8 (§3.3): the linear layers' GEMMs (forward, input and weight gradients) run at the FP8 peak; attention,
  the router, the embedding and the output head stay in BF16.
"""

from __future__ import annotations

from meshlm.core.config import ModelConfig
from meshlm.core.flops import layer_flops_per_token


def nodes_per_token(m: ModelConfig, nodes: int) -> int:
    """Nodes one token's top_k experts lie on, at most, when an EP group of experts spans `nodes` nodes: the
    groups of group-limited routing (`moe_groups`, `moe_topk_groups`) are whole nodes' experts when the groups
    divide evenly over the nodes, so a token reaches at most moe_topk_groups nodes; otherwise up to top_k."""
    reach = m.moe_top_k
    if m.moe_groups > 1 and m.moe_groups % nodes == 0:
        reach = min(reach, m.moe_topk_groups)
    return min(reach, nodes)


def node_limited_time(rows: float, m: ModelConfig, elem: float, ranks: int, per_node: int,
                      intra: tuple[float, float], inter: tuple[float, float], eff: float) -> float:
    """Seconds of one node-limited all-to-all (a dispatch or a combine) of `rows` tokens per rank, `elem` bytes
    per element, over an EP group of `ranks` GPUs, `per_node` of them per node: InfiniBand carries each token
    once per remote node it targets, nodes_per_token · (N − 1)/N of them on average (its own node among its
    targets as often as any), NVLink its top_k copies less the receiving GPU's own, (g − 1)/g of them; each link
    at `eff` of its rate, the slower one sets the time, plus one latency step per peer node and peer GPU."""
    if ranks <= 1 or rows <= 0:
        return 0.0
    row = m.hidden_size * elem
    nodes = max(1, -(-ranks // per_node))
    g = min(ranks, per_node)
    nv = rows * m.moe_top_k * row * (g - 1) / g / (intra[0] * 1e9 * eff) + (g - 1) * intra[1] * 1e-6
    if nodes == 1:
        return nv
    ib_rows = rows * nodes_per_token(m, nodes) * (nodes - 1) / nodes
    ib = ib_rows * row / (inter[0] * 1e9 * eff) + (nodes - 1) * inter[1] * 1e-6
    return max(ib, nv)


def fp8_share(m: ModelConfig) -> float:
    """The share of a layer's matmul FLOPs (`layer_flops_per_token`, the mean layer) that FP8 training runs in
    FP8: all but the MoE router's E·h (§3.3.1 keeps the gating in BF16)."""
    router = 6.0 * m.moe_experts * m.hidden_size * m.moe_layers() / m.n_layers
    total = layer_flops_per_token(m)
    return (total - router) / total if total else 1.0


def dualpipe_bubble(fill_drain: float, pp: int) -> float:
    """DualPipe's fill and drain from 1F1B's (`fill_drain`: the other ranks' micro-batch times, p − 1 of them
    for equal stages): (p/2 − 1) micro-batch times in place of (p − 1)."""
    return fill_drain * (pp / 2 - 1) / (pp - 1) if pp > 2 else 0.0


def mirrored(values: list[float]) -> list[float]:
    """Per rank under DualPipe: the mean of its two stages' values (stage k and stage p − 1 − k)."""
    pp = len(values)
    return [(values[k] + values[pp - 1 - k]) / 2 for k in range(pp)]


def exposed(comm: float, compute: float) -> float:
    """Communication that overlaps computation costs only what exceeds it."""
    return max(0.0, comm - compute)
