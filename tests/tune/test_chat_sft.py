"""Chat fine-tuning (`meshlm tune` on {"messages": [...]} lines, meshlm/tune/chat_data.py): the targets are the
assistant's tokens only, packed rows give each conversation the very losses it has alone (float64), the run
trains, resumes and records its template, and bad conversations are one line naming their file:line."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from meshlm.checkpoint.files import checkpoints_dir, step_name
from meshlm.core.config import build
from meshlm.families.gpt import document_inputs
from meshlm.models.gpt import GPT
from meshlm.models.loss import IGNORE_INDEX as IGNORE
from meshlm.tune.chat_data import Conversation, chat_dataset, pack_rows
from tests.tune.test_tune_command import assert_one_error
from tests.tune.tune_helpers import GPT2, LLAMA, QUIET, WORDS, run, save_base, train_losses, write_jsonl

EOD = 50256  # the GPT-2 tokenizer's end-of-document token
SMALL_VOCAB, SMALL_EOD = 1024, 1023  # the packing test's model: random ids below 1000, its own end-of-document


# ---- packing ------------------------------------------------------------------------------------------------
def test_pack_rows_is_first_fit_decreasing():
    lengths = [5, 9, 3, 7, 2, 8, 1, 4]
    rows = pack_rows(lengths, 10)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows)
    # longest first, each into the first row with room: 9+1 | 8+2 | 7+3 | 5+4
    assert rows == [[1, 6], [5, 4], [3, 2], [0, 7]]
    assert pack_rows([10, 10], 10) == [[0], [1]]


def synthetic_conversations(n: int, seed: int, longest: int, eod: int = SMALL_EOD) -> list[Conversation]:
    """Conversations of random ids (no end-of-document inside) and random assistant spans, each ending
    with the end-of-document token, as `encode_conversation` builds them."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        size = rng.randint(3, longest - 1)
        ids = [rng.randrange(1000) for _ in range(size)] + [eod]
        mask = [False] + [rng.random() < 0.5 for _ in range(size - 1)] + [False]
        mask[size - 1] = True  # at least one assistant token
        targets = [ids[i + 1] if mask[i + 1] else IGNORE for i in range(size)] + [IGNORE]
        out.append(Conversation(f"x.jsonl:{k + 1}", ids, targets))
    return out


def token_losses(model, ids: np.ndarray, targets: np.ndarray, packed: bool) -> torch.Tensor:
    x = torch.from_numpy(ids)
    kw = document_inputs(x, SMALL_EOD) if packed else {}
    with torch.no_grad():
        logits = model(x, **kw)
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), torch.from_numpy(targets),
                                             ignore_index=IGNORE, reduction="none")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_packed_rows_give_each_conversation_its_unpacked_losses(family):
    """The same conversations one per row (no document mask) and packed first-fit-decreasing (with it):
    every conversation's per-token losses agree in float64, the packed set has fewer rows, the same
    targets, and each conversation's end-of-document token ends it in both."""
    cfg = build({"model": {**(GPT2 if family == "gpt2" else LLAMA), "family": "gpt", "vocab_size": SMALL_VOCAB}}).model
    torch.manual_seed(0)
    model = GPT(cfg).double().eval()
    convs = synthetic_conversations(12, 1, 20)
    length = cfg.seq_len
    alone = chat_dataset(convs, length, SMALL_EOD)
    packed = chat_dataset(convs, length, SMALL_EOD, pack=True)
    assert len(packed) < len(alone) and packed.num_tokens == alone.num_tokens
    one = token_losses(model, alone.ids, alone.targets, packed=False)
    many = token_losses(model, packed.ids, packed.targets, packed=True)
    rows = pack_rows([len(c.ids) for c in convs], length)
    seen = 0
    for row, group in enumerate(rows):
        at = 0
        for i in group:
            n = len(convs[i].ids)
            assert packed.ids[row, at + n - 1] == SMALL_EOD and alone.ids[i, n - 1] == SMALL_EOD
            assert np.array_equal(packed.targets[row, at:at + n], alone.targets[i, :n])
            a, b = one[i, :n], many[row, at:at + n]
            assert float(a.sum()) > 0
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
            at, seen = at + n, seen + 1
        assert (packed.targets[row, at:] == IGNORE).all() and (packed.ids[row, at:] == SMALL_EOD).all()
    assert seen == len(convs)
    # Without the document mask the packed conversations would see each other: the check above has teeth.
    leaky = token_losses(model, packed.ids, packed.targets, packed=False)
    assert not torch.allclose(leaky, many)


