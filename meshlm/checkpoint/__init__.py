"""Checkpoints: their files, the manifest that vouches for them, and loading a model from one.

`files` (atomic writes with size + CRC-32, the manifest, publishing, scanning for the newest valid one),
`single` (a one-process checkpoint; reads any format), `sharded` (a parallel run's layout-free pieces, which
any layout loads), `load` (the one door for inference: `open_checkpoint` resolves and verifies a path once
into a frozen `Checkpoint`; `load_model` gives the whole model, `load_parallel` this rank's part).

A family's `ModelSpec` is passed in, never looked up (as in parallel/): callers do `get_spec(cfg.model.family)`.

May import: core, data, models, families (never `families.registry` or a family module), parallel.
"""
