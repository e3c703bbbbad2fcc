"""Inference: sentence embeddings (BERT), the serving engine (continuous batching over a bounded KV cache,
per-request sampling, adapters) and the OpenAI-compatible HTTP server (`meshlm serve`; docs/serving.md).

May import: core, data, models, families, parallel, checkpoint, train, interop, tune (not plan or eval).
"""
