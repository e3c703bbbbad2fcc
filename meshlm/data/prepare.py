"""`meshlm prepare`: text files → a tokenized, Megatron-compatible `PREFIX.bin`/`PREFIX.idx`.

Work split: the main process only plans. It cuts every file into byte ranges (`Item`s of
`meshlm.data.items`, at most `piece_bytes` each), groups them into tasks and hands the tasks to `workers`
processes, which read their ranges themselves, decode, parse and tokenize, and write the tokens to a
task file; the main process has the kernel append those to the `.bin` in input order. A bounded window
of tasks is in flight, so memory stays flat however large the corpus, and the main process neither
reads the text nor unpickles tokens (with two workers on two cores it would otherwise take a sixth of a
core from them; with sixteen workers it would be the bottleneck).

With `split_sentences`, every sentence is a sequence of its own and the `.idx` document index groups
them into documents (Megatron's `--split-sentences`, the data BERT reads). The workers split the text
(`meshlm.data.sentences`) and tokenize each sentence; a piece of a long text document reports where its
sentences end and how many tokens its unfinished last sentence has, and the main process joins that to
the next piece's first sentence. A sentence without tokens is dropped.

Empty documents (nothing but whitespace) are skipped and counted; invalid UTF-8 is replaced with
U+FFFD and counted; a `.jsonl` line that is not a JSON object with the key is reported as file:line and
skipped, or stops the run with `on_error="fatal"`. Nothing is written at PREFIX unless the run completes.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from meshlm.data.indexed import IndexedWriter, strip_suffix
from meshlm.data.items import (
    PIECE_BYTES,
    DataError,
    Item,
    chunk_bytes_for,
    chunked,
    decode,
    documents,
    expand_inputs,
    file_format,
    iter_texts,
    plan_items,
    read_item,
    refuse_binary,
)
from meshlm.data.sentences import sentences_of, split_sentences
from meshlm.data.tokenizers import get_tokenizer

__all__ = ["DataError", "PrepareStats", "expand_inputs", "iter_texts", "prepare"]
MAX_REPORTED = 10  # bad lines reported one by one; the rest are counted
MAX_LISTED = 1000  # input files named in the sidecar (stats.files counts them all)


@dataclass
class Part:
    """What a worker returns for one Item. A "text" Item gives a piece of its document (`lengths` None);
    the others give whole documents: their tokens back to back. End-of-document tokens (if asked) are
    included: after every document, and after the last piece of a text."""

    tokens: np.ndarray | None  # None once a pool worker has written them to its task's file
    n_tokens: int = 0
    lengths: np.ndarray | None = None  # tokens per document kept
    has_text: bool = False  # a text piece holds more than whitespace
    bad_utf8: int = 0  # documents with invalid UTF-8
    text_bytes: int = 0  # UTF-8 bytes of the documents (pieces) kept
    empty: int = 0  # documents skipped as empty
    errors: list[tuple[int, str]] = field(default_factory=list)  # (line within the Item, reason)
    lines: int = 0  # newlines in a JSON Item's bytes (the main process numbers bad lines across Items)
    # split_sentences only. Whole documents: tokens per sentence (all > 0) and sentences per document.
    # A text piece: tokens per sentence that ends in it (0 for one without tokens; the first also ends the
    # sentence left open by the previous piece); its tokens beyond them are its open last sentence.
    sentences: np.ndarray | None = None
    doc_sentences: np.ndarray | None = None
    eod_only: bool = False  # a text's last piece whose only token is the end of document: it joins the last sentence


@dataclass
class PrepareStats:
    files: int = 0
    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    text_bytes: int = 0  # UTF-8 bytes of the documents kept (after replacement of invalid bytes)
    empty_documents: int = 0
    invalid_utf8_documents: int = 0
    bad_lines: int = 0
    sentences: int = 0  # sequences written: one per document, or per sentence with split_sentences
    split_sentences: bool = False
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first MAX_REPORTED bad lines

    def summary(self, prefix: str) -> str:
        mb, s = self.input_bytes / 1e6, max(self.seconds, 1e-9)
        sentences = f" ({self.sentences:,} sentences)" if self.split_sentences else ""
        return (f"prepared {prefix}.bin/.idx: {self.documents:,} documents{sentences}, {self.tokens:,} tokens from "
                f"{self.files} files ({mb:.2f} MB) in {self.seconds:.1f}s ({mb / s:.2f} MB/s, "
                f"{self.tokens / s:,.0f} tokens/s); skipped {self.empty_documents} empty documents and "
                f"{self.bad_lines} bad lines; {self.invalid_utf8_documents} documents had invalid UTF-8 "
                "(replaced with U+FFFD)")


# ---- worker side -----------------------------------------------------------------------------------
_STATE: dict = {}


def _init_worker(spec: str, json_key: str, dtype: str, eod: int | None, piece_bytes: int,
                 split: bool = False, parts_dir: str | None = None, parent: int | None = None) -> None:
    if parts_dir is not None:  # a pool worker
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C ...
        if hasattr(signal, "pthread_sigmask"):  # ... and blocked it while forking us (see start_pool)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        _die_with_parent(parent)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    _STATE.update(tokenizer=get_tokenizer(spec), json_key=json_key, dtype=np.dtype(dtype), eod=eod,
                  piece_bytes=piece_bytes, split=split, parts_dir=parts_dir)


def _die_with_parent(parent: int | None) -> None:
    """On Linux, have the kernel kill this worker when the main process `parent` dies (kill -9 included);
    otherwise the worker would wait for tasks forever."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if parent is not None and os.getppid() != parent:  # it died before that took effect
            os._exit(1)


