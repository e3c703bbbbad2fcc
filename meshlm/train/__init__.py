"""Training: the loop, its state and resume, its log; optimizers and schedules, metrics, `meshlm finetune`.
Tuning and in-loop evaluation reach the trainer as arguments (they live above it, in tune/ and eval/).

May import: core, data, models, families, parallel, checkpoint.
"""
