"""The forward/backward order each pipeline stage should follow, written from the papers (test helpers).

An order is a list of ("F" | "B", virtual stage, micro-batch) for one pipeline rank.
"""

from __future__ import annotations

Order = list[tuple[str, int, int]]


def expected_1f1b(pp: int, m: int, rank: int) -> Order:
    """Narayanan et al. 2021's 1F1B on stage `rank`: min(m, pp − rank) forwards (warm-up), then one
    backward and one forward alternately (steady state), then the remaining backwards (cool-down)."""
    warmup = min(m, pp - rank)
    order = [("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("B", rank, i), ("F", rank, warmup + i)]
    return order + [("B", rank, i) for i in range(m - warmup, m)]


def expected_interleaved(pp: int, vpp: int, m: int, rank: int) -> Order:
    """Megatron's interleaved 1F1B (m a multiple of pp): forwards go through the rank's chunks in groups
    of pp micro-batches (chunk 0, 1, …), backwards likewise with the chunks reversed; (vpp − 1)·pp +
    2·(pp − 1 − rank) warm-up forwards, then forward/backward pairs, then the remaining backwards."""
    def item(kind: str, k: int) -> tuple[str, int, int]:
        group, within = divmod(k, pp * vpp)
        chunk = within // pp if kind == "F" else vpp - 1 - within // pp
        return kind, chunk * pp + rank, group * pp + within % pp

    total = vpp * m
    warmup = min(total, (vpp - 1) * pp + 2 * (pp - 1 - rank))
    order = [item("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [item("F", warmup + k), item("B", k)]
    return order + [item("B", k) for k in range(total - warmup, total)]


def max_in_flight(order: Order) -> int:
    """The most micro-batch chunks forwarded but not yet backwarded at any point (activation memory)."""
    alive = peak = 0
    for kind, _, _ in order:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak


def simulate_bubble(orders: dict[int, Order], pp: int, vpp: int, m: int, forward: float = 1.0,
                    backward: float = 2.0) -> float:
    """Idle fraction (step time − m·(t_f + t_b)) / (m·(t_f + t_b)) when every rank runs its `orders[rank]`
    as soon as the inputs are there (free messages): a chunk's forward takes forward/vpp, its backward
    backward/vpp; F(s, i) needs F(s−1, i), B(s, i) needs F(s, i) and B(s+1, i)."""
    stages, done, clock, pos = pp * vpp, {}, dict.fromkeys(orders, 0.0), dict.fromkeys(orders, 0)
    progress = True
    while progress:
        progress = False
        for rank, order in orders.items():
            while pos[rank] < len(order):
                kind, s, mb = order[pos[rank]]
                deps = ([("F", s - 1, mb)] if s > 0 else []) if kind == "F" else \
                    [("F", s, mb)] + ([("B", s + 1, mb)] if s < stages - 1 else [])
                if any(d not in done for d in deps):
                    break
                start = max([clock[rank]] + [done[d] for d in deps])
                clock[rank] = done[(kind, s, mb)] = start + (forward if kind == "F" else backward) / vpp
                pos[rank] += 1
                progress = True
    assert all(pos[r] == len(o) for r, o in orders.items()), "the orders deadlock"
    ideal = m * (forward + backward)
    return (max(clock.values()) - ideal) / ideal
