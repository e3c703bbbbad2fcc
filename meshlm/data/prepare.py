"""`meshlm prepare`: text files → a tokenized, Megatron-compatible `PREFIX.bin`/`PREFIX.idx`.

Inputs are files, directories (searched for .txt, .jsonl and their .gz) and globs. A `.txt` file is one
document (or, with `split_paragraphs`, one per blank-line separated paragraph); every line of a
`.jsonl` file is a JSON object whose `json_key` holds one document.

Work split: the main process only plans. It cuts every file into byte ranges (`Item`s, at most
`piece_bytes` each), groups them into tasks and hands the tasks to `workers` processes, which read their
ranges themselves, decode, parse and tokenize, and send back tokens and document lengths; the main
process writes them in input order. A bounded window of tasks is in flight, so memory stays flat however
large the corpus, and the main process neither reads nor pickles the text (with two workers on two
cores it would otherwise take a sixth of a core from them; with sixteen workers it would be the
bottleneck). Compressed files cannot be read from the middle: the main process decompresses them and
sends the bytes.

Range ends move forward to the next point where the kind may be cut, found from the bytes at that
point alone, so two neighbouring ranges agree on their common end: the start of a line (`.jsonl`); the
end of an empty line (paragraphs); a newline between two printable ASCII characters (one `.txt`
document in several ranges). GPT-2 style BPE never merges across such a newline, so the tokens equal
those of encoding the whole file at once. Where no such point follows within `search_bytes` (64 KiB
or more), a text or paragraph is cut at another newline, a text else at a character boundary.

Empty documents (nothing but whitespace) are skipped and counted; invalid UTF-8 is replaced with
U+FFFD and counted; a `.jsonl` line that is not a JSON object with the key is reported as file:line and
skipped, or stops the run with `on_error="fatal"`. Nothing is written at PREFIX unless the run completes.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from meshlm.config import ConfigError
from meshlm.data.indexed import IndexedWriter, strip_suffix
from meshlm.data.tokenizers import get_tokenizer

TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".jsonl", ".ndjson")
PIECE_BYTES = 1 << 20  # most input bytes in one Item (a larger file is read in several)
CHUNK_BYTES = (1 << 18, 1 << 20, 1 << 22)  # input bytes per worker task: least, when the size is unknown, most
MAX_REPORTED = 10  # bad lines reported one by one; the rest are counted
MAX_LISTED = 1000  # input files named in the sidecar (stats.files counts them all)
# Where an Item of each kind may end: the end of a match (a cut between the newline and what follows).
CUT_AT = {"text": re.compile(rb"[\x21-\x7e]\n(?=[\x21-\x7e])"), "json": re.compile(rb"\n"),
          "paragraphs": re.compile(rb"\n[ \t\r\f\v]*\n")}


class DataError(ConfigError):
    """A problem with the input data or output path, stated with the path (and line) and the fix."""


@dataclass(frozen=True)
class Item:
    """Bytes [start, end) of one input file, moved to cut points (see the module docstring); a worker reads
    them itself, unless `data` holds them (decompressed by the main process)."""

    kind: str  # "text": (part of) one document | "json": a document per line | "paragraphs": per paragraph
    source: str
    start: int
    end: int
    last: bool  # ends its file (and, for "text", its document)
    data: bytes | None = None

    @property
    def size(self) -> int:
        return self.end - self.start

    def split(self, n: int) -> tuple[Item, Item]:
        """This on-disk Item as its first `n` bytes and the rest."""
        return replace(self, end=self.start + n, last=False), replace(self, start=self.start + n)


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
    lines: int = 0  # newlines in the Item's bytes (the main process numbers lines across Items)


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
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first MAX_REPORTED bad lines

    def summary(self, prefix: str) -> str:
        mb, s = self.input_bytes / 1e6, max(self.seconds, 1e-9)
        return (f"prepared {prefix}.bin/.idx: {self.documents:,} documents, {self.tokens:,} tokens from "
                f"{self.files} files ({mb:.2f} MB) in {self.seconds:.1f}s ({mb / s:.2f} MB/s, "
                f"{self.tokens / s:,.0f} tokens/s); skipped {self.empty_documents} empty documents and "
                f"{self.bad_lines} bad lines; {self.invalid_utf8_documents} documents had invalid UTF-8 "
                "(replaced with U+FFFD)")


def _format(path: Path) -> tuple[str, bool]:
    """("text" | "json" | "", gzipped) from the file name."""
    name = path.name.lower()
    gz = name.endswith(".gz")
    if gz:
        name = name[:-3]
    if name.endswith(JSON_SUFFIXES):
        return "json", gz
    if name.endswith(TEXT_SUFFIXES):
        return "text", gz
    return "", gz


def expand_inputs(inputs: list[str], what: str = "--input") -> list[Path]:
    """Files named by `inputs` (files, directories, globs), in order, each checked to be readable."""
    files: list[Path] = []
    for item in inputs:
        path = Path(os.path.expanduser(item))
        if any(ch in item for ch in "*?["):
            found = [Path(p) for p in sorted(glob.glob(os.path.expanduser(item), recursive=True))]
            found = [f for p in found for f in (_walk(p) if p.is_dir() else [p])]
            if not found:
                raise DataError(f"{what} {item!r} matches no file; check the pattern")
        elif path.is_dir():
            found = _walk(path)
            if not found:
                raise DataError(f"{what} {item!r} is a directory without .txt, .jsonl or .gz files; "
                                "point at the files themselves")
        elif path.exists():
            found = [path]
        else:
            raise DataError(f"{what} {item!r} does not exist; fix the path")
        files.extend(found)
    if not files:
        raise DataError(f"no input files; pass {what} with files, directories or globs")
    for f in files:
        try:
            with open(f, "rb") as fh:
                fh.read(1)
        except OSError as err:
            raise DataError(f"{what} {str(f)!r} cannot be read ({err.strerror or err}); fix its "
                            "permissions or leave it out") from None
    return list(dict.fromkeys(files))


def _walk(directory: Path) -> list[Path]:
    return sorted(f for f in directory.rglob("*") if f.is_file() and _format(f)[0])


# ---- cutting input into Items ----------------------------------------------------------------------
def find_cut(kind: str, buf: bytes, at: int, fallback: bool) -> int:
    """The first point p >= `at` in `buf` where an Item of `kind` may end (buf[:p] | buf[p:]), or -1.

    With `fallback`, a text or paragraph Item that has no proper cut may end after any newline, and a
    text Item at a character boundary; a JSON line is never cut.
    """
    pattern, pos = CUT_AT[kind], max(at - 2, 0)
    while (m := pattern.search(buf, pos)) is not None and m.end() < at:
        pos = m.start() + 1
    if m is not None:
        return m.end()
    if not fallback or kind == "json":
        return -1
    newline = buf.find(b"\n", max(at - 1, 0))
    if newline >= 0:
        return newline + 1
    if kind == "text":
        return next((p for p in range(at, len(buf)) if buf[p] & 0xC0 != 0x80), -1)
    return -1


def snap(fh, kind: str, at: int, size: int, piece_bytes: int) -> int:
    """The cut point of the open file `fh` (`size` bytes) at or after `at`, from the bytes there alone."""
    if at <= 0 or at >= size:
        return min(max(at, 0), size)
    base = at - 2 if at >= 2 else 0
    fh.seek(base)
    buf = fh.read(search_bytes(piece_bytes))
    p = find_cut(kind, buf, at - base, fallback=False)
    if p < 0 and base + len(buf) < size:  # the end of the file is always a cut; short of it, settle
        p = find_cut(kind, buf, at - base, fallback=True)
    while p < 0 and kind == "json" and base + len(buf) < size:  # a long line: read on to its end
        buf += fh.read(search_bytes(piece_bytes))
        p = find_cut(kind, buf, at - base, fallback=False)
    return size if p < 0 else base + p


def search_bytes(piece_bytes: int) -> int:
    """How far to look for a proper cut before settling for a worse one."""
    return max(4 * piece_bytes, 1 << 16)


def plan_items(files: list[Path], split_paragraphs: bool, piece_bytes: int) -> Iterator[Item]:
    """Every input file as Items of at most `piece_bytes` (a compressed file: of decompressed bytes)."""
    for f in files:
        kind, gz = _format(f)
        kind = kind or "text"
        if kind == "text" and split_paragraphs:
            kind = "paragraphs"
        try:
            if gz:
                with gzip.open(f, "rb") as fh:
                    yield from _stream_items(fh, kind, str(f), piece_bytes)
                continue
            size = f.stat().st_size
        except (OSError, EOFError, gzip.BadGzipFile) as err:
            raise DataError(f"{f} cannot be read ({err}); fix or remove the file") from None
        starts = range(0, size, piece_bytes) if size else [0]
        for start in starts:
            end = min(start + piece_bytes, size)
            yield Item(kind, str(f), start, end, last=end == size)


def _stream_items(fh, kind: str, source: str, piece_bytes: int) -> Iterator[Item]:
    """Items of a stream that cannot seek, with their bytes, cut as the module docstring says."""
    buf, offset = b"", 0
    while more := fh.read(piece_bytes):
        buf += more
        if len(buf) < piece_bytes:
            continue
        cut = find_cut(kind, buf, len(buf) // 2, fallback=len(buf) >= search_bytes(piece_bytes))
        if cut > 0:
            yield Item(kind, source, offset, offset + cut, last=False, data=buf[:cut])
            buf, offset = buf[cut:], offset + cut
    yield Item(kind, source, offset, offset + len(buf), last=True, data=buf)


def read_item(item: Item, piece_bytes: int = PIECE_BYTES) -> bytes:
    """The bytes of `item` between its cut points."""
    if item.data is not None:
        return item.data
    try:
        with open(item.source, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            start = snap(fh, item.kind, item.start, size, piece_bytes)
            end = size if item.last else snap(fh, item.kind, item.end, size, piece_bytes)
            if end <= start:
                return b""
            fh.seek(start)
            return fh.read(end - start)
    except OSError as err:
        raise DataError(f"{item.source} cannot be read ({err.strerror or err}); fix or remove the file") from None


def chunk_bytes_for(remaining: int | None, workers: int) -> int:
    """Input bytes for the next worker task: the input still to hand out split 2·`workers` ways, within
    `CHUNK_BYTES` (guided self-scheduling).

    Each task costs the main process a little (handing it over, collecting its tokens), which competes
    with the workers for the same cores, so tasks should be few and large; but while the last task runs
    the other workers have nothing to do, so the last ones must be small. Shrinking tasks give both: on
    20 MB of Shakespeare with 2 workers, tasks go from 4 MiB down to 256 KiB.
    """
    least, unknown, most = CHUNK_BYTES
    return unknown if remaining is None else min(max(remaining // (2 * workers), least), most)


def chunked(items: Iterator[Item], chunk_bytes: Callable[[int], int]) -> Iterator[list[Item]]:
    """`items` grouped into tasks of `chunk_bytes(bytes handed out so far)` bytes each; an on-disk Item
    that would overfill a task is split between it and the next."""
    chunk, size, done = [], 0, 0
    target = chunk_bytes(0)
    for item in items:
        while item.data is None and size + item.size > target:
            head, item = item.split(target - size)
            chunk.append(head)
            yield chunk
            done += target
            chunk, size = [], 0
            target = chunk_bytes(done)
        chunk.append(item)
        size += item.size
        if size >= target:
            yield chunk
            done += size
            chunk, size = [], 0
            target = chunk_bytes(done)
    if chunk:
        yield chunk


def iter_texts(inputs: list[str], json_key: str = "text", bad_lines: list[str] | None = None) -> Iterator[str]:
    """Document texts of `inputs` (a large .txt document in pieces), e.g. to train a tokenizer; a bad
    .jsonl line is skipped and, if `bad_lines` is given, appended to it as "file:line: reason"."""
    return _texts(expand_inputs(inputs), json_key, bad_lines)  # inputs are checked now, not when iterated


def _texts(files: list[Path], json_key: str, bad_lines: list[str] | None) -> Iterator[str]:
    lines: dict[str, int] = {}
    for item in plan_items(files, False, PIECE_BYTES):
        data = read_item(item)
        for line, text, _, error in documents(item.kind, data, json_key):
            if error is None:
                yield text
            elif bad_lines is not None:
                bad_lines.append(f"{item.source}:{lines.get(item.source, 0) + line}: {error}")
        lines[item.source] = lines.get(item.source, 0) + data.count(b"\n")


# ---- worker side -----------------------------------------------------------------------------------
_STATE: dict = {}


def _init_worker(spec: str, json_key: str, dtype: str, eod: int | None, piece_bytes: int,
                 parts_dir: str | None = None, parent: int | None = None) -> None:
    if parts_dir is not None:  # a pool worker
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C ...
        if hasattr(signal, "pthread_sigmask"):  # ... and blocked it while forking us (see start_pool)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        _die_with_parent(parent)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    _STATE.update(tokenizer=get_tokenizer(spec), json_key=json_key, dtype=np.dtype(dtype), eod=eod,
                  piece_bytes=piece_bytes, parts_dir=parts_dir)


def _die_with_parent(parent: int | None) -> None:
    """On Linux, have the kernel kill this worker when the main process `parent` dies (kill -9 included);
    otherwise the worker would wait for tasks forever."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if parent is not None and os.getppid() != parent:  # it died before that took effect
            os._exit(1)