def encode_item(item: Item) -> Part:
    """Read, decode, parse and tokenize one Item (in a worker, or in the main process with one worker)."""
    tokenizer, dtype, eod = _STATE["tokenizer"], _STATE["dtype"], _STATE["eod"]
    data = read_item(item, _STATE["piece_bytes"])
    part = Part(None, lines=data.count(b"\n") if item.kind == "json" else 0)  # numbers bad JSON lines
    if item.kind == "text" and _STATE["split"]:
        text, bad = decode(data)
        _encode_sentences(part, text, item.last)
        part.has_text, part.bad_utf8 = text != "" and not text.isspace(), int(bad)
        part.text_bytes = len(text.encode("utf-8")) if bad else len(data)
    elif item.kind == "text":  # a piece of one document: the main process decides when it ends
        text, bad = decode(data)
        encode = getattr(tokenizer, "encode_array", None)  # one long text: no list of Python ints
        tokens = encode(text) if encode else np.asarray(tokenizer.encode(text))
        if eod is not None and item.last:
            tokens = np.append(tokens, eod)
        part.tokens = tokens.astype(dtype, copy=False)
        part.has_text, part.bad_utf8 = text != "" and not text.isspace(), int(bad)
        part.text_bytes = len(text.encode("utf-8")) if bad else len(data)
    else:  # whole documents, usually short: parsed first, then tokenized in one tight loop
        texts: list[str] = []
        bads: list[bool] = []
        for line, text, bad, error in documents(item.kind, data, _STATE["json_key"]):
            if error is not None:
                part.errors.append((line, error))
            elif text == "" or text.isspace():
                part.empty += 1
            else:
                texts.append(text)
                bads.append(bad)
                part.bad_utf8 += bad
        if _STATE["split"]:
            _encode_sentence_documents(part, texts, bads)
            part.n_tokens = part.tokens.size
            return part
        encode = tokenizer.encode
        docs = [list(encode(text)) for text in texts]
        if eod is not None:
            for doc in docs:
                doc.append(eod)
        part.lengths = np.fromiter(map(len, docs), np.int64, count=len(docs))
        part.tokens = np.fromiter(itertools.chain.from_iterable(docs), dtype, count=int(part.lengths.sum()))
        part.text_bytes = sum(len(text) if text.isascii() else len(text.encode("utf-8")) for text in texts)
    part.n_tokens = part.tokens.size
    return part


def _encode_spans(spans: list[str]) -> tuple[list[list[int]], np.ndarray]:
    ids = _STATE["tokenizer"].encode_batch(spans) if spans else []
    return ids, np.fromiter(map(len, ids), np.int64, count=len(ids))


def _encode_sentences(part: Part, text: str, last: bool) -> None:
    """A piece of a text document, sentence by sentence: `part.sentences` for those that end in it; the
    rest of its tokens are its unfinished last sentence (none in a text's last piece)."""
    closed, rest = split_sentences(text)
    if last and rest:
        closed, rest = [*closed, rest], ""
    ids, counts = _encode_spans(closed + ([rest] if rest else []))
    sentences = counts[:len(closed)].copy()
    flat = itertools.chain.from_iterable(ids)
    tokens = np.fromiter(flat, _STATE["dtype"], count=int(counts.sum()))
    if _STATE["eod"] is not None and last:
        tokens = np.append(tokens, np.asarray(_STATE["eod"], _STATE["dtype"]))
        nonzero = np.flatnonzero(sentences)
        if nonzero.size:  # the end of document ends the last sentence with tokens (they come last)
            sentences[nonzero[-1]] += 1
        else:
            part.eod_only = True
    part.tokens, part.sentences = tokens, sentences


