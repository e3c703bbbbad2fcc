"""gloo's collectives between two busy processes on this host, as `meshlm plan --gpu this` measures them.

    python benchmarks/gloo_collectives.py [--runs 2]
    python benchmarks/gloo_collectives.py --smoke     # one run

Each cost is the median of (about 3 ms of matmuls + the collective) less the median of the matmuls alone,
on 2 spawned gloo processes (`catalog.measure_link_costs`). Per full-tensor size: the all-reduce, and the
all-gather and reduce-scatter of the same tensor with their ratio to the all-reduce, which a ring would
make 0.5; then the α–β fit and the `gather_cost` the planner takes (`fit_links`, `gather_cost_of`).
"""

from __future__ import annotations

import argparse

from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script

from meshlm.plan.catalog import fit_links, gather_cost_of, measure_link_costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.runs = 1
    print("| run | full tensor | all-reduce ms | all-gather ms (÷ all-reduce) | reduce-scatter ms (÷ all-reduce) |")
    print("|---|---|---|---|---|")
    fits = []
    for run in range(1, args.runs + 1):
        costs = measure_link_costs()
        for n, reduce in costs["all_reduce"].items():
            cells = [f"{costs[k][n] * 1e3:.2f} ({costs[k][n] / reduce:.2f})" if n in costs[k] and reduce else "–"
                     for k in ("all_gather", "reduce_scatter")]
            size = f"{n:.0f} B" if n < 2 ** 10 else f"{n / 2 ** 10:,.0f} KiB"
            print(f"| {run} | {size} | {reduce * 1e3:.2f} | {cells[0]} | {cells[1]} |")
        fits.append((*fit_links(costs["all_reduce"]), gather_cost_of(costs)))
    print()
    for run, (gbps, latency, gather) in enumerate(fits, 1):
        print(f"run {run}: all-reduce α–β {gbps:.2f} GB/s, {latency:.0f} µs; gather_cost {gather:.2f} (a ring: 0.50)")


if __name__ == "__main__":
    main()
