"""BERT data on the bundled Shakespeare corpus with the BERT WordPiece tokenizer: the sample mapping,
the row layout, masking and sentence-order statistics, determinism, the cache, collate, the loader,
build_bert_datasets and its errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from meshlm.core.config import ConfigError
from meshlm.data import bert_dataset
from meshlm.data.assets import shakespeare_files
from meshlm.data.bert_build import build_bert_datasets
from meshlm.data.bert_dataset import (
    IGNORE_INDEX,
    BertDataset,
    BlendedBertDataset,
    build_sample_mapping,
    truncated_lengths,
    wordpiece_continuations,
)
from meshlm.data.dataset import BatchLoader
from meshlm.data.prepare import prepare
from meshlm.data.tokenizers import get_tokenizer
from tests.conftest import tiny_config

T = 128
QUIET = {"progress": False, "log": lambda line: None}


def bert_config(tmp_path, cache, seq_len=T, **data):
    return tiny_config(tmp_path / "run", model={"vocab_size": 30522, "seq_len": seq_len},
                       data={"tokenizer": "bert", "cache_dir": str(cache), **data})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The default corpus, prepared sentence by sentence once for the module: (tokenizer, train, valid)."""
    cache = tmp_path_factory.mktemp("bert-cache")
    return build_bert_datasets(bert_config(tmp_path_factory.mktemp("cfg"), cache), progress=False)


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("bert")


@pytest.fixture(scope="module")
def rows(built):
    """1,500 training rows (T = 128)."""
    _, train, _ = built
    return np.stack([train[i] for i in range(1500)])


def parts(rows):
    return rows[:, :T], rows[:, T:2 * T], rows[:, 2 * T:3 * T], rows[:, 3 * T:4 * T], rows[:, 4 * T]


def dataset(built, tmp_path, seed=1234, num_samples=100, seq_len=T, **kw):
    tok, train, _ = built
    return BertDataset(train.indexed, train.documents, seq_len, seed, num_samples, tok.special_ids, tok.vocab_size,
                       wordpiece_continuations(tok), cache_dir=tmp_path, **kw)


# ---- the data and the split ------------------------------------------------------------------------
def test_default_corpus_holds_out_whole_plays(built, tok):
    _, train, valid = built
    data = train.indexed
    assert data.n_documents == 42 and data.n_sequences > 80_000  # a play per document, a sentence per sequence
    assert data.metadata["split_sentences"] is True and data.metadata["append_eod"] is False
    assert train.documents == range(40) and valid.documents == range(40, 42)
    plays = shakespeare_files()[40:]
    for d, play in zip(valid.documents, plays):
        assert tok.normalized_words(tok.decode(data.document(d).tolist())) == tok.normalized_words(play.read_text())
    first_valid_sentence = data.document_indices[40]
    assert train.samples[:, 1].max() <= first_valid_sentence <= valid.samples[:, 0].min()
    assert len(train) >= 4 * 4 and len(valid) >= 2 * 2  # max_steps × global batch; eval_iters × micro batch
    assert train.num_tokens + valid.num_tokens == len(data.tokens) and len(train.tokens) == train.num_tokens