# ---- conversations end to end ---------------------------------------------------------------------------------
CHAT_MODEL = {**GPT2, "seq_len": 128}


def chat_rows(n: int, seed: int) -> list[dict]:
    """Conversations of 1-3 exchanges, half with a system turn: the assistant repeats the colour asked for."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        turns = [] if rng.random() < 0.5 else [{"role": "system", "content": "repeat"}]
        for _ in range(rng.randint(1, 3)):
            word = rng.choice(WORDS)
            turns += [{"role": "user", "content": f"say {word}"}, {"role": "assistant", "content": word}]
        rows.append({"messages": turns})
    return rows


def prepared(argv: list[str]):
    """`meshlm tune ARGV`'s prepare (config, tokenizer, train set, valid set, info), printing nothing."""
    import argparse
    import contextlib
    import io

    from meshlm.commands.tune import add_tune_command, tune_options
    from meshlm.tune.command import prepare

    parser = argparse.ArgumentParser()
    add_tune_command(parser.add_subparsers())
    args, overrides = parser.parse_known_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        return prepare(tune_options(args), overrides)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {"root": root, "base": save_base(root / "base", CHAT_MODEL),
            "train": write_jsonl(root / "train.jsonl", chat_rows(40, 1)),
            "valid": write_jsonl(root / "valid.jsonl", chat_rows(10, 2))}


def chat_args(chat, out, *extra: str, method: str = "full") -> list[str]:
    return ["tune", "--checkpoint", str(chat["base"]), "--method", method, "--train", str(chat["train"]),
            "--valid", str(chat["valid"]), "--out", str(out), *QUIET, "--train.max_steps=6", "--train.log_every=1",
            "--optim.lr=1e-2", "--optim.warmup_steps=1", *extra]


def test_targets_are_the_assistant_tokens(chat, tmp_path):
    """Each row: the conversation as the template renders it, then the end-of-document token; a position's
    target is the next token exactly where that token lies in an assistant turn (content and end of turn)."""
    from meshlm.data.chat import BUILTIN_TEMPLATE, render_with_spans
    from meshlm.data.tokenizers import get_tokenizer

    _, _, train, _, info = prepared(chat_args(chat, tmp_path / "run"))
    assert info["chat_template"] == BUILTIN_TEMPLATE and info["pack"] is False
    tok = get_tokenizer("gpt2")
    rows = chat_rows(40, 1)
    assert len(train) == len(rows)
    for k, row in enumerate(rows):
        text, spans = render_with_spans(BUILTIN_TEMPLATE, row["messages"])
        ids = tok.encode(text) + [EOD]
        assert train.ids[k, :len(ids)].tolist() == ids
        scored = [tok.decode([int(t)]) for t in train.targets[k] if t != IGNORE]
        assert "".join(scored) == "".join(text[a:b] for a, b in spans)  # every assistant character, nothing else
        assert "".join(scored) == "".join(m["content"] + "\n<|end|>\n" for m in row["messages"]
                                          if m["role"] == "assistant")
    # Prompt tuning: the same conversation after the virtual tokens' placeholders (targets ignored there).
    # (one virtual token: the longest conversation leaves room for it in the 128)
    _, _, prompted, _, _ = prepared(chat_args(chat, tmp_path / "p", "--tune.virtual_tokens=1", method="prompt"))
    assert (prompted.ids[:, 0] == 0).all() and (prompted.targets[:, 0] == IGNORE).all()
    assert np.array_equal(prompted.ids[:, 1:], train.ids[:, :-1])
    assert np.array_equal(prompted.targets[:, 1:], train.targets[:, :-1])


