"""Megatron-compatible indexed dataset: `PREFIX.bin` (tokens) + `PREFIX.idx` (index), plus our sidecar.

`.bin` is every sequence's tokens back to back in one dtype, little-endian. `.idx` (all little-endian):

    offset  size        field
    0       9           magic  b"MMIDIDX\\x00\\x00"
    9       8   <Q      version = 1
    17      1   <B      dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    18      8   <Q      sequence count S
    26      8   <Q      document-index count D + 1 (one entry per document, plus the leading 0)
    34      4·S <i4     sequence lengths (tokens)
    ..      8·S <i8     sequence byte pointers into .bin
    ..      8·(D+1) <i8 document indices: document d is sequences [doc_idx[d], doc_idx[d+1]); doc_idx[0] = 0

This is the layout of Megatron-LM's `megatron/core/datasets/indexed_dataset.py`, so data prepared by
either tool trains in the other. meshlm writes one sequence per document (Megatron's GPT data without
`--split-sentences`), or with `--split-sentences` one per sentence (what Megatron's BERT data reads);
the reader accepts both.

`PREFIX.json` is meshlm's own sidecar (Megatron ignores it): the tokenizer's identity and the text's
byte count (for bits per byte). A writer renames `.bin`, then the sidecar, then `.idx` into place, and
removes an old `.idx` first, so a killed run never leaves an `.idx` that describes the wrong `.bin`.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

from meshlm.core.config import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("<u1"), 2: np.dtype("<i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
    5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2"),
}
CODE_OF_DTYPE = {dt: code for code, dt in DTYPE_CODES.items()}


class IndexedFormatError(ConfigError):
    """An `.idx`/`.bin` pair that does not follow the format (a user error: the CLI prints one line)."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab below 65,536), else int32 (Megatron's two token dtypes)."""
    return np.dtype("<u2") if vocab_size < 65536 else np.dtype("<i4")


def paths_of(prefix: str | Path) -> tuple[Path, Path, Path]:
    """(`.bin`, `.idx`, `.json` sidecar) of a prefix."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx"), Path(prefix + ".json")


def strip_suffix(path: str) -> str:
    """`corpus.bin` / `corpus.idx` → `corpus`; other paths unchanged."""
    return path[:-4] if path.endswith((".bin", ".idx")) else path


def is_prefix(path: str | Path) -> bool:
    bin_path, idx_path, _ = paths_of(strip_suffix(str(path)))
    return bin_path.is_file() and idx_path.is_file()


def write_index(fh, dtype: np.dtype, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write a whole `.idx` from in-memory arrays (small datasets and tests; the writer streams)."""
    lengths = np.asarray(sequence_lengths, dtype="<i4")
    pointers = np.zeros(len(lengths), dtype="<i8")
    np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    fh.write(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", CODE_OF_DTYPE[np.dtype(dtype)]))
    fh.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(document_indices)))
    fh.write(lengths.tobytes())
    fh.write(pointers.tobytes())
    fh.write(np.asarray(document_indices, dtype="<i8").tobytes())


