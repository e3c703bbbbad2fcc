"""`meshlm prepare`: round trips, order-preserving workers, streaming pieces, counting, bad input."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from meshlm.data.assets import shakespeare_files
from meshlm.data.indexed import IndexedDataset, is_prefix
from meshlm.data.prepare import DataError, prepare
from meshlm.data.tokenizers import get_tokenizer
from tests.conftest import ROOT, SIGINT_DEFAULT, meshlm_command, run_cli

QUIET = {"progress": False, "log": lambda line: None}


def small_plays(n: int = 3):
    """The n shortest modern-spelling plays (fast, real text)."""
    return sorted(shakespeare_files(), key=lambda f: f.stat().st_size)[:n]


def verse(n_bytes: int) -> bytes:
    """The first `n_bytes` of the shortest play of at least that size (real text with line breaks)."""
    play = next(f for f in sorted(shakespeare_files(), key=lambda f: f.stat().st_size) if f.stat().st_size >= n_bytes)
    return play.read_bytes()[:n_bytes]


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


@pytest.mark.parametrize("workers,append_eod", [(1, False), (2, True)])
def test_empty_documents_and_invalid_utf8_are_counted(tmp_path, workers, append_eod):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 ok\n")  # latin-1 byte: invalid UTF-8
    (tmp_path / "b.txt").write_text("  \n\n")  # whitespace only
    (tmp_path / "c.jsonl").write_text('{"text": ""}\n\n{"text": "fine"}\n')
    stats = prepare([str(tmp_path)], "gpt2", str(tmp_path / "out"), workers=workers, append_eod=append_eod,
                    chunk_bytes=1, allow_binary=True, **QUIET)  # invalid UTF-8 up front: refused without it
    assert (stats.documents, stats.empty_documents, stats.invalid_utf8_documents) == (2, 2, 1)
    tok, data = get_tokenizer("gpt2"), IndexedDataset(tmp_path / "out")
    eod = [tok.eod_id] if append_eod else []
    assert data.document(0).tolist() == tok.encode("caf\ufffd ok\n") + eod
    assert data.document(1).tolist() == tok.encode("fine") + eod
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt", "c.jsonl", "out.bin", "out.idx", "out.json"]


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


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_jsonl_line_is_fatal_on_request_and_nothing_is_written(tmp_path, workers):
    """Nothing at the prefix, and no temporary file (the workers' task files included) is left."""
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{"text": "b"\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid JSON .*--on-error skip"):
        prepare([str(tmp_path / "d.jsonl")], "gpt2", str(tmp_path / "out"), on_error="fatal", workers=workers,
                chunk_bytes=1, **QUIET)
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


def test_task_sizes_shrink_toward_the_end_within_bounds():
    """Guided self-scheduling: large tasks first (few hand-overs), small ones last (no idle worker)."""
    from meshlm.data.items import CHUNK_BYTES, Item, chunk_bytes_for, chunked

    least, unknown, most = CHUNK_BYTES
    assert chunk_bytes_for(10 << 30, 4) == most  # 10 GiB: 4 MiB tasks, so memory in flight stays bounded
    assert chunk_bytes_for(8 << 20, 2) == 2 << 20  # a quarter of what is left, for 2 workers
    assert chunk_bytes_for(1 << 20, 2) == least
    assert chunk_bytes_for(None, 2) == unknown  # compressed input: size unknown
    total = 20 << 20
    items = (Item("text", "f", s, min(s + (1 << 20), total), last=s + (1 << 20) >= total) for s in range(0, total, 1 << 20))
    tasks = list(chunked(items, lambda done: chunk_bytes_for(total - done, 2)))
    sizes = [sum(i.size for i in task) for task in tasks]
    flat = [i for task in tasks for i in task]
    assert [(i.start, i.end) for i in flat] == list(zip([0] + [i.end for i in flat[:-1]], [i.end for i in flat]))
    assert flat[-1].end == total and [i.last for i in flat].count(True) == 1 and flat[-1].last
    assert sizes[0] == most and sizes == sorted(sizes, reverse=True)
    assert min(sizes[:-1]) >= least and sizes[-1] <= least and 10 <= len(tasks) <= 25


CUT_RULES = {
    "text": lambda data, p: data[p - 1:p] == b"\n",
    "json": lambda data, p: data[p - 1:p] == b"\n",
    "paragraphs": lambda data, p: data[:p].rstrip(b" \t").endswith(b"\n\n") or data[p - 1:p] == b"\n",
}


@pytest.mark.parametrize("kind", ["text", "json", "paragraphs"])
def test_items_cut_anywhere_tile_the_file_at_allowed_points(tmp_path, kind):
    """Neighbouring Items agree on their common end wherever the nominal cut falls, so the Items' bytes
    put together are the file, and every real cut is at a point allowed for the kind."""
    from meshlm.data.items import Item, read_item

    text = verse(20_000)
    data = {"text": text, "json": b"".join(json.dumps({"text": line}).encode() + b"\n"
                                          for line in text.decode().split("\n")),
            "paragraphs": text.replace(b".\n", b".\n\n")}[kind]
    path = tmp_path / "f"
    path.write_bytes(data)
    rng = np.random.default_rng(0)
    for trial in range(20):
        bounds = [0, *sorted(rng.choice(np.arange(1, len(data)), size=trial + 1, replace=False).tolist()), len(data)]
        pieces = [read_item(Item(kind, str(path), a, b, last=b == len(data)), piece_bytes=256)
                  for a, b in itertools.pairwise(bounds)]
        assert b"".join(pieces) == data
        cuts = np.cumsum([len(piece) for piece in pieces])[:-1]
        assert all(CUT_RULES[kind](data, int(p)) for p in cuts if 0 < p < len(data))
    if kind == "text":  # the proper cuts: a newline between printable ASCII characters
        assert all(0x21 <= data[p - 2] <= 0x7E and 0x21 <= data[p] <= 0x7E for p in cuts if 0 < p < len(data))


def test_jsonl_and_paragraphs_in_tiny_pieces_equal_the_whole(tmp_path, capsys):
    """Items of 64 bytes (every line crosses a cut somewhere), tasks of 100 bytes, 2 workers: the same
    .bin/.idx as whole files in one process, and bad lines keep their file line numbers."""
    play = verse(6000).decode()
    lines = [json.dumps({"text": line}) for line in play.split("\n")]
    lines[7], lines[40] = '{"text": "broken', '{"body": "no key"}'
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "p.txt").write_text(play.replace(".\n", ".\n\n"))
    for split in (False, True):
        inputs = [str(tmp_path / "d.jsonl"), str(tmp_path / "p.txt")]
        whole = prepare(inputs, "gpt2", str(tmp_path / "whole"), split_paragraphs=split, append_eod=True, **QUIET)
        capsys.readouterr()
        tiny = prepare(inputs, "gpt2", str(tmp_path / "tiny"), workers=2, piece_bytes=64, chunk_bytes=100,
                       split_paragraphs=split, append_eod=True, **QUIET)
        for suffix in (".bin", ".idx"):
            assert (tmp_path / f"whole{suffix}").read_bytes() == (tmp_path / f"tiny{suffix}").read_bytes()
        assert (tiny.documents, tiny.bad_lines, tiny.text_bytes) == (whole.documents, whole.bad_lines, whole.text_bytes)
        err = capsys.readouterr().err
        assert "d.jsonl:8: not valid JSON" in err and "d.jsonl:41: no key 'text'" in err
    assert whole.documents > 50  # paragraphs were split


def test_compressed_input_in_tiny_pieces_equals_the_plain_file(tmp_path):
    play = verse(6000).decode()
    jsonl = "".join(json.dumps({"text": line}) + "\n" for line in play.split("\n"))
    for name, body in (("d.jsonl", jsonl), ("p.txt", play)):
        (tmp_path / name).write_text(body)
        with gzip.open(tmp_path / f"{name}.gz", "wt") as fh:
            fh.write(body)
    for split in (False, True):
        plain = [str(tmp_path / "d.jsonl"), str(tmp_path / "p.txt")]
        prepare(plain, "gpt2", str(tmp_path / "plain"), split_paragraphs=split, **QUIET)
        prepare([f + ".gz" for f in plain], "gpt2", str(tmp_path / "gz"), piece_bytes=64, split_paragraphs=split,
                **QUIET)
        for suffix in (".bin", ".idx"):
            assert (tmp_path / f"plain{suffix}").read_bytes() == (tmp_path / f"gz{suffix}").read_bytes()


def test_text_without_a_safe_cut_still_decodes_back(tmp_path):
    """A document with no newline between printable characters (one long line; multi-byte characters)
    is cut at a character boundary: its tokens may differ from the whole's, its text may not."""
    text = "word " * 20_000 + "é€😀" * 10_000  # no newline for 190 kB: beyond the search for a cut
    (tmp_path / "long.txt").write_text(text)
    stats = prepare([str(tmp_path / "long.txt")], "gpt2", str(tmp_path / "out"), piece_bytes=256, **QUIET)
    data, tok = IndexedDataset(tmp_path / "out"), get_tokenizer("gpt2")
    assert stats.documents == 1 and stats.invalid_utf8_documents == 0
    assert tok.decode(data.document(0).tolist()) == text


def test_a_file_that_vanishes_before_a_worker_reads_it_is_a_clear_error(tmp_path, monkeypatch):
    """Workers read the files themselves, after the main process has checked them: a file removed in
    between stops the run with the path (the error crosses the process boundary) and leaves nothing."""
    from meshlm.data import prepare as prepare_module

    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(f"text of {name}\n")
    planned = prepare_module.plan_items

    def plan_then_remove(files, *args):
        items = list(planned(files, *args))
        (tmp_path / "b.txt").unlink()
        return iter(items)

    monkeypatch.setattr(prepare_module, "plan_items", plan_then_remove)
    with pytest.raises(DataError, match=r"b\.txt cannot be read .*fix or remove the file"):
        prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], "gpt2", str(tmp_path / "out"), workers=2,
                chunk_bytes=1, **QUIET)
    assert sorted(os.listdir(tmp_path)) == ["a.txt"]