def decode(data: bytes) -> tuple[str, bool]:
    """(text, had invalid UTF-8): invalid bytes become U+FFFD."""
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True


def json_text(line: str, json_key: str) -> str:
    """The text under `json_key` of one JSON line; ValueError/TypeError with the reason for a bad line."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err})") from None
    if not isinstance(obj, dict) or json_key not in obj:
        raise ValueError(f"no key {json_key!r} (pass --json-key with the field that holds the text)")
    if not isinstance(obj[json_key], str):
        raise TypeError(f"key {json_key!r} holds {type(obj[json_key]).__name__}, not a string")
    return obj[json_key]


def documents(kind: str, data: bytes, json_key: str) -> Iterator[tuple[int, str, bool, str | None]]:
    """(line within `data`, text, had invalid UTF-8, error) of every document in an Item's bytes: the one
    text piece, every JSON line that is not blank (error set for a bad one), or every paragraph. Blank
    means ASCII whitespace only (a line of U+00A0 is a bad JSON line, not a blank one)."""
    if kind == "text":
        yield (1, *decode(data), None)
        return
    try:  # the whole Item at once; only one with invalid UTF-8 decodes document by document, to count them
        lines, space = data.decode("utf-8").split("\n"), " \t\n\r\x0b\x0c"
    except UnicodeDecodeError:
        lines, space = data.split(b"\n"), None
    if kind == "json":
        for n, line in enumerate(lines, 1):
            if line.strip(space):
                text, bad = (line, False) if space else decode(line)
                try:
                    yield n, json_text(text, json_key), bad, None
                except (ValueError, TypeError) as err:
                    yield n, "", False, str(err)
        return
    newline = "\n" if space else b"\n"
    paragraph: list = []
    for n, line in enumerate(lines, 1):
        if line.strip(space):
            paragraph.append(line)
            continue
        if paragraph:
            text = newline.join(paragraph) + newline
            yield (n - len(paragraph), *((text, False) if space else decode(text)), None)
            paragraph = []
    if paragraph:  # the data's last paragraph: its last line had no newline
        text = newline.join(paragraph)
        yield (len(lines) - len(paragraph) + 1, *((text, False) if space else decode(text)), None)


def encode_item(item: Item) -> Part:
    """Read, decode, parse and tokenize one Item (in a worker, or in the main process with one worker)."""
    tokenizer, dtype, eod = _STATE["tokenizer"], _STATE["dtype"], _STATE["eod"]
    data = read_item(item, _STATE["piece_bytes"])
    part = Part(None, lines=data.count(b"\n"))
    if item.kind == "text":  # a piece of one document: the main process decides when it ends
        text, bad = decode(data)
        encode = getattr(tokenizer, "encode_array", None)  # one long text: no list of Python ints
        tokens = encode(text) if encode else np.asarray(tokenizer.encode(text))
        if eod is not None and item.last:
            tokens = np.append(tokens, eod)
        part.tokens = tokens.astype(dtype, copy=False)
        part.has_text, part.bad_utf8 = text != "" and not text.isspace(), int(bad)
        part.text_bytes = len(text.encode("utf-8")) if bad else len(data)
    else:  # whole documents, usually short: one flat list of ids, turned into an array once
        ids: list[int] = []
        lengths: list[int] = []
        for line, text, bad, error in documents(item.kind, data, _STATE["json_key"]):
            if error is not None:
                part.errors.append((line, error))
            elif text == "" or text.isspace():
                part.empty += 1
            else:
                doc = tokenizer.encode(text)
                ids += doc
                if eod is not None:
                    ids.append(eod)
                lengths.append(len(doc) + (eod is not None))
                part.bad_utf8 += bad
                part.text_bytes += len(text) if text.isascii() else len(text.encode("utf-8"))
        part.tokens = np.fromiter(ids, dtype, count=len(ids))
        part.lengths = np.asarray(lengths, dtype=np.int64)
    part.n_tokens = part.tokens.size
    return part


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
            log: Callable[[str], None] = print, what: str = "--input") -> PrepareStats:
    """Tokenize `inputs` into OUTPUT.bin/.idx (+ OUTPUT.json sidecar); returns the statistics."""
    if on_error not in ("skip", "fatal"):
        raise DataError(f"--on-error {on_error!r} is not skip or fatal")
    if workers < 1:
        raise DataError(f"--workers {workers} must be at least 1")
    files = expand_inputs(inputs, what)
    tok = get_tokenizer(tokenizer)
    prefix = strip_suffix(str(output))
    if prefix.endswith(os.sep) or Path(prefix).is_dir():
        raise DataError(f"--output {output!r} is a directory; give a prefix inside it, e.g. {Path(prefix) / 'corpus'}")
    stats = PrepareStats(files=len(files))
    total = None if any(_format(f)[1] for f in files) else sum(f.stat().st_size for f in files)
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
        init = (tokenizer, json_key, writer.dtype.str, tok.eod_id if append_eod else None, piece_bytes)
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
        stats.tokens, stats.seconds = writer.n_tokens, time.perf_counter() - start
        if stats.documents == 0:
            raise DataError(f"no documents in {len(files)} input file(s): {stats.empty_documents} empty, "
                            f"{stats.bad_lines} bad lines; nothing written to {prefix}")
        writer.finish({"tokenizer": tok.identity, "vocab_size": tok.vocab_size, "eod_id": tok.eod_id,
                       "append_eod": append_eod, "text_bytes": stats.text_bytes, "json_key": json_key,
                       "split_paragraphs": split_paragraphs, "inputs": [str(f) for f in files[:MAX_LISTED]],
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
            if fd is None:
                writer.add_tokens(part.tokens)
            else:
                writer.copy_tokens(fd, offset, part.n_tokens)
                offset += part.n_tokens * writer.dtype.itemsize
            if part.lengths is not None:  # whole documents
                writer.end_documents(part.lengths)
                stats.documents += len(part.lengths)
                stats.empty_documents += part.empty
                stats.text_bytes += part.text_bytes
                stats.invalid_utf8_documents += part.bad_utf8
                continue
            self.doc_has_text |= part.has_text  # a piece of a text document
            self.doc_bad_utf8 |= bool(part.bad_utf8)
            self.doc_text_bytes += part.text_bytes
            if item.last:
                self._end_text_document()

    def _end_text_document(self) -> None:
        if self.doc_has_text:
            self.writer.end_document()
            self.stats.documents += 1
            self.stats.text_bytes += self.doc_text_bytes
            self.stats.invalid_utf8_documents += self.doc_bad_utf8
        else:
            self.writer.discard_document()
            self.stats.empty_documents += 1
        self.doc_has_text = self.doc_bad_utf8 = False
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


def main(args) -> int:
    """`meshlm prepare` (arguments from meshlm.data.commands)."""
    try:
        prepare(args.input, args.tokenizer, args.output, workers=args.workers, append_eod=args.append_eod,
                json_key=args.json_key, on_error=args.on_error, split_paragraphs=args.split_paragraphs,
                progress=not args.no_progress)
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0
