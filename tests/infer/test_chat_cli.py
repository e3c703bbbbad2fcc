"""`meshlm chat` driven through a pipe: greedy replies are what `meshlm generate` gives for the conversation as
transformers' apply_chat_template renders it, /reset forgets, a long conversation keeps to the context, SIGINT
stops the streaming reply and the next message is still answered, and a reply ends at a declared eos id."""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from meshlm.data.tokenizers import get_tokenizer
from meshlm.infer.chat import ReplyStream
from tests.conftest import ROOT, SIGINT_DEFAULT, meshlm_command, tiny_config
from tests.interop.hf_tiny import CHATML, write_hf_dir
from tests.interop.interop_helpers import ok, one_error_line

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NEW = 8  # --max-new-tokens of the short replies


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    """A tiny random RoPE GPT (context 2048) on a byte-level BPE with the ChatML specials, whose folder carries a
    ChatML template and declares <|im_end|> and <|endoftext|> as its ends; the specials' output rows are zero,
    so a reply never ends early (long replies for the SIGINT test)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    from meshlm.checkpoint.single import save_checkpoint
    from meshlm.data.assets import shakespeare_files
    from meshlm.models.gpt import GPT

    root = tmp_path_factory.mktemp("chat")
    folder = root / "run" / "hf"
    folder.mkdir(parents=True)
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = shakespeare_files()[0].read_text(encoding="utf-8")[:20000] + "\ncafé naïve — ümlaut ✓\n"
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHATML}))
    ids = [tok.token_to_id(t) for t in SPECIALS]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[2], ids[0]]}))
    cfg = tiny_config(root / "run", model={"n_layers": 2, "hidden_size": 32, "n_heads": 4, "seq_len": 2048,
                                           "vocab_size": 400, "position": "rope", "tie_embeddings": False},
                      data={"tokenizer": str(folder)})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    with torch.no_grad():
        model.lm_head.weight[ids] = 0.0
    save_checkpoint(root / "run", 1, {"model": model.state_dict()}, cfg.to_dict())
    return root / "run"


def chat(run: Path, lines: list[str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([*meshlm_command(), "chat", "--checkpoint", str(run), "--temperature", "0", *flags],
                          input="".join(f"{line}\n" for line in lines), capture_output=True, text=True, cwd=ROOT,
                          check=False, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@functools.cache
def hf_tokenizer(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def rendered(run: Path, messages: list[dict]) -> str:
    """The prompt as transformers renders the checkpoint's template (the independent reference)."""
    return hf_tokenizer(run / "hf").apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def generated(run: Path, prompt: str, n: int = NEW) -> str:
    """The reply `meshlm generate --temperature 0` gives after `prompt`."""
    out = ok(["generate", "--checkpoint", str(run), "--prompt", prompt, "--temperature", "0", "--max-new-tokens",
              str(n)])
    assert out.startswith(prompt) and out.endswith("\n"), out
    return out[len(prompt):-1]


def conversation(system: str | None, turns: list[tuple[str, str]], user: str) -> list[dict]:
    out = [{"role": "system", "content": system}] if system else []
    for question, answer in turns:
        out += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return [*out, {"role": "user", "content": user}]


def test_greedy_replies_are_generates_for_the_rendered_conversation_and_reset_forgets(chat_run):
    system = "Answer in verse."
    proc = chat(chat_run, ["Who art thou?", "And whence comest thou?", "/reset", "And whence comest thou?"],
                "--system", system, "--max-new-tokens", str(NEW))
    assert proc.returncode == 0, proc.stderr
    first = generated(chat_run, rendered(chat_run, conversation(system, [], "Who art thou?")))
    second = generated(chat_run, rendered(chat_run, conversation(system, [("Who art thou?", first)],
                                                                 "And whence comest thou?")))
    after_reset = generated(chat_run, rendered(chat_run, conversation(system, [], "And whence comest thou?")))
    assert first and second and after_reset
    assert proc.stdout == f"{first}\n{second}\n{after_reset}\n"


def test_a_long_conversation_drops_its_oldest_turns_to_stay_in_the_context(chat_run):
    """--context 96 with replies of up to 8 tokens: a prompt may use 88 tokens; the kept turns are the most
    recent that fit (a dropped turn stays dropped), said once on stderr."""
    context, budget = 96, 96 - NEW
    users = [f"Tell me of the {w} and the king." for w in ("duke", "queen", "fool", "ghost", "witch", "moor",
                                                           "shrew", "prince")]
    proc = chat(chat_run, users, "--max-new-tokens", str(NEW), "--context", str(context))
    assert proc.returncode == 0, proc.stderr
    tok = get_tokenizer(str(chat_run / "hf"))
    history: list[tuple[str, str]] = []
    expected = []
    for user in users:
        keep = len(history)
        while len(tok.encode(rendered(chat_run, conversation(None, history[len(history) - keep:], user)))) > budget:
            keep -= 1
        history = history[len(history) - keep:]
        prompt = rendered(chat_run, conversation(None, history, user))
        assert len(tok.encode(prompt)) + NEW <= context
        answer = generated(chat_run, prompt)
        expected.append(answer)
        history.append((user, answer))
    assert len(history) < len(users)  # turns were dropped
    assert proc.stdout == "".join(f"{a}\n" for a in expected)
    assert proc.stderr.count("no longer fits the context of 96 tokens") == 1, proc.stderr