def _encode_sentence_documents(part: Part, texts: list[str], bads: list[bool]) -> None:
    """Whole documents, sentence by sentence; a document without tokens is counted empty."""
    eod, dtype = _STATE["eod"], _STATE["dtype"]
    spans = [sentences_of(text) for text in texts]
    ids, counts = _encode_spans(list(itertools.chain.from_iterable(spans)))
    per_doc = np.fromiter(map(len, spans), np.int64, count=len(spans))
    starts = np.concatenate([[0], np.cumsum(per_doc)])
    kept_lengths, doc_sentences, chunks, kept = [], [], [], []
    part.bad_utf8 = 0
    for d, text in enumerate(texts):
        doc_counts = counts[starts[d]:starts[d + 1]]
        doc_counts = doc_counts[doc_counts > 0]
        if doc_counts.size == 0:
            part.empty += 1
            continue
        chunks.extend(ids[starts[d]:starts[d + 1]])
        if eod is not None:
            doc_counts = doc_counts.copy()
            doc_counts[-1] += 1
            chunks.append([eod])
        kept_lengths.append(doc_counts)
        doc_sentences.append(doc_counts.size)
        kept.append(text)
        part.bad_utf8 += bads[d]
    part.sentences = np.concatenate(kept_lengths) if kept_lengths else np.zeros(0, np.int64)
    part.doc_sentences = np.asarray(doc_sentences, np.int64)
    part.lengths = np.add.reduceat(part.sentences, np.concatenate([[0], np.cumsum(part.doc_sentences)[:-1]])
                                   ) if kept else np.zeros(0, np.int64)
    part.tokens = np.fromiter(itertools.chain.from_iterable(chunks), dtype, count=int(part.sentences.sum()))
    part.text_bytes = sum(len(text) if text.isascii() else len(text.encode("utf-8")) for text in kept)


def encode_task(items: list[Item]) -> list[Part]:
    return [encode_item(item) for item in items]


def encode_task_to_file(index: int, items: list[Item]) -> list[Part]:
    """encode_task in a pool worker: the tokens go to `parts_dir/index.bin`, back to back, and only the
    counts go back through the pipe. The main process has the kernel copy them into the `.bin`, so it
    neither unpickles them nor keeps the worker waiting while it drains a pipe."""
    parts = encode_task(items)
    with open(task_file(_STATE["parts_dir"], index), "wb") as fh:
        for part in parts:
            fh.write(memoryview(part.tokens).cast("B"))
            part.tokens = None
    return parts


def task_file(parts_dir: str, index: int) -> str:
    return os.path.join(parts_dir, f"{index}.bin")


def start_pool(workers: int, init_args: tuple, parts_dir: str | None, stack: contextlib.ExitStack
               ) -> ProcessPoolExecutor | None:
    """`workers` tokenizing processes writing to `parts_dir`, stopped when `stack` closes (None for one
    worker: encode in this process).

    A ProcessPoolExecutor rather than multiprocessing.Pool: when a worker dies (killed for memory, say),
    the executor fails every pending task (BrokenProcessPool) where Pool would wait for its result
    forever, and stopping it early never kills a worker halfway through sending a result, which can
    leave Pool.terminate() waiting forever on the lock that worker held.
    """
    if parts_dir is None:
        _init_worker(*init_args)
        return None
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(workers, mp.get_context(method), initializer=_init_worker,
                               initargs=(*init_args, parts_dir, os.getpid()))  # no process yet
    stack.callback(stop_pool, pool)
    with _ctrl_c_deferred():  # a Ctrl-C during a fork would be lost in fork's handlers, or kill a new worker
        try:
            pool.submit(int).result()  # starts every worker now, while this process has no other thread to fork
        except BrokenProcessPool:
            raise _worker_died() from None
    return pool


@contextlib.contextmanager
def _ctrl_c_deferred():
    """SIGINT blocked inside (the workers forked here inherit that, until they ignore it); one that came
    meanwhile raises KeyboardInterrupt on the way out."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Drop the tasks not started, let the running ones finish (at most one per worker), wait for exit."""
    pool.shutdown(wait=True, cancel_futures=True)