def test_a_worker_killed_mid_run_is_a_clear_error_not_a_hang(tmp_path, monkeypatch):
    """A worker that dies (here SIGKILL, as the kernel's OOM killer would) fails the run at once with a
    clear error; multiprocessing.Pool would wait for its result forever. Nothing is left behind."""
    from meshlm.data import prepare as prepare_module

    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text(f"text of {name}\n")

    def encode_or_die(items):
        if any(item.source.endswith("b.txt") for item in items):
            os.kill(os.getpid(), signal.SIGKILL)
        return planned_encode(items)

    planned_encode = prepare_module.encode_task
    monkeypatch.setattr(prepare_module, "encode_task", encode_or_die)  # forked workers inherit the patch
    with pytest.raises(DataError, match="a tokenizing worker process died .*nothing was written"):
        prepare([str(tmp_path / n) for n in ("a.txt", "b.txt", "c.txt")], "gpt2", str(tmp_path / "out"),
                workers=2, chunk_bytes=1, **QUIET)
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt", "c.txt"]


COPIES = 100  # of the 42 plays: 500 MB, tens of seconds of work, so no run ends before a signal sent at start


def start_cli_prepare(tmp_path, **popen):
    """`meshlm prepare --workers 2` started on 100 copies of Shakespeare (500 MB: tens of seconds of work
    even on a fast machine, where the tests below stop it within a second of its start), writing into
    tmp_path/out: (process, out)."""
    corpus, out = tmp_path / "corpus", tmp_path / "out"
    corpus.mkdir()
    out.mkdir()
    for c in range(COPIES):
        for play in shakespeare_files():
            (corpus / f"{c}-{play.name}").symlink_to(play)
    command = [*meshlm_command(), "prepare", "--input", str(corpus), "--output", str(out / "shk"), "--workers", "2",
               "--no-progress"]
    return subprocess.Popen([sys.executable, "-c", SIGINT_DEFAULT, *command], cwd=ROOT, **popen), out