# ---- the sample mapping ----------------------------------------------------------------------------
def test_sample_mapping_walks_documents_like_megatron():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 3000)
    bounds = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 3000), 150, replace=False)), [3000]])
    bounds = np.insert(bounds, 5, bounds[5])  # an empty document
    first, last = bounds[:-1], bounds[1:]
    max_len = 61
    mapping = build_sample_mapping(first, last, lengths, max_len, seed=3, num_samples=2000)
    assert mapping.shape[1] == 3 and len(mapping) >= 2000
    cum = np.concatenate([[0], np.cumsum(lengths)])
    per_epoch = sum(last - first >= 2)
    epoch_rows = sorted(map(tuple, mapping.tolist()))
    assert (mapping[:, 1] - mapping[:, 0] >= 2).all()  # two sentences at least: A and B
    for s, e, target in epoch_rows:
        d = np.searchsorted(last, s, side="right")
        assert first[d] <= s and e <= last[d]  # inside one document
        assert 2 <= target <= max_len
        if e < last[d]:  # not the document's last sample: the shortest run that reaches the target
            assert cum[e] - cum[s] >= target and (e - 1 - s < 2 or cum[e - 1] - cum[s] < target)
            assert last[d] - e >= 2
    # each epoch tiles every document of 2+ sentences: every sentence of those is covered epochs times
    cover = np.zeros(3000, int)
    for s, e, _ in epoch_rows:
        cover[s:e] += 1
    usable = np.zeros(3000, bool)
    for f, l in zip(first, last):
        usable[f:l] = l - f >= 2
    epochs = cover[usable][0]
    assert (cover[usable] == epochs).all() and (cover[~usable] == 0).all() and epochs >= 2
    short = mapping[:, 2] < max_len
    assert 0.06 < short.mean() < 0.14  # short_seq_prob = 0.1
    assert per_epoch > 0 and not np.array_equal(mapping[:50], np.array(sorted(mapping.tolist()))[:50])  # shuffled
    assert len(build_sample_mapping(first[:1], first[:1] + 1, lengths, max_len, 3, 10)) == 0  # 1-sentence docs


def test_truncation_matches_megatrons_token_by_token_loop():
    for la, lb, target in itertools.product(range(12), range(12), range(2, 14)):
        a, b = la, lb
        while a + b > target:
            if a > b:
                a -= 1
            else:
                b -= 1
        assert truncated_lengths(la, lb, target) == (a, b)


def test_truncation_drops_tokens_from_the_front_or_the_back_at_random():
    a, b = np.arange(100), np.arange(100, 150)
    fronts = []
    for seed in range(300):
        ta, tb = BertDataset._truncate(a, b, 40, np.random.default_rng(seed))
        assert (len(ta), len(tb)) == (20, 20)  # 110 too many: B shrinks to A's length, then both in turn
        assert np.array_equal(ta, np.arange(ta[0], ta[0] + 20)) and np.array_equal(tb, np.arange(tb[0], tb[0] + 20))
        fronts.append((ta[0] - a[0], tb[0] - b[0]))
    fronts = np.array(fronts)
    assert fronts.mean(0) == pytest.approx([40, 15], abs=1.5)  # half of the 80 and 30 dropped come off the front


# ---- rows ------------------------------------------------------------------------------------------
def test_row_layout(built, rows, tok):
    _, train, _ = built
    sp = tok.special_ids
    ids, types, attention, labels, sop = parts(rows)
    assert rows.dtype == np.int64 and rows.shape == (1500, 4 * T + 1)
    originals = np.where(labels != IGNORE_INDEX, labels, ids)
    for r in range(len(rows)):
        n = int(attention[r].sum())
        assert attention[r].tolist() == [1] * n + [0] * (T - n) and n >= 5
        assert (ids[r, n:] == sp["pad"]).all() and (types[r, n:] == 0).all() and (labels[r, n:] == IGNORE_INDEX).all()
        la = int((types[r, :n] == 0).sum()) - 2  # [CLS] A [SEP] are type 0, B [SEP] type 1
        lb = n - la - 3
        assert la >= 1 and lb >= 1 and types[r, :n].tolist() == [0] * (la + 2) + [1] * (lb + 1)
        assert ids[r, 0] == sp["cls"] and ids[r, la + 1] == sp["sep"] and ids[r, n - 1] == sp["sep"]
        assert (labels[r, [0, la + 1, n - 1]] == IGNORE_INDEX).all()
        real = np.r_[1:la + 1, la + 2:n - 1]
        assert not np.isin(originals[r, real], [sp["cls"], sp["sep"], sp["pad"], sp["mask"]]).any()
        assert sop[r] in (0, 1)
        if r < 200:  # A and B are runs of the sample's sentences, in document order unless swapped
            first, end, target = train.samples[r]
            assert n - 3 <= target
            source = train._sentences(int(first), int(end))[0]
            a, b = originals[r, 1:la + 1], originals[r, la + 2:n - 1]
            pa, pb = find(source, a), find(source, b)
            assert pa >= 0 and pb >= 0
            assert (pa < pb) == (sop[r] == 0)


