"""Evaluation: `meshlm eval` (perplexity, cloze, multiple choice, classification, the shipped Shakespeare
sets), the lm-evaluation-harness model `meshlm` (`harness.py`, imported only by `meshlm harness`) and the
tasks run during training (`train.eval_tasks`, handed to the trainer as a callback). See docs/eval.md.

May import: core, data, models, families, parallel, checkpoint, train, interop, tune (not plan or infer).
"""
