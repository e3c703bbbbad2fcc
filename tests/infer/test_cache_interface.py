"""One cache interface (meshlm/models/cache.py): Attention hands every cache its queries, keys and values through
`update_and_attend`, so a new cache is one class. Checked against the model's own forward without a cache."""

import pytest
import torch

from meshlm.core.config import ModelConfig
from meshlm.models.cache import AttentionCache
from meshlm.models.gpt import GPT
from meshlm.models.paged import Batch, PagedKV

CFG = ModelConfig(n_layers=2, hidden_size=32, n_heads=4, n_kv_heads=2, seq_len=32, vocab_size=61, position="rope",
                  norm="rmsnorm", activation="swiglu", bias=False)


class Recording(AttentionCache):
    """A cache that only forwards to another one and counts the calls: what a new attention path would plug in."""

    def __init__(self, inner: AttentionCache):
        self.inner, self.calls = inner, 0

    def update_and_attend(self, q, k, v, start, core, mask=None):
        self.calls += 1
        return self.inner.update_and_attend(q, k, v, start, core, mask)


def model():
    torch.manual_seed(0)
    return GPT(CFG).eval()


@torch.no_grad()
def test_a_cache_wrapping_the_plain_one_decodes_as_the_full_forward():
    m = model()
    x = torch.randint(0, CFG.vocab_size, (2, 9))
    caches = [Recording(c) for c in m.new_caches(2, 9)]
    steps = [m(x[:, :6], caches=caches, start=0)[:, -1]]
    steps += [m(x[:, t:t + 1], caches=caches, start=t)[:, -1] for t in range(6, 9)]
    full = m(x)
    for i, t in enumerate(range(5, 9)):
        torch.testing.assert_close(steps[i], full[:, t], rtol=1e-5, atol=1e-5)
    assert [c.calls for c in caches] == [4, 4]  # once a layer and a forward: Attention asks nothing else


@torch.no_grad()
def test_per_row_positions_through_the_plain_and_the_paged_cache_agree():
    """Two rows at different positions: the plain cache's per-row path and the paged pool (rows of one token,
    block tables) give the full forward's logits."""
    m = model()
    a, b = torch.randint(0, CFG.vocab_size, (7,)).tolist(), torch.randint(0, CFG.vocab_size, (5,)).tolist()
    full_a, full_b = m(torch.tensor([a]))[0, -1], m(torch.tensor([b]))[0, -1]
    plain = m.new_caches(2, 8)
    m(torch.tensor([a[:6]]), caches=[_rows(c, 0) for c in plain], start=0)
    m(torch.tensor([b[:4]]), caches=[_rows(c, 1) for c in plain], start=0)
    out = m(torch.tensor([[a[6]], [b[4]]]), caches=plain, start=torch.tensor([6, 4]))[:, -1]
    torch.testing.assert_close(out, torch.stack([full_a, full_b]), rtol=1e-5, atol=1e-5)
    kv = PagedKV(m, 8, 4)
    rows = [(range(7), (0, 1)), (range(5), (5, 3))]  # block tables in any order
    batch = Batch(rows, 4, "cpu")
    ids = torch.tensor(a + b)[:, None]
    x = m.run_layers(m.embed(ids, batch.positions), None, kv.caches(batch), batch.positions, m.rope(8))
    logits = m.head(x)[:, 0]
    torch.testing.assert_close(logits[[6, 11]], torch.stack([full_a, full_b]), rtol=1e-5, atol=1e-5)


def _rows(cache, row):
    """Row `row` of a plain cache, as a one-row plain cache over the same storage."""
    view = type(cache).__new__(type(cache))
    torch.nn.Module.__init__(view)
    view.k, view.v = cache.k[row:row + 1], cache.v[row:row + 1]
    return view


def test_a_cache_must_implement_update_and_attend():
    with pytest.raises(NotImplementedError):
        AttentionCache().update_and_attend(None, None, None, 0, None)
