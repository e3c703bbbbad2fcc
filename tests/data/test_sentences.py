"""The sentence splitter and `meshlm prepare --split-sentences`: one sequence per sentence, documents in
the `.idx` document index, the same bytes for any number of workers and any cut into pieces."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from meshlm.data.assets import shakespeare_files
from meshlm.data.indexed import IndexedDataset
from meshlm.data.items import CUT_AT
from meshlm.data.prepare import prepare
from meshlm.data.sentences import sentences_of, split_sentences
from meshlm.data.tokenizers import get_tokenizer

QUIET = {"progress": False, "log": lambda line: None}


def small_plays(n: int = 3):
    return sorted(shakespeare_files(), key=lambda f: f.stat().st_size)[:n]


@pytest.mark.parametrize("text,expected", [
    ("One. Two! Three? Four", ["One. ", "Two! ", "Three? ", "Four"]),
    ("Mr. Smith met Dr. Who at St. Paul's. Then they left.", ["Mr. Smith met Dr. Who at St. Paul's. ",
                                                             "Then they left."]),
    ("J. R. Tolkien wrote it. I said I. Then left.", ["J. R. Tolkien wrote it. ", "I said I. ", "Then left."]),
    ("See e.g. the U.S.A. here. Next.", ["See e.g. the U.S.A. here. ", "Next."]),
    ('"Is it?" she asked. "Yes." (It was.) [Exit.] Done', ['"Is it?" she asked. ', '"Yes." ', "(It was.) ",
                                                          "[Exit.] ", "Done"]),
    ("\u201cQuoted.\u201d Next\u2026 Then. pi is 3.14 here.", ["\u201cQuoted.\u201d ", "Next\u2026 ",
                                                             "Then. pi is 3.14 here."]),
    ("Wait... what?! No. I say no. Art thou? Thou art.", ["Wait... what?! ", "No. ", "I say no. ",
                                                          "Art thou? ", "Thou art."]),
    ("O Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father\nand refuse thy name.\n",
     ["O Romeo, Romeo! wherefore art thou Romeo?\n", "Deny thy father\nand refuse thy name.\n"]),
    ("ACT I.\n\nSCENE 1. A room.\n\n[Enter BERTRAM, all\nin black]\n\nCOUNTESS.\nIn delivering my son.\n",
     ["ACT I.\n\n", "SCENE 1. ", "A room.\n\n", "[Enter BERTRAM, all\nin black]\n\n", "COUNTESS.\n",
      "In delivering my son.\n"]),
    ("  leading space. X", ["  leading space. ", "X"]),
    ("", []),
])
def test_sentence_split_rules(text, expected):
    assert sentences_of(text) == expected
    assert "".join(sentences_of(text)) == text


def test_semicolon_and_colon_end_sentences_only_when_asked():
    text = "He came; he saw: he won. Done."
    assert sentences_of(text) == ["He came; he saw: he won. ", "Done."]
    assert sentences_of(text, ends=".!?;:") == ["He came; ", "he saw: ", "he won. ", "Done."]


def test_pieces_cut_where_prepare_cuts_split_like_the_whole_text():
    """prepare cuts a long text only after a newline between printable characters; splitting the pieces
    and joining each piece's unfinished last sentence to the next piece's first gives the whole text's
    sentences."""
    data = small_plays(6)[5].read_bytes()  # a play of 100 KB
    whole = sentences_of(data.decode())
    cuts = [m.end() for m in CUT_AT["text"].finditer(data)]
    for cut_set in [cuts[::97], random.Random(0).sample(cuts, 300), cuts[:2000:3]]:
        bounds = [0, *sorted(cut_set), len(data)]
        joined, open_ = [], ""
        for a, b in itertools.pairwise(bounds):
            closed, rest = split_sentences(data[a:b].decode())
            if closed:
                joined += [open_ + closed[0], *closed[1:]]
                open_ = rest
            else:
                open_ += rest
        joined += [open_] if open_ else []
        assert joined == whole


def document_sentences(data: IndexedDataset, d: int) -> list[list[int]]:
    first, last = int(data.document_indices[d]), int(data.document_indices[d + 1])
    return [data[s].tolist() for s in range(first, last)]


@pytest.mark.parametrize("spec", ["bert", "gpt2"])
def test_prepared_documents_tile_into_sentences_that_decode_back(tmp_path, spec):
    plays = small_plays(3)
    (tmp_path / "speeches.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in
                                                     ["Mr. Smith came. He left!", "", "One sentence only"]))
    inputs = [str(p) for p in plays] + [str(tmp_path / "speeches.jsonl")]
    stats = prepare(inputs, spec, str(tmp_path / "out"), split_sentences=True, piece_bytes=4096, **QUIET)
    data, tok = IndexedDataset(tmp_path / "out"), get_tokenizer(spec)
    texts = [p.read_text() for p in plays] + ["Mr. Smith came. He left!", "One sentence only"]
    assert data.n_documents == stats.documents == len(texts) and stats.empty_documents == 1
    assert data.n_sequences == stats.sentences == data.metadata["sequences"] > 10 * len(texts)
    assert data.metadata["split_sentences"] is True
    for d, text in enumerate(texts):
        sentences = [s for s in sentences_of(text) if tok.encode(s)]  # a sentence without tokens is dropped
        got = document_sentences(data, d)
        assert got == [tok.encode(s) for s in sentences]
        assert np.concatenate(got).tolist() == data.document(d).tolist()  # the sentences tile the document
        if spec == "gpt2":
            assert "".join(tok.decode(ids) for ids in got) == text  # exact text, sentence by sentence
        else:
            for ids, sentence in zip(got, sentences):
                assert tok.normalized_words(tok.decode(ids)) == tok.normalized_words(sentence)
    expected = ["Mr. Smith came. ", "He left!"] if spec == "gpt2" else ["mr. smith came.", "he left!"]
    assert [tok.decode(ids) for ids in document_sentences(data, 3)] == expected


@pytest.mark.parametrize("append_eod", [False, True])
def test_one_and_two_workers_write_the_same_bytes(tmp_path, append_eod):
    inputs = [str(p) for p in small_plays(4)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"Doc {i}. It ends? Yes."}) + "\n"
                                              for i in range(50)))
    inputs.append(str(tmp_path / "d.jsonl"))
    kw = {"split_sentences": True, "append_eod": append_eod, **QUIET}
    prepare(inputs, "bert", str(tmp_path / "one"), workers=1, **kw)
    prepare(inputs, "bert", str(tmp_path / "two"), workers=2, chunk_bytes=3000, piece_bytes=2000, **kw)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"two{suffix}").read_bytes()
    data = IndexedDataset(tmp_path / "one")
    if append_eod:  # the end of document ends each document's last sentence, nowhere else
        eod = get_tokenizer("bert").eod_id
        last = data.document_indices[1:] - 1
        assert all(data[int(s)][-1] == eod for s in last)
        assert sum(int((data[s] == eod).sum()) for s in range(len(data))) == data.n_documents


def test_end_of_document_joins_the_last_sentence_when_the_last_piece_has_no_tokens(tmp_path):
    (tmp_path / "a.txt").write_text("Hello there. General Kenobi\nsaid he.\n" + "\n" * 200_000)
    prepare([str(tmp_path / "a.txt")], "bert", str(tmp_path / "out"), split_sentences=True, append_eod=True,
            piece_bytes=65536, **QUIET)
    data, tok = IndexedDataset(tmp_path / "out"), get_tokenizer("bert")
    assert [tok.decode(ids) for ids in document_sentences(data, 0)] == ["hello there.",
                                                                         "general kenobi said he. [SEP]"]


def test_without_split_sentences_each_document_stays_one_sequence(tmp_path):
    prepare([str(p) for p in small_plays(2)], "bert", str(tmp_path / "out"), **QUIET)
    data = IndexedDataset(tmp_path / "out")
    assert data.n_sequences == data.n_documents == 2
    assert data.document_indices.tolist() == [0, 1, 2]
