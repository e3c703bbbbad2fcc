"""scripts/make_chat_task.py, the data of benchmarks/chat_task.py: split by play, deterministic, and every
row in the form `meshlm tune` (conversations) and `meshlm align` (preference pairs) read."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import make_chat_task

SPLITS = ("train", "valid", "test")
SMALL = ["--train", "40", "--valid", "12", "--test", "12", "--pref-train", "40", "--pref-valid", "12",
         "--pref-test", "12"]


def build(out, *more):
    args = make_chat_task.parser().parse_args(["--out", str(out), *SMALL, *more])
    return make_chat_task.make_task(args)


def rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("chat")
    return out, build(out, "--valid-plays", "two_gentlemen_of_verona,tempest", "--test-plays", "winters_tale")


def test_split_is_by_play_and_held_out_sets_hold_no_training_play(task):
    out, summary = task
    plays = summary["plays"]
    assert plays["valid"] == ["tempest", "two_gentlemen_of_verona"] and plays["test"] == ["winters_tale"]
    assert len(plays["train"]) == 36 - 3 and not set(plays["train"]) & {"tempest", "two_gentlemen_of_verona",
                                                                       "winters_tale"}
    held_out = set(plays["valid"]) | set(plays["test"])
    for split in SPLITS:
        chats, prefs = rows(out / f"chat_{split}.jsonl"), rows(out / f"pref_{split}.jsonl")
        assert len(chats) == summary[split]["conversations"] == {"train": 40, "valid": 12, "test": 12}[split]
        assert len(prefs) == summary[split]["pairs"]
        assert {r["play"] for r in chats} == {r["play"] for r in prefs} == set(plays[split])  # spread over all
        for r in prefs:  # a decoy from another play comes from the same side of the split
            assert r["rejected_play"] in (held_out if split != "train" else set(plays["train"]))
    valid = rows(out / "chat_valid.jsonl")
    assert {r["play"] for r in valid} == {"tempest", "two_gentlemen_of_verona"}
    assert sum(r["play"] == "tempest" for r in valid) == 6  # evenly over the split's plays


def test_same_arguments_same_files_and_the_seed_changes_them(task, tmp_path):
    out, _ = task
    build(tmp_path / "again", "--valid-plays", "two_gentlemen_of_verona,tempest", "--test-plays", "winters_tale")
    names = [f"{kind}_{split}.jsonl" for kind in ("chat", "pref") for split in SPLITS] + ["summary.json"]
    for name in names:
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name
    build(tmp_path / "seed1", "--valid-plays", "two_gentlemen_of_verona,tempest", "--test-plays", "winters_tale",
          "--seed", "1")
    assert (tmp_path / "seed1" / "chat_train.jsonl").read_bytes() != (out / "chat_train.jsonl").read_bytes()


def test_conversations_alternate_and_answer_with_the_plays_lines(task):
    out, _ = task
    texts = {p: f.read_text(encoding="utf-8") for p, f in make_chat_task.play_files().items()}
    turns = set()
    for split in SPLITS:
        for r in rows(out / f"chat_{split}.jsonl"):
            msgs = r["messages"]
            assert set(r) == {"messages", "play", "speaker", "turns"}
            assert all(set(m) == {"role", "content"} and m["content"].strip() for m in msgs)
            roles = [m["role"] for m in msgs]
            body = roles[1:] if roles[0] == "system" else roles
            assert body == ["user", "assistant"] * (len(body) // 2) and len(body) >= 2
            assert r["turns"] == len(body) // 2 and 1 <= r["turns"] <= 3
            turns.add(r["turns"])
            assert sum(len(m["content"]) for m in msgs) <= 420  # --max-chars
            first = msgs[roles.index("user")]["content"]
            assert f"You are {r['speaker']};" in first
            assert first.startswith(make_chat_task.load_play(r["play"]).title + ". Act ")
            for m in msgs:
                if m["role"] == "assistant":  # the play's own lines, at most --lines of them, in order
                    lines = m["content"].split("\n")
                    assert 1 <= len(lines) <= 2 and len(m["content"].split()) >= 1
                    assert all(line in texts[r["play"]] for line in lines)
    assert {1, 2} <= turns <= {1, 2, 3}


def test_preference_pairs_true_line_against_a_comparable_decoy(task):
    out, _ = task
    kinds, close = set(), []
    for split in SPLITS:
        for r in rows(out / f"pref_{split}.jsonl"):
            assert set(r) == {"prompt", "chosen", "rejected", "play", "speaker", "rejected_from", "rejected_play",
                              "rejected_speaker"}
            assert isinstance(r["prompt"], str) and f"You are {r['speaker']};" in r["prompt"]
            assert r["chosen"] != r["rejected"]
            assert r["chosen"].count("\n") == r["rejected"].count("\n")  # the same number of lines
            kinds.add(r["rejected_from"])
            if r["rejected_from"] == "other_speaker":
                assert r["rejected_play"] == r["play"] and r["rejected_speaker"] != r["speaker"]
            else:
                assert r["rejected_from"] == "other_play" and r["rejected_play"] != r["play"]
            close.append(abs(len(r["rejected"]) - len(r["chosen"])) <= 0.15 * len(r["chosen"]) + 1)
    assert kinds == {"other_speaker", "other_play"}
    assert sum(close) >= 0.9 * len(close)  # length alone does not tell chosen from rejected


@pytest.mark.parametrize("argv, message", [
    (["--test-plays", "nowhere"], "--test-plays: nowhere is not a play of the corpus"),
    (["--valid-plays", "tempest", "--test-plays", "tempest"], "--valid-plays and --test-plays share tempest"),
    (["--test", "100000"], "winters_tale gives"),
])
def test_bad_arguments_one_line_exit_2(tmp_path, capsys, argv, message):
    assert make_chat_task.main(["--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message) and err.count("\n") == 1
    assert not (tmp_path / "x").exists()  # nothing written