def ordered_map(tasks: Iterator[list[Item]], pool: ProcessPoolExecutor | None, workers: int
                ) -> Iterator[tuple[int, list[Item], list[Part]]]:
    """(index, task, its Parts) in input order; with a pool, Parts whose tokens are in the task's file.
    A window of 4 tasks per worker in flight keeps memory and the task files bounded and every worker
    busy."""
    if pool is None:
        for index, task in enumerate(tasks):
            yield index, task, encode_task(task)
        return
    pending: deque = deque()
    try:
        for index, task in enumerate(tasks):
            pending.append((index, task, pool.submit(encode_task_to_file, index, task)))
            if len(pending) >= 4 * workers:
                index0, task0, future = pending.popleft()
                yield index0, task0, future.result()
        while pending:
            index0, task0, future = pending.popleft()
            yield index0, task0, future.result()
    except BrokenProcessPool:
        raise _worker_died() from None


def _worker_died() -> DataError:
    return DataError("a tokenizing worker process died (killed for memory, or by a signal); nothing was "
                     "written. Retry, with fewer --workers if memory is short")


# ---- main side -------------------------------------------------------------------------------------
def prepare(inputs: list[str], tokenizer: str, output: str, workers: int = 1, append_eod: bool = False,
            json_key: str = "text", on_error: str = "skip", split_paragraphs: bool = False,
            progress: bool = True, chunk_bytes: int | None = None, piece_bytes: int = PIECE_BYTES,
            log: Callable[[str], None] = print, what: str = "--input", allow_binary: bool = False,
            allow_flag: str = "--allow-binary", split_sentences: bool = False) -> PrepareStats:
    """Tokenize `inputs` into OUTPUT.bin/.idx (+ OUTPUT.json sidecar); returns the statistics. An input
    that looks binary is refused unless `allow_binary` (`allow_flag` is how the user says so). With
    `split_sentences`, one sequence per sentence, grouped into documents by the `.idx` document index
    (the end-of-document token, if appended, ends a document's last sentence)."""
    if on_error not in ("skip", "fatal"):
        raise DataError(f"--on-error {on_error!r} is not skip or fatal")
    most = max(8, 4 * (os.cpu_count() or 1))
    if not 1 <= workers <= most:
        raise DataError(f"--workers {workers} must be in 1..{most} (4 per core of this machine, at least 8)")
    files = expand_inputs(inputs, what)
    if not allow_binary:
        refuse_binary(files, what, allow_flag)
    tok = get_tokenizer(tokenizer)
    prefix = strip_suffix(str(output))
    if prefix.endswith(os.sep) or Path(prefix).is_dir():
        raise DataError(f"--output {output!r} is a directory; give a prefix inside it, e.g. {Path(prefix) / 'corpus'}")
    stats = PrepareStats(files=len(files), split_sentences=split_sentences)
    total = None if any(file_format(f)[1] for f in files) else sum(f.stat().st_size for f in files)
    start = time.perf_counter()
    try:
        writer = IndexedWriter(prefix, tok.vocab_size)
    except OSError as err:
        raise DataError(f"--output {output!r} cannot be written ({err.strerror or err}); choose another "
                        "path") from None

    def task_bytes(done: int) -> int:
        return chunk_bytes or chunk_bytes_for(None if total is None else total - done, workers)

    with contextlib.ExitStack() as stack:
        stack.enter_context(writer)
        parts_dir = None
        if workers > 1:  # hidden beside the output (same file system: the kernel copies without moving data)
            parts_dir = tempfile.mkdtemp(prefix=f".{Path(prefix).name}.parts.", dir=writer.bin_path.parent)
            stack.callback(shutil.rmtree, parts_dir, ignore_errors=True)
        init = (tokenizer, json_key, writer.dtype.str, tok.eod_id if append_eod else None, piece_bytes,
                split_sentences)
        pool = start_pool(workers, init, parts_dir, stack)  # before tqdm starts a thread
        bar = stack.enter_context(tqdm(total=total, unit="B", unit_scale=True, desc="prepare", dynamic_ncols=True,
                                       disable=None if progress else True))
        out = _Output(writer, stats, on_error, bar, parts_dir)
        tasks = chunked(plan_items(files, split_paragraphs, piece_bytes), task_bytes)
        for index, task, parts in ordered_map(tasks, pool, workers):
            out.add(index, task, parts)
            size = sum(item.size for item in task)
            stats.input_bytes += size
            bar.update(size)
            bar.set_postfix_str(f"{writer.n_tokens / max(time.perf_counter() - start, 1e-9):,.0f} tok/s",
                                refresh=False)
        stats.tokens, stats.sentences, stats.seconds = writer.n_tokens, writer.n_sequences, time.perf_counter() - start
        if stats.documents == 0:
            raise DataError(f"no documents in {len(files)} input file(s): {stats.empty_documents} empty, "
                            f"{stats.bad_lines} bad lines; nothing written to {prefix}")
        writer.finish({"tokenizer": tok.identity, "vocab_size": tok.vocab_size, "eod_id": tok.eod_id,
                       "append_eod": append_eod, "text_bytes": stats.text_bytes, "json_key": json_key,
                       "split_paragraphs": split_paragraphs, "split_sentences": split_sentences,
                       "inputs": [str(f) for f in files[:MAX_LISTED]],
                       "stats": {k: v for k, v in asdict(stats).items() if k != "errors"}})
    log(stats.summary(prefix))
    return stats


