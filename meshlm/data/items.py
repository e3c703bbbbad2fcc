"""Input files for `meshlm prepare`: found, cut into worker-sized byte ranges (`Item`s), parsed into documents.

Inputs are files, directories (searched for .txt, .jsonl and their .gz) and globs. A `.txt` file is one
document (or, with `split_paragraphs`, one per blank-line separated paragraph); every line of a
`.jsonl` file is a JSON object whose `json_key` holds one document.

Range ends move forward to the next point where the kind may be cut, found from the bytes at that
point alone, so two neighbouring ranges agree on their common end: the start of a line (`.jsonl`); the
end of a blank line (paragraphs); a newline between two printable ASCII characters (one `.txt`
document in several ranges). GPT-2 style BPE never merges across such a newline, so the tokens equal
those of encoding the whole file at once. Where no such point follows within `search_bytes` (64 KiB
or more), a text or paragraph is cut at another newline, a text else at a character boundary.
Compressed files cannot be read from the middle: their Items carry the decompressed bytes.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from meshlm.core.config import ConfigError

TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".jsonl", ".ndjson")
PIECE_BYTES = 1 << 20  # most input bytes in one Item (a larger file is read in several)
CHUNK_BYTES = (1 << 18, 1 << 20, 1 << 22)  # input bytes per worker task: least, when the size is unknown, most
# Where an Item of each kind may end: the end of a match (a cut between the newline and what follows).
CUT_AT = {"text": re.compile(rb"[\x21-\x7e]\n(?=[\x21-\x7e])"), "json": re.compile(rb"\n"),
          "paragraphs": re.compile(rb"\n[ \t\r\f\v]*\n")}


class DataError(ConfigError):
    """A problem with the input data or output path, stated with the path (and line) and the fix."""


def read_json_object(path: Path) -> dict:
    """The JSON object in file `path` (a tokenizer's or a checkpoint's side file); DataError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(f"{path} cannot be read as JSON ({err}); fix or remove it") from None
    if not isinstance(data, dict):
        raise DataError(f"{path} must hold a JSON object; fix or remove it")
    return data


SNIFF_BYTES = 1024  # what `binary_reason` reads of each input
SIGNATURES = {b"\x1f\x8b": "gzip-compressed data (name the file *.gz to have it decompressed)",
              b"\x89PNG": "a PNG image", b"\x7fELF": "an ELF executable", b"PK\x03\x04": "a zip archive",
              b"\xff\xd8\xff": "a JPEG image", b"%PDF-": "a PDF document", b"\xfd7zXZ": "xz-compressed data",
              b"\x28\xb5\x2f\xfd": "zstd-compressed data", b"MMIDIDX": "a Megatron .idx index"}


def binary_reason(path: Path) -> str | None:
    """Why the first KiB of `path` (decompressed for *.gz) is not text: a known binary signature, a NUL
    byte, or bytes that are not UTF-8; None for text."""
    opener = gzip.open if file_format(path)[1] else open
    try:
        with opener(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except (OSError, EOFError) as err:
        raise DataError(f"{path} cannot be read ({err}); fix or remove the file") from None
    for magic, what in SIGNATURES.items():
        if head.startswith(magic):
            return f"it is {what}"
    nul = head.find(b"\x00")
    if nul >= 0:
        return f"it holds a NUL byte at offset {nul}"
    try:  # an incomplete character at the end of the KiB is fine
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < SNIFF_BYTES)
    except UnicodeDecodeError as err:
        return f"byte {err.start} is not UTF-8"
    return None


def refuse_binary(files: list[Path], what: str, flag: str) -> None:
    """DataError for the first of `files` that looks binary (`binary_reason`); `flag` is how to allow it."""
    for f in files:
        reason = binary_reason(f)
        if reason is not None:
            raise DataError(f"{what} {str(f)!r} does not look like text: {reason}; leave it out, or pass {flag} "
                            "to use it anyway (invalid UTF-8 becomes U+FFFD)")


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


def file_format(path: Path) -> tuple[str, bool]:
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
    return sorted(f for f in directory.rglob("*") if f.is_file() and file_format(f)[0])


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
        kind, gz = file_format(f)
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
        if item.kind == "json":  # only JSON lines are reported by number
            lines[item.source] = lines.get(item.source, 0) + data.count(b"\n")


# ---- parsing an Item's bytes into documents ---------------------------------------------------
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
