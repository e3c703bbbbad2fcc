"""The .bin/.idx pair: exact Megatron layout, reading a pair from an independent reference writer,
and crash safety of the writer."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from meshlm.data import indexed
from meshlm.data.indexed import IndexedDataset, IndexedFormatError, IndexedWriter, is_prefix

DOCS = [[5, 6, 7], [50256], [1, 2, 3, 4, 65535 - 1]]


def reference_write(prefix, sequences: list[list[int]], document_indices: list[int], dtype: str, code: int):
    """Megatron's format written straight from the spec (not with meshlm's writer)."""
    itemsize = np.dtype(dtype).itemsize
    with open(f"{prefix}.bin", "wb") as fh:
        fh.writelines(np.array(seq, dtype=dtype).tobytes() for seq in sequences)
    pointers, offset = [], 0
    for seq in sequences:
        pointers.append(offset)
        offset += len(seq) * itemsize
    with open(f"{prefix}.idx", "wb") as fh:
        fh.write(b"MMIDIDX\x00\x00")
        fh.write(struct.pack("<Q", 1))
        fh.write(struct.pack("<B", code))
        fh.write(struct.pack("<Q", len(sequences)))
        fh.write(struct.pack("<Q", len(document_indices)))
        fh.write(struct.pack(f"<{len(sequences)}i", *[len(s) for s in sequences]))
        fh.write(struct.pack(f"<{len(pointers)}q", *pointers))
        fh.write(struct.pack(f"<{len(document_indices)}q", *document_indices))


def test_written_pair_has_the_documented_megatron_layout(tmp_path):
    prefix = tmp_path / "corpus"
    with IndexedWriter(prefix, vocab_size=50257) as w:
        for doc in DOCS:
            w.add_document(doc)
        w.finish({"note": "test"})
    idx = (tmp_path / "corpus.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", idx[9:17]) == (1,)  # version
    assert idx[17] == 8  # uint16, Megatron's code
    assert struct.unpack("<QQ", idx[18:34]) == (3, 4)  # sequences; document indices (documents + 1)
    assert struct.unpack("<3i", idx[34:46]) == (3, 1, 5)  # lengths
    assert struct.unpack("<3q", idx[46:70]) == (0, 6, 8)  # byte pointers (2 bytes per token)
    assert struct.unpack("<4q", idx[70:102]) == (0, 1, 2, 3)  # document indices
    assert len(idx) == 102
    expected = np.array([t for d in DOCS for t in d], dtype="<u2").tobytes()
    assert (tmp_path / "corpus.bin").read_bytes() == expected


def test_dtype_follows_vocab_size():
    assert indexed.dtype_for_vocab(50257) == np.dtype("<u2")
    assert indexed.dtype_for_vocab(65535) == np.dtype("<u2")
    assert indexed.dtype_for_vocab(65536) == np.dtype("<i4")
    assert indexed.dtype_for_vocab(128256) == np.dtype("<i4")


def test_int32_pair_for_a_large_vocab(tmp_path):
    with IndexedWriter(tmp_path / "big", vocab_size=128256) as w:
        w.add_document([100_000, 3])
        w.finish()
    idx = (tmp_path / "big.idx").read_bytes()
    assert idx[17] == 4  # int32
    assert IndexedDataset(tmp_path / "big").document(0).tolist() == [100_000, 3]


@pytest.mark.parametrize("dtype,code", [("<u2", 8), ("<i4", 4)])
def test_reference_pair_reads_back_token_identical(tmp_path, dtype, code):
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 60000, size=n).tolist() for n in (7, 1, 12, 3, 9)]
    document_indices = [0, 2, 3, 5]  # three documents: sequences {0,1}, {2}, {3,4} (Megatron's sentence split)
    reference_write(tmp_path / "ref", sequences, document_indices, dtype, code)
    data = IndexedDataset(tmp_path / "ref")
    assert (len(data), data.n_documents, data.dtype) == (5, 3, np.dtype(dtype))
    assert [data[i].tolist() for i in range(5)] == sequences
    assert data.document(0).tolist() == sequences[0] + sequences[1]
    assert data.document(2).tolist() == sequences[3] + sequences[4]
    assert data.document_lengths.tolist() == [8, 12, 12]
    assert data.metadata is None  # no meshlm sidecar


def assert_same_bytes_as_the_reference(tmp_path, prefix) -> None:
    reference_write(tmp_path / "ref", DOCS, [0, 1, 2, 3], "<u2", 8)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"{prefix}{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()


def test_meshlm_pair_equals_the_reference_writers_bytes(tmp_path):
    with IndexedWriter(tmp_path / "ours", vocab_size=50257) as w:
        for doc in DOCS:
            w.add_document(doc)
        w.finish()
    assert_same_bytes_as_the_reference(tmp_path, "ours")


def test_end_documents_closes_many_documents_with_the_same_bytes_as_one_at_a_time(tmp_path):
    with IndexedWriter(tmp_path / "bulk", vocab_size=50257) as w:
        w.add_document(DOCS[0])  # the two ways mix
        w.add_tokens(np.concatenate([np.asarray(d, dtype="<u2") for d in DOCS[1:]]))
        w.end_documents([len(d) for d in DOCS[1:]])
        w.finish()
    assert_same_bytes_as_the_reference(tmp_path, "bulk")


def test_end_documents_refuses_lengths_that_do_not_match_and_add_tokens_ids_out_of_range(tmp_path):
    """A refused call drops the tokens it was to close, so the next documents start clean."""
    with IndexedWriter(tmp_path / "bad", vocab_size=50257) as w:
        w.add_tokens([1, 2, 3, 4, 5])
        with pytest.raises(ValueError, match="add up to 4 tokens, not 5"):
            w.end_documents([2, 2])
        w.add_tokens([1, 2])
        with pytest.raises(ValueError, match="lengths must be 1"):
            w.end_documents([2, 0])
        with pytest.raises(ValueError, match="out of range for uint16"):
            w.add_tokens(np.asarray([70000], dtype=np.int64))
        w.add_tokens([7, 8])
        w.end_documents([2])
        w.finish()
    assert IndexedDataset(tmp_path / "bad").document(0).tolist() == [7, 8]
    assert IndexedDataset(tmp_path / "bad").n_documents == 1


def test_failed_write_leaves_nothing_at_the_prefix(tmp_path):
    with pytest.raises(RuntimeError), IndexedWriter(tmp_path / "corpus", vocab_size=100) as w:
        w.add_document([1, 2, 3])
        raise RuntimeError("killed")
    assert sorted(os.listdir(tmp_path)) == []


def test_interrupted_overwrite_never_leaves_a_stale_idx(tmp_path, monkeypatch):
    prefix = tmp_path / "corpus"
    with IndexedWriter(prefix, vocab_size=100) as w:
        w.add_document([1, 2, 3])
        w.finish()
    real_replace = os.replace

    def die_before_idx(src, dst):
        if str(dst).endswith(".idx"):
            raise KeyboardInterrupt  # killed after the new .bin is in place
        real_replace(src, dst)

    monkeypatch.setattr(indexed.os, "replace", die_before_idx)
    with pytest.raises(KeyboardInterrupt), IndexedWriter(prefix, vocab_size=100) as w:
        w.add_document([4, 5, 6, 7, 8])
        w.finish()
    assert not is_prefix(prefix)  # the old .idx (3 tokens) is gone, so the new .bin is never misread


def test_truncated_index_is_refused(tmp_path):
    with IndexedWriter(tmp_path / "corpus", vocab_size=100) as w:
        w.add_document([1, 2, 3])
        w.finish()
    idx = tmp_path / "corpus.idx"
    idx.write_bytes(idx.read_bytes()[:-8])
    with pytest.raises(IndexedFormatError, match="truncated"):
        IndexedDataset(tmp_path / "corpus")
    idx.write_bytes(b"NOTANIDX" + bytes(40))
    with pytest.raises(IndexedFormatError, match="magic"):
        IndexedDataset(tmp_path / "corpus")


@pytest.mark.parametrize("kernel_copy", [True, False], ids=["copy_file_range", "pread_pwrite"])
def test_copy_tokens_appends_tokens_from_another_file(tmp_path, monkeypatch, kernel_copy):
    """What prepare's main process does with a worker's task file, with the kernel's copy and with the
    fallback used where copy_file_range is missing or refuses (another file system, another OS)."""
    if not kernel_copy:
        def refuse(*args):
            raise OSError(18, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    part = tmp_path / "task.bin"
    part.write_bytes(np.asarray([9, 9, *DOCS[1], *DOCS[2]], dtype="<u2").tobytes())  # 2 tokens of something else first
    with IndexedWriter(tmp_path / "copied", vocab_size=50257) as w, open(part, "rb") as fh:
        w.add_document(DOCS[0])
        w.copy_tokens(fh.fileno(), 4, len(DOCS[1]) + len(DOCS[2]))
        w.end_documents([len(DOCS[1]), len(DOCS[2])])
        w.finish()
    assert_same_bytes_as_the_reference(tmp_path, "copied")


def test_sentences_as_sequences_write_megatron_multi_sequence_documents(tmp_path):
    """Documents of several sequences (sentences), written every way the writer offers, give the bytes of
    the reference writer; a discarded document leaves no sequence behind."""
    sentences = [[[1, 2], [3]], [[4, 5, 6]], [[7], [8, 9], [10]], [[11, 12], [13]]]
    with IndexedWriter(tmp_path / "ours", vocab_size=50257) as w:
        w.add_tokens([1, 2, 3])  # a document whose last sentence stays open until the document ends
        w.end_sequences([2])
        assert w.open_tokens == 1
        assert w.end_document()
        w.add_document([4, 5, 6])
        w.add_tokens([99, 98])  # a discarded document, with a sequence closed already
        w.end_sequences([1])
        w.discard_document()
        w.add_tokens([7, 8])  # sentences closed as tokens arrive; an end token joins the last sentence
        w.end_sequences([1])
        w.add_tokens([9, 10])
        w.end_sequences([2, 1])
        assert w.open_tokens == 0
        assert w.end_document(join=True)  # nothing open: the document just ends
        assert not w.end_document()  # an empty document is not written
        w.add_tokens([11, 12, 13])
        w.end_documents([2, 1], sequences=[2])
        w.finish()
    assert w.n_sequences == 8 and w.n_documents == 4
    flat = [s for doc in sentences for s in doc]
    bounds = list(np.cumsum([0] + [len(doc) for doc in sentences]))
    reference_write(tmp_path / "ref", flat, bounds, "<u2", 8)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()
    data = IndexedDataset(tmp_path / "ours")
    assert data.document(2).tolist() == [7, 8, 9, 10] and data.document_lengths.tolist() == [3, 3, 4, 3]


def test_end_token_joins_the_documents_last_sentence(tmp_path):
    with IndexedWriter(tmp_path / "d", vocab_size=100) as w:
        w.add_tokens([1, 2, 3])
        w.end_sequences([1, 2])
        w.add_tokens([0])
        assert w.end_document(join=True)
        w.finish()
    data = IndexedDataset(tmp_path / "d")
    assert [data[i].tolist() for i in range(len(data))] == [[1], [2, 3, 0]]
    with IndexedWriter(tmp_path / "e", vocab_size=100) as w:
        w.add_tokens([1, 2])
        with pytest.raises(ValueError, match="more than the 2 open"):
            w.end_sequences([2, 1])
        w.add_tokens([1, 2])
        with pytest.raises(ValueError, match="must be >= 1"):
            w.end_documents([1, 1], sequences=[2, 0])
