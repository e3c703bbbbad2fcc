"""`meshlm plot OUT_DIR`: training and validation loss against tokens, from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from meshlm.core.errors import CheckpointError


def plot_losses(out_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(out_dir) / "metrics.jsonl"
    if not path.exists():
        raise CheckpointError(f"no metrics at {str(path)!r}; pass the train.out_dir of a run")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [(r["tokens"], r["loss"]) for r in records if r.get("kind") == "train"]
    valid = [(r["tokens"], r["val_loss"]) for r in records if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(str(Path(out_dir).name))
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(out_dir) / "loss.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