def _read_until(fd: int, deadline: float, want) -> bytes:
    data = b""
    while time.monotonic() < deadline and not want(data):
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    return data


def test_sigint_stops_the_streaming_reply_and_the_next_message_is_answered(chat_run):
    long = 600  # tokens: the reply must still be streaming when the signal (sent at its first output) lands, also
    # on a loaded host (200 once finished first while the suite ran two workers on two cores)
    # SIGINT at its default disposition whatever the suite's own (conftest.SIGINT_DEFAULT)
    command = [*meshlm_command(), "chat", "--checkpoint", str(chat_run), "--temperature", "0", "--max-new-tokens",
               str(long)]
    proc = subprocess.Popen([sys.executable, "-c", SIGINT_DEFAULT, *command], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        proc.stdin.write(b"Speak on, and do not stop.\n")
        proc.stdin.flush()
        out = _read_until(proc.stdout.fileno(), time.monotonic() + 120, lambda d: len(d) > 0)
        assert out, "no reply streamed"
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(b"Now, briefly.\n", timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout = (out + rest).decode()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert "(reply stopped)" in err.decode()
    first = generated(chat_run, rendered(chat_run, conversation(None, [], "Speak on, and do not stop.")), long)
    # stdout is a cut-short prefix of the full first reply, a newline, then the reply to the second message with
    # that prefix in the history
    cuts = [m for m in range(len(first)) if stdout.startswith(first[:m] + "\n")]
    assert cuts, stdout[:200]
    answers = {m: generated(chat_run, rendered(chat_run, conversation(None, [("Speak on, and do not stop.",
                                                                              first[:m])], "Now, briefly.")), long)
               for m in cuts[-2:]}
    assert any(stdout == f"{first[:m]}\n{a}\n" for m, a in answers.items()), stdout[-300:]


def test_a_reply_ends_at_a_declared_eos_id(tmp_path):
    """A ChatML import steered to answer `hello world` then <|eot_id|>, declared in generation_config.json
    beside <|im_end|>: every turn's reply stops there (--max-new-tokens would allow 30)."""
    write_hf_dir(tmp_path / "hf", "llama3", [["assistant", "hello", "world", "<|eot_id|>", "there"]],
                 ["<|im_end|>", "<|eot_id|>"], chat_template=CHATML)
    ok(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    proc = chat(tmp_path / "run", ["hi", "hi there"], "--max-new-tokens", "30")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "hello world\nhello world\n"


def test_an_imported_model_without_a_chat_template_is_one_error_naming_the_flag(tmp_path):
    write_hf_dir(tmp_path / "hf", "chatml", [["assistant", "hello", "<|im_end|>"]], "<|im_end|>")
    ok(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    one_error_line(["chat", "--checkpoint", str(tmp_path / "run")], "no chat template", "--chat-template FILE")
    (tmp_path / "chatml.jinja").write_text(CHATML)
    proc = chat(tmp_path / "run", ["hi"], "--chat-template", str(tmp_path / "chatml.jinja"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "hello\n"


def test_the_stream_shows_multi_byte_characters_whole_and_holds_back_a_stop_string():
    """Byte-level tokens that split a character show it once whole; text that may start the stop string
    waits, and the stop string itself is never shown."""
    tok = get_tokenizer("gpt2")
    text = "café — naïve ✓ 日本"
    ids = tok.encode(text + "<|im_end|> more")
    stream = ReplyStream(tok.decode, ("<|im_end|>",))
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.finish())
    assert "".join(pieces) == text and stream.text == text and stream.stopped
    assert all("\ufffd" not in p for p in pieces)
    assert len([p for p in pieces if p]) > 3  # streamed, not all at the end


def test_a_reply_cut_inside_a_character_shows_a_prefix_of_the_whole_reply():
    """Ctrl-C between two tokens of one character (`reply` then calls `finish(cut=True)`): its bytes so far are
    dropped, so what was shown, and what the conversation keeps, is a prefix of the reply it would have been (the
    SIGINT test above once landed inside a two-byte character and saw U+FFFD where the whole reply had it whole).
    A reply that ends there on its own (its last token) still shows the U+FFFD."""
    tok = get_tokenizer("gpt2")
    text = "café — naïve ✓ 日本"
    ids = tok.encode(text)
    inside = 0
    for k in range(1, len(ids) + 1):
        cut, ended = ReplyStream(tok.decode), ReplyStream(tok.decode)
        shown = "".join(cut.push(i) for i in ids[:k]) + cut.finish(cut=True)
        assert text.startswith(shown) and cut.text == shown, (k, shown)
        whole = "".join(ended.push(i) for i in ids[:k]) + ended.finish()
        inside += whole.endswith("\ufffd")
    assert inside >= 2  # the text has cuts inside characters (each of 日 and 本 is three bytes over two tokens)
