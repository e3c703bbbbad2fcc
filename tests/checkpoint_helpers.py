"""Loading a checkpoint in tests the way commands do: open it once (`checkpoint.load.open_checkpoint`), then the
plain loader with the family's spec looked up by the caller."""

from __future__ import annotations

from meshlm.checkpoint.load import load_model, open_checkpoint
from meshlm.data.tokenizers import get_tokenizer
from meshlm.families.registry import get_spec


def load_run(path, device: str = "cpu"):
    """(model in eval mode, tokenizer, config) of the checkpoint at `path` (a run or step directory)."""
    checkpoint = open_checkpoint(path)
    cfg = checkpoint.config
    return load_model(checkpoint, get_spec(cfg.model.family), device), get_tokenizer(cfg.data.tokenizer), cfg
