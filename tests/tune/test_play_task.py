"""scripts/make_play_task.py, the task of benchmarks/tune_task.py: balanced, disjoint, deterministic, and each
kind of answer in its own format."""

from __future__ import annotations

import collections
import json
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import make_play_task


def rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("answer, prompt, names", [
    ("title", "\nPlay:", {" Hamlet", " Macbeth", " King Lear", " The Tempest"}),
    ("speaker", "\nPlay:\n", {"Ham", "MACBETH", "Lear", "PROSPERO"}),
])
def test_rows_balanced_disjoint_and_in_the_answers_format(tmp_path, answer, prompt, names):
    summary = make_play_task.make_task(tmp_path / "a", train_per_play=12, valid_per_play=4, answer=answer)
    assert summary == {"train": 8 * 12, "valid": 8 * 4}
    train, valid = rows(tmp_path / "a" / "train.jsonl"), rows(tmp_path / "a" / "valid.jsonl")
    for split, per_play in ((train, 12), (valid, 4)):
        assert collections.Counter(r["play"] for r in split) == {p: per_play for p in make_play_task.TITLES}
        for r in split:
            assert r["input"].endswith(prompt) and not r["input"].endswith(prompt + "\n")
            assert r["output"] == make_play_task.outputs(answer)[r["play"]]
    assert names <= {r["output"] for r in train}
    assert not {r["input"] for r in train} & {r["input"] for r in valid}
    # the same arguments write the same files
    make_play_task.make_task(tmp_path / "b", train_per_play=12, valid_per_play=4, answer=answer)
    for name in ("train.jsonl", "valid.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_speaker_answers_are_names_the_texts_print_at_a_speech_head():
    """Each play's speaker answer is printed in that play's text as a speech's first line ("Ham." or "Ham")."""
    files = make_play_task.play_files()
    for play, name in make_play_task.SPEAKERS.items():
        heads = {line.strip().rstrip(".") for line in files[play].read_text(encoding="utf-8").splitlines()}
        assert name in heads, (play, name)
