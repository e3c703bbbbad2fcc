"""The auto-configurator: `meshlm plan` ranks layouts (tp, pp, dp, sp, micro-batch, recomputation, ZeRO) for
a model on a cluster by a memory and step-time model, and checks the best ones with short trials; serving
layouts too; and `meshlm bench memory`. The formulas it builds on are in `core/` (docs/plan.md).

May import: core, data, models, families, parallel, checkpoint, train, interop, tune (not infer or eval).
"""