class _Output:
    """Writes the Parts of each task, in input order: counts documents, numbers bad lines across a file's
    Items, and joins the pieces of a text document (dropped at its end if it had no text)."""

    def __init__(self, writer: IndexedWriter, stats: PrepareStats, on_error: str, bar, parts_dir: str | None):
        self.writer, self.stats, self.on_error, self.bar, self.parts_dir = writer, stats, on_error, bar, parts_dir
        self.lines: dict[str, int] = {}  # newlines seen so far per file
        self.doc_has_text = self.doc_bad_utf8 = False  # of the text document being written
        self.doc_text_bytes = 0
        self.join_eod = False  # its end-of-document token joins its last sentence (split_sentences)

    def add(self, index: int, task: list[Item], parts: list[Part]) -> None:
        if self.parts_dir is None:
            self._add(task, parts, None)
            return
        path = task_file(self.parts_dir, index)
        with open(path, "rb") as fh:
            self._add(task, parts, fh.fileno())
        os.unlink(path)

    def _add(self, task: list[Item], parts: list[Part], fd: int | None) -> None:
        offset, writer, stats = 0, self.writer, self.stats
        for item, part in zip(task, parts):
            first_line = self.lines.get(item.source, 0)
            self.lines[item.source] = first_line + part.lines
            for line, error in part.errors:
                self._bad_line(f"{item.source}:{first_line + line}: {error}")
            carry = writer.open_tokens  # a sentence left open by the previous piece of a text document
            if fd is None:
                writer.add_tokens(part.tokens)
            else:
                writer.copy_tokens(fd, offset, part.n_tokens)
                offset += part.n_tokens * writer.dtype.itemsize
            if part.lengths is not None:  # whole documents
                writer.end_documents(*((part.lengths,) if part.sentences is None
                                       else (part.sentences, part.doc_sentences)))
                stats.documents += len(part.lengths)
                stats.empty_documents += part.empty
                stats.text_bytes += part.text_bytes
                stats.invalid_utf8_documents += part.bad_utf8
                continue
            self.doc_has_text |= part.has_text  # a piece of a text document
            self.doc_bad_utf8 |= bool(part.bad_utf8)
            self.doc_text_bytes += part.text_bytes
            if part.sentences is not None:
                lengths = part.sentences.copy()
                if lengths.size:
                    lengths[0] += carry
                writer.end_sequences(lengths[lengths > 0])
                self.join_eod = part.eod_only and writer.open_tokens == 1  # no open sentence to end
            if item.last:
                self._end_text_document()

    def _end_text_document(self) -> None:
        if self.doc_has_text and self.writer.end_document(join=self.join_eod):
            self.stats.documents += 1
            self.stats.text_bytes += self.doc_text_bytes
            self.stats.invalid_utf8_documents += self.doc_bad_utf8
        else:
            self.writer.discard_document()
            self.stats.empty_documents += 1
        self.doc_has_text = self.doc_bad_utf8 = self.join_eod = False
        self.doc_text_bytes = 0

    def _bad_line(self, message: str) -> None:
        stats = self.stats
        if self.on_error == "fatal":
            raise DataError(f"{message}; fix the line or pass --on-error skip")
        stats.bad_lines += 1
        if len(stats.errors) < MAX_REPORTED:
            stats.errors.append(message)
            self.bar.write(f"skipped {message}", file=sys.stderr)
        elif len(stats.errors) == MAX_REPORTED:
            stats.errors.append("...")
            self.bar.write(f"more bad lines are skipped silently (only the first {MAX_REPORTED} are shown)",
                           file=sys.stderr)
