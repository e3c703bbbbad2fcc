"""PrefetchLoader (data/prefetch.py) on CPU: the plain loader's batches, in order, and a position that is
that of the batches handed out, not of those read ahead, so a stop and resume equals the plain loader."""

import time

import numpy as np
import pytest
import torch

from meshlm.data.dataset import BatchLoader
from meshlm.data.prefetch import PrefetchLoader

SEQ = 9


def _samples(n: int = 23) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 1000, SEQ + 1) for _ in range(n)]  # 23 samples: batches cross epochs


def _take(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next() for _ in range(n)]


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for (x, y), (wx, wy) in zip(got, want, strict=True):
        assert torch.equal(x, wx) and torch.equal(y, wy)


@pytest.mark.parametrize(("dp_rank", "dp_size"), [(0, 1), (1, 2)])
def test_prefetching_yields_the_plain_loaders_batches(dp_rank, dp_size):
    plain = _take(BatchLoader(_samples(), 3, seed=5, dp_rank=dp_rank, dp_size=dp_size), 12)
    pre = PrefetchLoader(BatchLoader(_samples(), 3, seed=5, dp_rank=dp_rank, dp_size=dp_size), depth=4)
    _assert_same(_take(pre, 12), plain)
    pre.close()


@pytest.mark.parametrize("depth", [1, 3, 8])
def test_stop_and_resume_equals_the_plain_loader(depth):
    plain = _take(BatchLoader(_samples(), 2, seed=1), 10)
    pre = PrefetchLoader(BatchLoader(_samples(), 2, seed=1), depth=depth)
    first = _take(pre, 4)
    state = pre.state_dict()
    assert state == {"consumed": 8}  # the 4 batches handed out, whatever was prefetched beyond them
    pre.close()
    resumed = PrefetchLoader(BatchLoader(_samples(), 2, seed=1), depth=depth)
    resumed.load_state_dict(state)
    _assert_same(first + _take(resumed, 6), plain)
    resumed.close()


def test_position_is_what_was_consumed_while_the_thread_reads_ahead():
    inner = BatchLoader(_samples(), 2, seed=1)
    pre = PrefetchLoader(inner, depth=5)
    _take(pre, 1)
    for _ in range(500):  # give the producer time to fill its queue (5 queued + 1 waiting to be put)
        if inner.consumed == 2 * 7:
            break
        time.sleep(0.01)
    assert inner.consumed > pre.consumed == 2  # read ahead, but the position is the consumed one
    pre.load_state_dict({"consumed": 6})  # a mid-run load rewinds the read-ahead
    assert pre.consumed == 6
    _assert_same(_take(pre, 2), _take(BatchLoader(_samples(), 2, seed=1, consumed=6), 2))
    pre.close()
    assert inner.consumed == pre.consumed == 10  # close rewinds the wrapped loader to the consumed position


def test_an_error_in_the_producer_reaches_the_consumer():
    class Broken(list):
        def __getitem__(self, i):
            raise RuntimeError("disk gone")

    pre = PrefetchLoader(BatchLoader(Broken(_samples()), 2, seed=1, shuffle=False))
    with pytest.raises(RuntimeError, match="disk gone"):
        pre.next()