class IndexedWriter:
    """Streams documents into `PREFIX.bin`; `finish()` writes `.idx` and the sidecar, atomically.

    Memory is bounded: tokens go straight to a temporary `.bin`, sequence lengths and document ends to
    temporary files, and `finish()` builds the index from them in blocks.

        with IndexedWriter("data/corpus", vocab_size=50257) as w:
            w.add_document(ids)
            w.finish({"tokenizer": ...})

    A document is one sequence unless `end_sequences` closes some of its tokens as sequences first
    (sentences): the tokens added are "open" until a sequence or the document closes them.
    """

    BLOCK = 1 << 20  # documents per block when building the index

    def __init__(self, prefix: str | Path, vocab_size: int | None = None, dtype: np.dtype | None = None):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype) if dtype is not None else dtype_for_vocab(vocab_size or 65536)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron code; use one of {list(CODE_OF_DTYPE)}")
        self.bin_path, self.idx_path, self.meta_path = paths_of(self.prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        pid = os.getpid()  # several writers (e.g. ranks preparing one cache) never share a temporary
        self._bin_tmp = self.bin_path.with_name(f".{self.bin_path.name}.{pid}.tmp")
        self._len_tmp = self.bin_path.with_name(f".{self.bin_path.name}.{pid}.lengths.tmp")
        self._docs_tmp = self.bin_path.with_name(f".{self.bin_path.name}.{pid}.documents.tmp")
        self._idx_tmp = self.idx_path.with_name(f".{self.idx_path.name}.{pid}.tmp")
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 (open until finish/abort)
        self._lengths = open(self._len_tmp, "wb")  # noqa: SIM115
        self._docs = open(self._docs_tmp, "wb")  # noqa: SIM115 (int64 sequence count at each document's end)
        self._doc_tokens = 0  # tokens of the document being written
        self._open_tokens = 0  # its last tokens, not yet closed into a sequence
        self._doc_sequences = 0  # sequences it has closed
        self._last_length = 0  # tokens of the last of them
        self._doc_start = 0  # .bin byte offset where it began
        self.n_documents = 0
        self.n_sequences = 0
        self.n_tokens = 0
        self.finished = False

    def add_tokens(self, tokens) -> None:
        """Append tokens to the current document (a document may arrive in several parts)."""
        arr = self._checked(tokens)
        self._bin.write(memoryview(arr).cast("B"))
        self._doc_tokens += arr.size
        self._open_tokens += arr.size

    def copy_tokens(self, fd: int, offset: int, count: int) -> None:
        """Append to the current document `count` tokens of this writer's dtype that sit at byte `offset`
        of the open file `fd` (the kernel copies them where it can, without passing through Python)."""
        self._bin.flush()
        out, start, n_bytes = self._bin.fileno(), self._bin.tell(), count * self.dtype.itemsize
        done = 0
        while done < n_bytes:
            try:
                step = os.copy_file_range(fd, out, n_bytes - done, offset + done, start + done)
            except (AttributeError, OSError):  # no copy_file_range here (or not between these files)
                step = os.pwrite(out, os.pread(fd, n_bytes - done, offset + done), start + done)
            if step == 0:
                raise ValueError(f"the source holds fewer than {count} tokens at byte {offset}")
            done += step
        self._bin.seek(start + n_bytes)
        self._doc_tokens += count
        self._open_tokens += count

    def end_documents(self, lengths, sequences=None) -> None:
        """Close the tokens added since the last document ended as documents of `lengths` tokens each; or,
        with `sequences` (sequences per document, each at least 1), as sequences of `lengths` tokens
        each, grouped into documents of `sequences[d]` sequences."""
        lengths = self._valid_lengths(lengths, "document" if sequences is None else "sequence")
        if self._doc_sequences:
            self.discard_document()
            raise ValueError("end_documents after end_sequences: end the open document with end_document first")
        if int(lengths.sum()) != self._doc_tokens:
            n = self._doc_tokens
            self.discard_document()
            raise ValueError(f"document lengths add up to {int(lengths.sum())} tokens, not {n}")
        if sequences is None:
            ends = self.n_sequences + np.arange(1, lengths.size + 1, dtype=np.int64)
        else:
            sequences = np.asarray(sequences, dtype=np.int64)
            if int(sequences.sum()) != lengths.size or (sequences.size and sequences.min() < 1):
                self.discard_document()
                raise ValueError(f"sequences per document {sequences.tolist()[:8]} must be >= 1 and add up to "
                                 f"the {lengths.size} sequence lengths")
            ends = self.n_sequences + np.cumsum(sequences)
        self._lengths.write(lengths.astype("<i4").tobytes())
        self._docs.write(ends.astype("<i8").tobytes())
        self.n_sequences += lengths.size
        self.n_documents += ends.size
        self.n_tokens += self._doc_tokens
        self._doc_start = self._bin.tell()
        self._doc_tokens = self._open_tokens = 0

    def _valid_lengths(self, lengths, what: str) -> np.ndarray:
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size and (lengths.min() <= 0 or lengths.max() > np.iinfo(np.int32).max):
            self.discard_document()
            raise ValueError(f"{what} lengths must be 1..{np.iinfo(np.int32).max} tokens")
        return lengths

    @property
    def open_tokens(self) -> int:
        """Tokens of the current document not yet closed into a sequence."""
        return self._open_tokens

    def end_sequences(self, lengths) -> None:
        """Close the first of the current document's open tokens as sequences of `lengths` tokens each
        (e.g. sentences); the document stays open, and so do its tokens beyond them."""
        lengths = self._valid_lengths(lengths, "sequence")
        if int(lengths.sum()) > self._open_tokens:
            n = self._open_tokens
            self.discard_document()
            raise ValueError(f"sequence lengths add up to {int(lengths.sum())} tokens, more than the {n} open")
        self._lengths.write(lengths.astype("<i4").tobytes())
        if lengths.size:
            self._last_length = int(lengths[-1])
        self._open_tokens -= int(lengths.sum())
        self._doc_sequences += lengths.size
        self.n_sequences += lengths.size

    def _checked(self, tokens) -> np.ndarray:
        """`tokens` as a contiguous array of the writer's dtype; an id the dtype cannot hold is an error."""
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype and arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token id out of range for {self.dtype} (ids {arr.min()}..{arr.max()})")
        return np.ascontiguousarray(arr, dtype=self.dtype)

    def end_document(self, join: bool = False) -> bool:
        """Close the current document: its open tokens become its last sequence or, with `join`, are
        added to its last sequence (if it has one). A document without tokens is dropped (a zero-length
        sequence helps nobody). Returns whether a document was written."""
        if self._open_tokens:
            if join and self._doc_sequences:
                self._lengths.flush()
                length = self._last_length + self._open_tokens
                self._check_sequence(length)
                os.pwrite(self._lengths.fileno(), struct.pack("<i", length), self._lengths.tell() - 4)
            else:
                self._check_sequence(self._open_tokens)
                self._lengths.write(struct.pack("<i", self._open_tokens))
                self._doc_sequences += 1
                self.n_sequences += 1
        written = self._doc_sequences > 0
        if written:
            self._docs.write(struct.pack("<q", self.n_sequences))
            self.n_documents += 1
            self.n_tokens += self._doc_tokens
        self._doc_start = self._bin.tell()
        self._doc_tokens = self._open_tokens = self._doc_sequences = 0
        return written

    @staticmethod
    def _check_sequence(n_tokens: int) -> None:
        if n_tokens > np.iinfo(np.int32).max:
            raise ValueError(f"a sequence of {n_tokens} tokens exceeds the int32 sequence length")

    def discard_document(self) -> None:
        """Forget the tokens (and sequences) written for the current document."""
        self._bin.seek(self._doc_start)
        self._bin.truncate()
        if self._doc_sequences:
            self._lengths.seek(-4 * self._doc_sequences, os.SEEK_END)
            self._lengths.truncate()
            self.n_sequences -= self._doc_sequences
        self._doc_tokens = self._open_tokens = self._doc_sequences = 0

    def add_document(self, tokens) -> None:
        self.add_tokens(tokens)
        self.end_document()

    def _write_index(self, path: Path) -> None:
        n, n_docs = self.n_sequences, self.n_documents
        with open(path, "wb") as fh:
            fh.write(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            fh.write(struct.pack("<Q", n) + struct.pack("<Q", n_docs + 1))
            lengths = np.memmap(self._len_tmp, dtype="<i4", mode="r") if n else np.zeros(0, "<i4")
            fh.writelines(np.asarray(lengths[s:s + self.BLOCK]).tobytes() for s in range(0, n, self.BLOCK))
            pointer = 0
            for start in range(0, n, self.BLOCK):
                block = np.asarray(lengths[start:start + self.BLOCK], dtype=np.int64) * self.dtype.itemsize
                ends = np.cumsum(block) + pointer
                fh.write((ends - block).astype("<i8").tobytes())
                pointer = int(ends[-1])
            fh.write(struct.pack("<q", 0))
            ends = np.memmap(self._docs_tmp, dtype="<i8", mode="r") if n_docs else np.zeros(0, "<i8")
            fh.writelines(np.asarray(ends[s:s + self.BLOCK]).tobytes() for s in range(0, n_docs, self.BLOCK))
            del lengths, ends
            fh.flush()
            os.fsync(fh.fileno())

    def finish(self, metadata: dict | None = None) -> None:
        """Move `.bin`, sidecar and `.idx` into place (in that order)."""
        if self._doc_tokens:
            self.end_document()
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        self._lengths.close()
        self._docs.close()
        self._write_index(self._idx_tmp)
        meta_tmp = None
        if metadata is not None:
            meta = {"format": "meshlm-indexed/1", "documents": self.n_documents, "sequences": self.n_sequences,
                    "tokens": self.n_tokens, "dtype": self.dtype.name, **metadata}
            fd, name = tempfile.mkstemp(dir=self.meta_path.parent, prefix=f".{self.meta_path.name}.")
            with os.fdopen(fd, "w") as fh:
                json.dump(meta, fh, indent=1)
            os.chmod(name, 0o644)  # mkstemp makes it private; the sidecar is as public as the data
            meta_tmp = Path(name)
        self.idx_path.unlink(missing_ok=True)  # an old .idx must never describe the new .bin
        os.replace(self._bin_tmp, self.bin_path)
        if meta_tmp is not None:
            os.replace(meta_tmp, self.meta_path)
        else:
            self.meta_path.unlink(missing_ok=True)
        os.replace(self._idx_tmp, self.idx_path)
        self._len_tmp.unlink(missing_ok=True)
        self._docs_tmp.unlink(missing_ok=True)
        self.finished = True

    def abort(self) -> None:
        """Remove the temporary files; nothing at PREFIX changes."""
        for fh in (self._bin, self._lengths, self._docs):
            fh.close()
        for path in (self._bin_tmp, self._len_tmp, self._docs_tmp, self._idx_tmp):
            path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.finished:
            self.abort()


class IndexedDataset:
    """Memory-mapped reader of a `.bin`/`.idx` pair (ours or Megatron's)."""

    def __init__(self, prefix: str | Path):
        self.prefix = strip_suffix(str(prefix))
        self.bin_path, self.idx_path, self.meta_path = paths_of(self.prefix)
        with open(self.idx_path, "rb") as fh:
            header = fh.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE or header[:9] != MAGIC:
            raise IndexedFormatError(f"{self.idx_path} is not a Megatron MMIDIDX index (bad magic)")
        version, code, n_seq, n_doc_idx = struct.unpack("<QBQQ", header[9:])
        if version != VERSION or code not in DTYPE_CODES:
            raise IndexedFormatError(f"{self.idx_path}: unsupported version {version} or dtype code {code}")
        self.dtype = DTYPE_CODES[code]
        expected, idx_size = HEADER_SIZE + 12 * n_seq + 8 * n_doc_idx, self.idx_path.stat().st_size
        if idx_size != expected or n_doc_idx < 1:
            raise IndexedFormatError(f"{self.idx_path} is {idx_size:,} bytes but its header describes {n_seq:,} "
                                     f"sequences and {n_doc_idx:,} document indices, {expected:,} bytes; "
                                     "prepare the data again")
        idx = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(idx, "<i4", n_seq, HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(idx, "<i8", n_seq, HEADER_SIZE + 4 * n_seq)
        self.document_indices = np.frombuffer(idx, "<i8", n_doc_idx, HEADER_SIZE + 12 * n_seq)
        if self.document_indices[-1] != n_seq:
            raise IndexedFormatError(f"{self.idx_path}: document indices end at {self.document_indices[-1]}, "
                                     f"not at the sequence count {n_seq}")
        n_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        self._check_bin(n_tokens)
        self.tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r") if n_tokens
                       else np.zeros(0, self.dtype))  # all tokens, flat (mmap of an empty file fails)
        self.n_sequences = int(n_seq)
        self.n_documents = int(n_doc_idx) - 1

    def _check_bin(self, n_tokens: int) -> None:
        """`.bin` holds exactly the tokens `.idx` describes, back to back (a longer or shorter one belongs
        to another index, or was cut or appended to)."""
        size, want = self.bin_path.stat().st_size, n_tokens * self.dtype.itemsize
        if (self.sequence_lengths < 0).any():
            raise IndexedFormatError(f"{self.idx_path} holds negative sequence lengths; prepare the data again")
        ends = self.sequence_pointers.astype(np.int64) + self.sequence_lengths * self.dtype.itemsize
        if size != want or (len(ends) and (self.sequence_pointers.min() < 0 or int(ends.max()) > size)):
            raise IndexedFormatError(
                f"{self.bin_path} is {size:,} bytes but {self.idx_path} describes {n_tokens:,} tokens of "
                f"{self.dtype.name}, {want:,} bytes ({'longer' if size > want else 'shorter'} than its index: "
                "the pair does not belong together, or one was cut); prepare the data again")

    def __len__(self) -> int:
        """Number of sequences, as in Megatron."""
        return self.n_sequences

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.sequence_lengths[i])]

    @property
    def document_lengths(self) -> np.ndarray:
        """(n_documents,) tokens per document (the sum of its sequences)."""
        cum = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        return cum[self.document_indices[1:]] - cum[self.document_indices[:-1]]

    def document(self, d: int) -> np.ndarray:
        """All tokens of document d (its sequences are contiguous in `.bin`)."""
        first, last = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if first == last:
            return self.tokens[:0]
        start = int(self.sequence_pointers[first]) // self.dtype.itemsize
        end = int(self.sequence_pointers[last - 1]) // self.dtype.itemsize + int(self.sequence_lengths[last - 1])
        return self.tokens[start:end]

    @property
    def metadata(self) -> dict | None:
        """meshlm's sidecar (tokenizer identity, text bytes), or None for data prepared elsewhere."""
        if not self.meta_path.exists():
            return None
        return json.loads(self.meta_path.read_text())