def find(haystack: np.ndarray, needle: np.ndarray) -> int:
    hay, pin = haystack.astype("<i8").tobytes(), needle.astype("<i8").tobytes()
    at = hay.find(pin)
    while at >= 0 and at % 8:
        at = hay.find(pin, at + 1)
    return at // 8 if at >= 0 else -1


def test_masking_rate_and_the_80_10_10_split(rows, tok):
    ids, _, attention, labels, _ = parts(rows)
    masked = labels != IGNORE_INDEX
    real = attention.sum(1) - 3
    budget = np.maximum(1, np.round(0.15 * real))
    assert (masked.sum(1) <= budget).all() and (masked.sum(1) == budget).mean() > 0.9
    assert masked.sum() / real.sum() == pytest.approx(0.15, abs=0.005)
    to_mask = ids[masked] == tok.special_ids["mask"]
    kept = ids[masked] == labels[masked]
    assert to_mask.mean() == pytest.approx(0.8, abs=0.02)
    assert kept.mean() == pytest.approx(0.1, abs=0.02)
    assert (~to_mask & ~kept).mean() == pytest.approx(0.1, abs=0.02)
    randoms = ids[masked][~to_mask & ~kept]
    assert len(np.unique(randoms)) > 0.8 * len(randoms)  # drawn from the whole vocabulary


def test_whole_words_are_masked_together_in_ngrams(rows, tok):
    cont = wordpiece_continuations(tok)
    assert cont[tok.encode("unyoked")[1:]].all() and not cont[tok.encode("unyoked")[0]]
    ids, types, attention, labels, _ = parts(rows)
    masked = labels != IGNORE_INDEX
    originals = np.where(masked, labels, ids)
    pieces = adjacent = adjacent_both = 0
    for r in range(len(rows)):
        n = int(attention[r].sum())
        la = int((types[r, :n] == 0).sum()) - 2
        words = []
        for segment in (range(1, la + 1), range(la + 2, n - 1)):
            for p in segment:
                if cont[originals[r, p]] and p != segment.start:
                    words[-1].append(p)
                    pieces += 1
                else:
                    words.append([p])
        for word in words:
            assert len(set(masked[r, word].tolist())) == 1, "a word is masked only in part"
        flags = [bool(masked[r, w[0]]) for w in words]
        for x, y in itertools.pairwise(flags):
            adjacent += x
            adjacent_both += x and y
    assert pieces > 1000  # the corpus has many multi-piece words
    assert adjacent_both / adjacent > 0.3  # n-grams: unigrams alone would give about 0.15


def test_sentence_order_labels_are_balanced(rows):
    assert parts(rows)[4].mean() == pytest.approx(0.5, abs=0.04)


# ---- determinism and the cache ---------------------------------------------------------------------
def test_a_sample_depends_only_on_seed_and_index(built, tmp_path):
    _, train, _ = built
    same = dataset(built, tmp_path, num_samples=16)  # a fresh object and cache, the build's arguments
    assert np.array_equal(same.samples, train.samples)
    order = [7, 3, 0, 3, 11, 7]
    first = {i: train[i].tobytes() for i in order}
    for i in reversed(order):  # another object, another order: the same bytes
        assert same[i].tobytes() == first[i]
    other = dataset(built, tmp_path / "c", seed=99, num_samples=16)
    assert not np.array_equal(other.samples, train.samples)
    assert all(other[i].tobytes() != first[i] for i in order)


def test_the_sample_mapping_is_cached_and_reused(built, tmp_path, monkeypatch):
    calls = []
    real = bert_dataset.build_sample_mapping
    monkeypatch.setattr(bert_dataset, "build_sample_mapping", lambda *a, **k: calls.append(1) or real(*a, **k))
    a = dataset(built, tmp_path, num_samples=50)
    files = sorted((tmp_path / "index-cache").glob("*-samples.npy"))
    assert len(calls) == 1 and len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    b = dataset(built, tmp_path, num_samples=50)
    assert len(calls) == 1 and files[0].stat().st_mtime_ns == mtime  # read back, not rebuilt
    assert np.array_equal(a.samples, b.samples) and a[5].tobytes() == b[5].tobytes()
    dataset(built, tmp_path, num_samples=50, seq_len=64)
    dataset(built, tmp_path, num_samples=50, short_seq_prob=0.2)
    assert len(calls) == 3  # another T or probability: another mapping


