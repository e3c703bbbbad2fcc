"""Evaluation: `meshlm eval` (perplexity, cloze, multiple choice, classification, the shipped Shakespeare
sets), the lm-evaluation-harness model `meshlm` (`harness.py`, imported only by `meshlm harness`) and the
tasks run during training (`train.eval_tasks`). See docs/eval.md."""
