"""Cross-encoder scores of text pairs (POST /v1/score and /rerank, `infer/ops_routes.py`): a BERT checkpoint
with a one-label sequence-classification head (`model.bert_head="classify"`, `model.num_labels=1`, what
`meshlm finetune --task classify` makes from pairs, and what Hugging Face cross-encoders such as ms-marco
MiniLM are) reads `[CLS] a [SEP] b [SEP]` (token types 0, then 1, as it was fine-tuned: `train/finetune.py`'s
rows) and its one output, through a sigmoid, is the pair's score in (0, 1): what sentence-transformers'
`CrossEncoder.predict` and vLLM's score endpoint return for a one-label cross-encoder.
"""

from __future__ import annotations

import threading

import torch

from meshlm.infer.sampling import InvalidRequest


def is_cross_encoder(cfg) -> bool:
    """Whether a model config (`ModelConfig`) is a cross-encoder: a BERT with a one-label classify head."""
    from meshlm.families.registry import get_spec

    return get_spec(cfg.family).task_heads and cfg.bert_head == "classify" and cfg.num_labels == 1


class Scorer:
    """Scores of (a, b) text pairs by a cross-encoder `model`, `batch_size` pairs a forward."""

    def __init__(self, model, tokenizer, batch_size: int = 32):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.lock = threading.Lock()

    def rows(self, pairs: list[tuple[str, str]], param: str) -> list[tuple[list[int], int]]:
        """([CLS] a [SEP] b [SEP] ids, the length of its first segment with [CLS] and [SEP]) per pair; an
        InvalidRequest naming `param` for a pair longer than the model's context."""
        special, limit = self.tokenizer.special_ids, self.model.cfg.seq_len
        out = []
        for i, (a, b) in enumerate(pairs):
            ids_a, ids_b = self.tokenizer.encode(a), self.tokenizer.encode(b)
            ids = [special["cls"], *ids_a, special["sep"], *ids_b, special["sep"]]
            if len(ids) > limit:
                raise InvalidRequest(f"pair {i} is {len(ids)} tokens with [CLS] and [SEP], more than the model's "
                                     f"context of {limit} tokens", param)
            out.append((ids, len(ids_a) + 2))
        return out

    @torch.no_grad()
    def score(self, pairs: list[tuple[str, str]], param: str = "text_2") -> tuple[list[float], int]:
        """(one score per pair, the number of tokens read)."""
        from meshlm.models.bert import pack_inputs

        rows = self.rows(pairs, param)
        pad = self.tokenizer.special_ids["pad"]
        device = next(self.model.parameters()).device
        scores: list[float] = []
        with self.lock:
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start:start + self.batch_size]
                width = max(len(ids) for ids, _ in chunk)
                ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                types = torch.zeros_like(ids)
                mask = torch.zeros_like(ids)
                for r, (row, first) in enumerate(chunk):
                    ids[r, :len(row)] = torch.tensor(row)
                    types[r, first:len(row)] = 1
                    mask[r, :len(row)] = 1
                logits = self.model(pack_inputs(ids, types, mask).to(device)).float()  # (B, 1)
                scores += torch.sigmoid(logits[:, 0]).tolist()
        return scores, sum(len(ids) for ids, _ in rows)