# ---- batches ---------------------------------------------------------------------------------------
def test_collate_and_the_batch_loader(built, rows):
    _, train, _ = built
    inputs, targets = train.collate(rows[:4])
    assert inputs.shape == (4, 3, T) and targets.shape == (4, T + 1)
    assert inputs.dtype == targets.dtype == torch.int64
    ids, types, attention, labels, sop = (torch.from_numpy(x) for x in parts(rows[:4]))
    assert torch.equal(inputs[:, 0], ids) and torch.equal(inputs[:, 1], types)
    # the attention mask, with the predicted tokens flagged 2 for the MLM head
    assert torch.equal(inputs[:, 2], attention + (labels != -100)) and 2 in set(inputs[:, 2].unique().tolist())
    assert torch.equal(targets[:, :T], labels) and torch.equal(targets[:, T], sop)
    loader = BatchLoader(train, micro_batch_size=2, seed=0)
    for step in range(2):  # shuffled = True: read in order
        x, y = loader.next()
        want_x, want_y = train.collate(rows[2 * step:2 * step + 2])
        assert torch.equal(x, want_x) and torch.equal(y, want_y)
    assert loader.consumed == 4


def test_weighted_prefixes_blend_with_collate(tmp_path, tok):
    plays = sorted(shakespeare_files(), key=lambda f: f.stat().st_size)
    prepare([str(p) for p in plays[3:5]], "bert", str(tmp_path / "a"), split_sentences=True, **QUIET)
    prepare([str(p) for p in plays[5:7]], "bert", str(tmp_path / "b"), split_sentences=True, **QUIET)
    cfg = bert_config(tmp_path, tmp_path / "cache", seq_len=32,
                      paths=["0.75", str(tmp_path / "a"), "0.25", str(tmp_path / "b")], split="1,1,0")
    _, train, valid = build_bert_datasets(cfg, progress=False)
    assert isinstance(train, BlendedBertDataset) and train.weights == [0.75, 0.25]
    x, y = BatchLoader(train, 4, 0).next()
    assert x.shape == (4, 3, 32) and y.shape == (4, 33)
    assert len(valid) > 0 and (x[:, 0, 0] == tok.special_ids["cls"]).all()


# ---- errors ----------------------------------------------------------------------------------------
def test_clear_errors(built, tmp_path):
    cache = built[1].indexed.prefix.rsplit("/prepared/", 1)[0]
    with pytest.raises(ConfigError, match="model.seq_len=7 .* at least 8"):
        build_bert_datasets(bert_config(tmp_path, cache, seq_len=7))
    with pytest.raises(ConfigError, match=r"data.tokenizer='gpt2' has no \[CLS\], \[SEP\], \[PAD\], \[MASK\]"):
        build_bert_datasets(tiny_config(tmp_path / "run", data={"cache_dir": cache}))
    play = sorted(shakespeare_files(), key=lambda f: f.stat().st_size)[3]
    prepare([str(play)] * 3, "bert", str(tmp_path / "whole"), **QUIET)  # one sequence per document
    with pytest.raises(ConfigError, match="data.paths: .*whole has no document of two or more sentences.*"
                                          "--split-sentences"):
        build_bert_datasets(bert_config(tmp_path, cache, paths=[str(tmp_path / "whole")], split="2,1,0"))
    (tmp_path / "one.jsonl").write_text('{"text": "A single sentence."}\n' * 3)
    with pytest.raises(ConfigError, match="no document of two or more sentences"):
        build_bert_datasets(bert_config(tmp_path, cache, paths=[str(tmp_path / "one.jsonl")], split="2,1,0"))
