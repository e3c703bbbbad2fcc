"""Plain, single-device models and their building blocks: GPT (GPT-2 and Llama style) and BERT, attention,
MLP, norms, the fused head + cross-entropy, per-parameter seeded initialisation, sampling with a KV cache,
the parameter groups optimizers use, and the counter of saved activations. Nothing here knows about
parallelism: `parallel/` transforms these models from outside, through a family's spec (`families/`).

May import: core, torch. A model file imports only torch, core and models/.
"""
