"""Virtual tokens before the input: prompt tuning (Lester et al. 2021) and p-tuning (Liu et al. 2021).

A tuned example's ids start with `virtual_tokens` placeholder positions, each holding the example's task
index (0 … tasks − 1; `tune/data.py` writes them, their targets are ignored). The token embedding's output
at those positions is replaced by the task's virtual-token embeddings, before positions are added and
dropout drawn, so a virtual token is treated like any other token from there on. The word embedding of
the placeholder ids is computed and discarded: the base model is untouched (the prompt sits in the model's
`prompt` slot, which its `embed(ids, start)` calls with the token embeddings and the first position of the
call, so a decoding step past the virtual tokens is left alone).

* prompt tuning: the virtual embeddings are the parameters, a (tasks, n, h) table, started from the
  embeddings of random vocabulary tokens, of a text's tokens, or N(0, init_std);
* p-tuning: they are the output of a prompt encoder (an MLP, or a bidirectional LSTM then an MLP, as in
  NeMo) over n learned input embeddings per task. After training, its output is a plain table
  (`export_table`), and inference needs no encoder.

Under tensor parallelism the table is whole on every rank (the embedding's output is whole); under
sequence parallelism each rank replaces the virtual positions among its own tokens, and the parameters'
gradients, which then cover only those, are summed over tp (`sequence_parallel`).
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.tune.lora import kaiming_a, seeded


class VirtualPrompt(nn.Module):
    def __init__(self, method: str, tasks: int, n: int, hidden: int, encoder: str, encoder_hidden: int,
                 seed: int, init: torch.Tensor | None, tp_rank: int, sequence_parallel: bool, device, dtype):
        super().__init__()
        self.method, self.tasks, self.n, self.hidden = method, tasks, n, hidden
        self.tp_rank, self.sp = tp_rank, sequence_parallel
        if init is None:
            init = torch.empty(tasks, n, hidden).normal_(0.0, 0.02, generator=seeded(seed, "prompt.table"))
        if method == "prompt":
            self.table = nn.Parameter(init.to(device=device, dtype=dtype))
        else:
            self.inputs = nn.Parameter(init.to(device=device, dtype=dtype))
            width = encoder_hidden or hidden
            g = seeded(seed, "prompt.encoder")
            self.lstm = None
            if encoder == "lstm":
                self.lstm = nn.LSTM(hidden, width // 2 or 1, num_layers=2, bidirectional=True, batch_first=True,
                                    device=device, dtype=dtype)
                with torch.no_grad():
                    for name, p in self.lstm.named_parameters():
                        p.copy_(torch.empty(p.shape).uniform_(-width ** -0.5, width ** -0.5, generator=g))
                mlp_in = 2 * (width // 2 or 1)
            else:
                mlp_in = hidden
            self.mlp = nn.Sequential(nn.Linear(mlp_in, width, device=device, dtype=dtype), nn.ReLU(),
                                     nn.Linear(width, hidden, device=device, dtype=dtype))
            with torch.no_grad():
                for layer in (self.mlp[0], self.mlp[2]):
                    layer.weight.copy_(kaiming_a(*layer.weight.shape, g))
                    layer.bias.zero_()
        for p in self.parameters():
            p.adapter = True
            if sequence_parallel:
                p.sequence_parallel = True

    def embeddings(self) -> torch.Tensor:
        """(tasks, n, h): the virtual tokens' embeddings."""
        if self.method == "prompt":
            return self.table
        x = self.inputs
        if self.lstm is not None:
            x = self.lstm(x)[0]
        return self.mlp(x)

    @torch.no_grad()
    def export_table(self) -> torch.Tensor:
        return self.embeddings().detach().float().cpu().clone()

    def forward(self, ids: torch.Tensor, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The token embedding's output `out` (B, T or T/t under SP, h) for `ids` (B, T) at positions from
        `start`, with the virtual positions replaced."""
        n = self.n
        if start >= n:
            return out
        if start:
            raise ValueError(f"a call starting at position {start} inside the {n} virtual tokens; run the prompt "
                             "from position 0")
        local = out.shape[1]
        offset = self.tp_rank * local if self.sp else 0
        lo, hi = max(0, offset), min(n, offset + local)
        if lo >= hi:  # none of this rank's tokens (SP): still on the graph, so backward's collectives match
            return out + 0.0 * self.embeddings().sum().to(out.dtype)
        task = ids[:, 0].clamp(0, self.tasks - 1)
        virtual = self.embeddings()[task][:, lo:hi].to(out.dtype)  # (B, hi − lo, h)
        return torch.cat([out[:, :lo - offset], virtual, out[:, hi - offset:]], dim=1)


def attach_prompt(model: nn.Module, prompt: VirtualPrompt) -> None:
    """Put `prompt` into `model`'s `prompt` slot (parameters `prompt.*`), which its `embed` calls."""
    model.add_module("prompt", prompt)
