"""Packed documents (`data.document_mask`): each token's position in its document and its document's id.

A GPT training row is a window of the token stream, in which every document ends with the tokenizer's
end-of-document token (`meshlm prepare` appends it). As Megatron's reset-position-ids and
reset-attention-mask do, the end-of-document token belongs to the document it ends, and the token after it
starts a new document at position 0. The loss is unchanged: the end-of-document token's target (the next
document's first token) is still scored (Megatron's optional eod-loss mask is not applied).
"""

from __future__ import annotations

import torch


def document_positions(ids: torch.Tensor, eod_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, segments) of token ids (B, T): `segments[b, t]` is the number of end-of-document tokens
    before t in row b (the document's id in its row, from 0), `positions[b, t]` the place of token t in that
    document (from 0), both int64 (B, T), on the ids' device. A row without an end-of-document token is one
    document: positions 0..T-1, segments all 0."""
    T = ids.shape[-1]
    ends = (ids == eod_id).long()
    segments = torch.cumsum(ends, dim=-1) - ends  # eod tokens before t (the eod itself stays in its document)
    index = torch.arange(T, device=ids.device).expand_as(ids)
    # The row index where each token's document starts: 0, or one past the previous eod (a running maximum).
    after_eod = torch.where(ends.bool(), index + 1, torch.zeros_like(index))
    starts = torch.cummax(torch.cat([torch.zeros_like(index[..., :1]), after_eod[..., :-1]], dim=-1), dim=-1).values
    return index - starts, segments
