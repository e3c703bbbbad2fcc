"""The served model's own multi-token prediction modules as the speculative draft (`--speculative mtp`).

A model trained with `model.mtp_depth` = D (models/mtp.py) holds D modules; module k predicts the token k + 1
ahead of a position from that position's final state and the token k ahead. At a decoding step the engine has
computed the target up to position L − 2 of a row of L tokens (the last token t_{L−1} is fed this step), so:

    draft 1 = Head(Norm_1(MTP_1(h^0, Emb(t_{·+1}))))[L − 2]      the guess for t_L
    draft j = module j on module j−1's states and the tokens one further (the drafts so far appended), at L − 2

as DeepSeek-V3 chains its modules. Depth D gives up to D draft tokens per step (`--num-draft-tokens` larger is
cut to D; the modules are not chained beyond their depth). Each draft is drawn from `target_probs` of its logits
with the row's sampling parameters (greedy: the argmax), so the engine's rejection sampling keeps the output
distributed exactly as the target's, and greedy output equal to plain greedy decoding.

The proposer recomputes the target's layers over the row (no cache of its own, no state between steps): the
engine does not hand the hidden states of its forward to a proposer yet (its paged forward keeps only the logits
rows it needs). That makes `--speculative mtp` a measure of the modules' acceptance rate, not yet a speed-up;
the missing piece is the engine keeping `model.norm`'s output for the verified positions.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from meshlm.infer.speculative import draw, target_probs


class MTPDraft:
    """Proposes up to min(k, D) tokens per row from `model.mtp` (module doc); `rollback`/`release` keep nothing."""

    def __init__(self, model, vocab_size: int | None = None):
        if getattr(model, "mtp", None) is None:
            raise ValueError("the served model has no multi-token prediction modules (model.mtp_depth=0)")
        self.model = model
        self.depth = len(model.mtp)
        self.vocab_size = vocab_size or model.cfg.vocab_size
        self.device = next(model.parameters()).device

    def propose(self, batch: Sequence[tuple], k: int | Sequence[int]) -> list[tuple[list[int], torch.Tensor]]:
        """batch: (key, tokens, params[, generator]) per row, as `DraftModel.propose`; returns per row
        (draft_tokens, their distributions (n, V) fp32), n = min(k, D) (0 for a row of fewer than 2 tokens)."""
        ks = [k] * len(batch) if isinstance(k, int) else list(k)
        return [self._row(item[1], min(n, self.depth), item[2], item[3] if len(item) > 3 else None)
                for item, n in zip(batch, ks)]

    @torch.no_grad()
    def _row(self, tokens: Sequence[int], n: int, params, generator) -> tuple[list[int], torch.Tensor]:
        m, L = self.model, len(tokens)
        if n < 1 or L < 2:
            return [], torch.zeros(0, self.vocab_size, device=self.device)
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # (1, L + drafts so far)
        rope = m.rope(L + n)
        h = m.norm(m.run_layers(m.embed(ids[:, :L - 1]), rope=rope))  # (1, L − 1, h): what the target computed
        drafts, probs = [], []
        for j, module in enumerate(list(m.mtp)[:n]):
            h = module(h, m.tok_emb(ids[:, j + 1:j + L]), rope)  # position i sees t_{i+j+1}
            logits = m.lm_head(module.norm(h[:, -1]))[0, :self.vocab_size].float()  # (V,): the guess for t_{L+j}
            q = target_probs(logits, params)
            token = int(draw(q[None], [generator])[0])
            drafts.append(token)
            probs.append(q)
            ids = torch.cat((ids, ids.new_tensor([[token]])), dim=1)
        return drafts, torch.stack(probs)

    def rollback(self, key: Hashable, length: int) -> None:
        """Nothing is cached between steps."""

    def release(self, key: Hashable) -> None:
        """Nothing is held per request."""