def test_chat_sft_packed_trains_and_resumes(chat, tmp_path):
    """--pack: fewer rows, data.document_mask=true on the run's config, the loss falls, tune.json records the
    template; a run stopped after its step-3 checkpoint, given the same command again, resumes there and ends
    with the uninterrupted run's losses."""
    cfg, _, train, _, _ = prepared(chat_args(chat, tmp_path / "x", "--pack"))
    assert cfg.data.document_mask and len(train) < 40
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    code, _, err = run(*chat_args(chat, whole, "--pack", "--train.save_every=3"))
    assert code == 0, err
    losses = train_losses(whole)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5
    info = json.loads((whole / "tune.json").read_text())
    assert info["pack"] is True and "{% generation %}" in info["chat_template"]
    shutil.copytree(whole, cut)  # as if stopped after step 3: its last checkpoint gone, its log kept
    shutil.rmtree(checkpoints_dir(cut) / step_name(6))
    code, stdout, err = run(*chat_args(chat, cut, "--pack", "--train.save_every=3"))
    assert code == 0, err
    assert "resumed from" in stdout and "step_0000003" in stdout
    assert train_losses(cut)[-3:] == losses[3:]


def test_bad_conversations_are_one_line(chat, tmp_path):
    """Each mistake: exit code 2, one line naming the file:line (or the flag) and the fix, no DIR left."""
    root = chat["root"]
    good = chat_rows(1, 3)[0]
    cases = [
        ([good, {"input": "say red", "output": " red"}], "bad.jsonl:2", "one kind of line"),
        ([good, {"messages": [{"role": "user", "content": "say red"}]}], "bad.jsonl:2", "no assistant turn"),
        ([{"messages": [{"role": "bot", "content": "red"}]}], "bad.jsonl:1", "role \"bot\""),
        ([{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}], "bad.jsonl:1",
         "not text"),
        ([{"messages": "say red"}], "bad.jsonl:1", "not a list of turns"),
        ([{"messages": [{"role": "user", "content": "word " * 160}, {"role": "assistant", "content": "red"}]}],
         "bad.jsonl:1", "--truncate"),
    ]
    for k, (rows, *words) in enumerate(cases):
        bad = write_jsonl(root / "bad.jsonl", rows)
        out = tmp_path / f"bad{k}"
        code, _, err = run("tune", "--checkpoint", str(chat["base"]), "--method", "lora", "--train", str(bad),
                           "--valid", str(chat["valid"]), "--out", str(out))
        assert_one_error(code, err, *words)
        assert not out.exists()
    # --truncate keeps the start: here only the user's turn fits, so nothing is left to learn.
    code, _, err = run("tune", "--checkpoint", str(chat["base"]), "--method", "lora", "--train", str(bad),
                       "--valid", str(chat["valid"]), "--out", str(tmp_path / "cut"), "--truncate")
    assert_one_error(code, err, "bad.jsonl:1", "no assistant token")
    for extra, words in ((["--method", "prompt", "--pack"], ("--pack", "--method prompt")),
                         (["--template", "{answer}"], ("--template", "--chat-template")),
                         (["--pack", "--data.document_mask=false"], ("data.document_mask",)),
                         (["--chat-template", str(root / "none.jinja")], ("none.jinja",))):
        code, _, err = run(*chat_args(chat, tmp_path / "flags", *extra))
        assert_one_error(code, err, *words)
    io_rows = write_jsonl(root / "io.jsonl", [{"input": "say red", "output": " red"}])
    code, _, err = run("tune", "--checkpoint", str(chat["base"]), "--method", "lora", "--train", str(io_rows),
                       "--valid", str(io_rows), "--out", str(tmp_path / "io"), "--pack")
    assert_one_error(code, err, "--pack", "conversations")


def test_chat_template_file_replaces_the_checkpoints(chat, tmp_path):
    """--chat-template FILE renders the conversations (its text recorded in tune.json's chat_template)."""
    template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}A: {% generation %}{{ m['content'] }}."
                "{% endgeneration %}\n{% else %}Q: {{ m['content'] }}\n{% endif %}{% endfor %}")
    path = chat["root"] / "qa.jinja"
    path.write_text(template)
    _, tok, train, _, info = prepared(chat_args(chat, tmp_path / "run", "--chat-template", str(path)))
    assert info["chat_template"] == template
    first = chat_rows(40, 1)[0]["messages"]
    scored = "".join(tok.decode([int(t)]) for t in train.targets[0] if t != IGNORE)
    # (GPT-2's BPE writes the space of "A: " into the content's first token, which the span overlaps)
    assert scored == "".join(" " + m["content"] + "." for m in first if m["role"] == "assistant")
