"""The bottom layer: what every other package may use, and which imports no other meshlm package.

`config` (the frozen, validated config dataclasses; TOML + overrides), `errors` (the user-facing errors),
the torch-free rules and formulas: `layout` (is a layout valid; micro-batches, stage partition,
recomputation chunks), `flops` (Megatron's FLOPs formula, MFU/HFU), `memory` (model-state and activation
bytes), `fit` (does it fit this machine's memory); and the device/dtype/RNG helpers (`precision`, `rng`).

May import: the standard library, numpy, torch (helpers only; the formulas stay torch-free). No meshlm package.
"""
