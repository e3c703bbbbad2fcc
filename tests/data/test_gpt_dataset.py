"""Sample indices (pure data): determinism, coverage per epoch, caching, blending, resumable loading."""

from __future__ import annotations

import numpy as np
import pytest

from meshlm.data import gpt_dataset
from meshlm.data.dataset import BatchLoader
from meshlm.data.gpt_dataset import BlendedDataset, GPTDataset, blend_indices, build_indices, split_documents
from meshlm.data.indexed import IndexedDataset, IndexedWriter

SEQ = 16


def unique_token_corpus(path, lengths=(37, 5, 80, 1, 23, 64, 19, 40, 11, 50)):
    """Documents whose tokens are all distinct (token value = position in the file), int32."""
    with IndexedWriter(path, vocab_size=1 << 20) as w:
        start = 0
        for n in lengths:
            w.add_document(np.arange(start, start + n))
            start += n
        w.finish()
    return IndexedDataset(path)


def all_inputs(ds) -> np.ndarray:
    return np.concatenate([ds[i][:-1] for i in range(len(ds))])


def test_same_seed_same_order_different_seed_different(tmp_path):
    data = unique_token_corpus(tmp_path / "c")
    docs = range(data.n_documents)
    a = GPTDataset(data, docs, SEQ, seed=1, num_samples=40, cache_dir=tmp_path / "a")
    b = GPTDataset(data, docs, SEQ, seed=1, num_samples=40, cache_dir=tmp_path / "b")
    c = GPTDataset(data, docs, SEQ, seed=2, num_samples=40, cache_dir=tmp_path / "a")
    assert len(a) == len(b) == len(c) >= 40
    assert all(np.array_equal(a[i], b[i]) for i in range(len(a)))
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)
    assert not np.array_equal(a.document_index, c.document_index)


def test_every_training_token_is_an_input_once_per_epoch(tmp_path):
    data = unique_token_corpus(tmp_path / "c")
    n_tokens = len(data.tokens)  # 330
    ds = GPTDataset(data, range(data.n_documents), SEQ, seed=3, num_samples=50, cache_dir=tmp_path)
    assert ds.num_epochs == 3 and len(ds) == (3 * n_tokens - 1) // SEQ
    counts = np.bincount(all_inputs(ds), minlength=n_tokens)
    # Over E epochs every token is an input E times, except the stream's tail that fills no sample.
    tail = 3 * n_tokens - len(ds) * SEQ
    assert 0 < tail <= SEQ
    assert (counts == 3).sum() == n_tokens - tail and (counts == 2).sum() == tail
    # And epochs do not mix: the first ceil(T/s) samples, in shuffled order, cover the whole first epoch.
    first = -(-n_tokens // SEQ)
    firsts = np.bincount(np.concatenate([ds[i][:-1] for i in range(first)]), minlength=n_tokens)
    assert firsts.min() == 1 and firsts.sum() - n_tokens < SEQ


def test_a_sample_is_s_plus_one_consecutive_tokens_of_the_document_stream(tmp_path):
    data = unique_token_corpus(tmp_path / "c")
    ds = GPTDataset(data, range(2, 9), SEQ, seed=0, num_samples=30, cache_dir=tmp_path)
    stream = np.concatenate([data.document(int(d)) for d in ds.document_index])
    assert set(ds.document_index.tolist()) == set(range(2, 9))
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        assert np.array_equal(ds[i], stream[j * SEQ:j * SEQ + SEQ + 1])


def test_indices_are_cached_and_keyed_by_their_settings(tmp_path, monkeypatch):
    data = unique_token_corpus(tmp_path / "c")
    first = GPTDataset(data, range(8), SEQ, seed=5, num_samples=20)  # cached beside the data
    assert len(list((tmp_path / "c.index-cache").glob("*.npy"))) == 3

    def no_build(*args):
        raise AssertionError("indices rebuilt although cached")

    monkeypatch.setattr(gpt_dataset, "build_indices", no_build)
    again = GPTDataset(data, range(8), SEQ, seed=5, num_samples=20)
    assert np.array_equal(first.shuffle_index, again.shuffle_index)
    with pytest.raises(AssertionError, match="rebuilt"):
        GPTDataset(data, range(8), SEQ + 1, seed=5, num_samples=20)


def test_split_by_document_98_1_1():
    train, valid, test = split_documents(1000, (0.98, 0.01, 0.01))
    assert (train, valid, test) == (range(980), range(980, 990), range(990, 1000))
    assert split_documents(42, (0.95, 0.05, 0.0)) == [range(40), range(40, 42), range(42, 42)]


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [0.01, 0.99]])
def test_blend_keeps_every_share_within_one_percent_over_10000_samples(weights):
    dataset_index, sample_index = blend_indices(weights, 10_000)
    counts = np.bincount(dataset_index, minlength=len(weights))
    assert np.all(np.abs(counts / 10_000 - weights) <= 0.01)
    for n in (100, 1000, 3333):  # and along the way, within one sample
        assert np.all(np.abs(np.bincount(dataset_index[:n], minlength=len(weights)) - np.multiply(weights, n)) <= 1)
    for d in range(len(weights)):  # each dataset's samples are taken in its own order, none twice
        assert sample_index[dataset_index == d].tolist() == list(range(counts[d]))