def wait_until_running(proc: subprocess.Popen, out: Path) -> None:
    """Until the hidden task directory exists: the CLI is past Python's start-up (its SIGINT handler is
    in place) and starts its workers (a SIGINT during their fork is deferred, not lost)."""
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".shk.parts.") for p in out.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)


def test_ctrl_c_stops_the_cli_and_leaves_nothing(tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while 2 workers run: exit code
    130, one line on stderr, and neither output nor temporary files (task files included) are left."""
    proc, out = start_cli_prepare(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
    wait_until_running(proc, out)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, (stdout, stderr)
    assert stderr.strip().splitlines()[-1] == "interrupted; nothing was written"
    assert list(out.iterdir()) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_workers_die_with_a_killed_main_process(tmp_path):
    """kill -9 of `meshlm prepare` takes its workers with it (they would otherwise wait for tasks forever)."""
    proc, _ = start_cli_prepare(tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def state_and_parent(pid: int) -> tuple[str, int]:
        """("Z" for a zombie, ...) and the parent pid of a live process; ("gone", 0) for none."""
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return "gone", 0
        return fields[0], int(fields[1])

    def children() -> list[int]:
        pids = [int(path.name) for path in Path("/proc").iterdir() if path.name.isdigit()]
        stats = {pid: state_and_parent(pid) for pid in pids}
        return [pid for pid, (state, parent) in stats.items() if parent == proc.pid and state != "Z"]

    deadline = time.monotonic() + 60
    while len(children()) < 2:  # both workers started
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    workers = children()
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while any(state_and_parent(pid)[0] not in ("gone", "Z") for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived their main process"
        time.sleep(0.05)
