"""Which of a model's parameters an optimizer treats how: the hidden layers' matrices (what Muon steps),
the decayed matrices and the undecayed norms, biases and embeddings. A rule over parameter names and
shapes, shared by the optimizer (`train/optim.py`), checkpoints (which store optimizer state in this
order) and the memory formulas (Muon's share of the parameters)."""

from __future__ import annotations

import re

from torch import nn

# The hidden layers' weight matrices (attention's qkv and output, the MLP's two linears): what Muon steps.
# Embeddings, the output layer, norms, biases and adapters stay with AdamW, as in Jordan et al.'s Muon; so do
# a mixture of experts' router and shared-expert gate (models/moe.py) and its stacked 3-D expert weights.
HIDDEN_MATRIX = re.compile(r"(^|\.)layers\.\d+\.(attn|mlp)\.(?!router\.|shared_gate\.)[A-Za-z_]+\.weight$")


def param_groups(model: nn.Module, weight_decay: float, muon: bool = False) -> list[dict]:
    """AdamW's two groups (decayed matrices; norms, biases and embeddings undecayed); with `muon`, a third
    group first, the hidden matrices (`HIDDEN_MATRIX`), marked `"muon": True`."""
    hidden, decay, no_decay, seen = [], [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        is_embedding = "emb" in name.rsplit(".", 1)[0]  # tok_emb, pos_emb (also once parallelized)
        if muon and p.dim() == 2 and HIDDEN_MATRIX.search(name):
            hidden.append(p)
        else:
            (no_decay if p.dim() < 2 or is_embedding else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if muon:
        groups = [{"params": hidden, "weight_decay": weight_decay, "muon": True}] + [{**g, "muon": False}
                                                                                     for g in groups]
    return groups
