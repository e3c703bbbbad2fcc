"""Model families: one module per family holding its `ModelSpec`, and the registry (`model.family` → spec).

A spec (`spec.py`) is what the rest of meshlm knows of a family: its tensor-parallel plan (in the
declarative styles of `styles.py`), its pipeline plan, its checkpoint blocks, its formulas, its dataset
builder, its LoRA targets, and the answers to what commands ask of a family (`decoder`, `task_heads`,
`sentence_embeddings`, ...). Only this package compares family names. `common.py` holds what the built-in
families compute the same way. A new family is one model file in `models/` and one module here
(`tests/families/toy_family.py` shows one).

May import: core, data, models.
"""
