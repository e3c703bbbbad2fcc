"""`--task classify`: a `meshlm finetune --task classify` run scored on a file of its fine-tuning format
(`{"text", "text_pair"?, "label"}`), with the label mapping of DIR/finetune.json. One process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from meshlm.core.config import ConfigError
from meshlm.data.items import DataError
from meshlm.data.jsonl import read_jsonl
from meshlm.data.jsonl import short_json as _short
from meshlm.eval.tasks import classify_metrics
from meshlm.train.finetune import INFO_FILE, Encoder, FinetuneDataset, Labels, encode_classify


def finetune_info(checkpoint: str) -> dict:
    """DIR/finetune.json of the run holding `checkpoint` (the run directory or one of its step directories)."""
    p = Path(checkpoint).resolve()
    for d in (p, *list(p.parents)[:3]):
        if (d / INFO_FILE).is_file():
            return json.loads((d / INFO_FILE).read_text())
    raise ConfigError(f"--task classify: {checkpoint} is not a `meshlm finetune --task classify` run (no {INFO_FILE} "
                      "beside its checkpoints); give the fine-tuning run's directory")


def run_classify(model: torch.nn.Module, tokenizer, checkpoint: str, path: str, batch_size: int) -> dict:
    info = finetune_info(checkpoint)
    if info.get("task") != "classify" or info.get("regression"):
        kind = "regression" if info.get("regression") else info.get("task")
        raise ConfigError(f"--task classify: {checkpoint} was fine-tuned for {kind!r}, not classification")
    labels = Labels(info["num_labels"], names=info.get("names"))
    lines = read_jsonl(path, "--data")
    for line in lines:
        if "label" not in line.obj:
            raise DataError(f"{line.where}: no 'label' field; every line of a classify file needs one")
        raw = line.obj["label"]
        if labels.names is not None:
            if not isinstance(raw, str) or raw not in labels.names:
                raise DataError(f"{line.where}: label {_short(raw)} is not one of the run's classes "
                                f"({', '.join(labels.names[:10])}; {INFO_FILE})")
        elif isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw < labels.num_labels:
            raise DataError(f"{line.where}: label {_short(raw)} is out of range: the run's classes are "
                            f"0..{labels.num_labels - 1} ({INFO_FILE})")
    enc = Encoder(tokenizer, info.get("max_length") or model.cfg.seq_len, truncate=True)
    data = FinetuneDataset(encode_classify(lines, labels, enc, "--data"))
    device = next(model.parameters()).device
    preds = []
    with torch.no_grad():
        for lo in range(0, len(data), batch_size):
            rows = np.stack([data[i] for i in range(lo, min(lo + batch_size, len(data)))])
            inputs, _ = data.collate(rows)
            preds.append(model(inputs.to(device)).argmax(-1).cpu().numpy())
    gold = data.data.targets[:, 0]
    return classify_metrics(np.concatenate(preds), gold, labels.num_labels)
