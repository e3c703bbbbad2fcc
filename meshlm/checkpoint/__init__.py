"""Checkpoints: their files, the manifest that vouches for them, and loading a model from one.

`files` (atomic writes with size + CRC-32, the manifest, publishing, scanning for the newest valid one),
`single` (a one-process checkpoint; reads any format), `sharded` (a parallel run's layout-free pieces, which
any layout loads), `load` (a checkpoint's config; the whole model, or this rank's tensor-parallel part, for
inference and evaluation).

May import: core, data, models, families, parallel.
"""