def test_blended_dataset_draws_from_each_prefix_by_weight(tmp_path):
    a = unique_token_corpus(tmp_path / "a")
    b = unique_token_corpus(tmp_path / "b", lengths=(300, 200, 100))
    da = GPTDataset(a, range(a.n_documents), SEQ, 0, 7_100, bytes_per_token=4.0)
    db = GPTDataset(b, range(b.n_documents), SEQ, 0, 3_100, bytes_per_token=2.0)
    blend = BlendedDataset([da, db], [0.7, 0.3], 10_000)
    assert len(blend) == 10_000 and blend.bytes_per_token == pytest.approx(0.7 * 4 + 0.3 * 2)
    shares = np.bincount(blend.dataset_index) / 10_000
    assert abs(shares[0] - 0.7) <= 0.01 and abs(shares[1] - 0.3) <= 0.01
    assert np.array_equal(blend[0], (da if blend.dataset_index[0] == 0 else db)[0])


def test_loader_resumes_with_the_very_next_sample(tmp_path):
    data = unique_token_corpus(tmp_path / "c")
    ds = GPTDataset(data, range(data.n_documents), SEQ, seed=9, num_samples=60, cache_dir=tmp_path)
    straight = BatchLoader(ds, 4, seed=9)
    batches = [straight.next() for _ in range(5)]
    first = BatchLoader(ds, 4, seed=9)
    for _ in range(3):
        first.next()
    resumed = BatchLoader(ds, 4, seed=9)
    resumed.load_state_dict(first.state_dict())
    for x, y in batches[3:]:
        rx, ry = resumed.next()
        assert np.array_equal(rx, x) and np.array_equal(ry, y)
    x, _ = batches[0]
    assert np.array_equal(x[0].numpy(), ds[0][:-1])  # the dataset's own shuffle is the order


def test_build_indices_handles_empty_and_tiny_splits():
    _, sample_index, shuffle_index = build_indices(np.array([], dtype=np.int64), np.array([]), SEQ, 0, 1)
    assert len(sample_index) == len(shuffle_index) == 0
    _, sample_index, shuffle_index = build_indices(np.array([SEQ]), np.array([0]), SEQ, 0, 1)
    assert len(shuffle_index) == 0  # SEQ tokens make no sample of SEQ + 1
    _, sample_index, shuffle_index = build_indices(np.array([SEQ + 1]), np.array([0]), SEQ, 0, 1)
    assert sample_index.tolist() == [[0, 0], [0, SEQ]] and shuffle_index.tolist() == [0]
