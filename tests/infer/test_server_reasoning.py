"""Reasoning on a real `meshlm serve --reasoning-parser qwen3` over a tiny random GPT with Qwen3's template
(tests/data/chat_templates/qwen3.jinja): `reasoning_content` split from `content`, streamed and not, and the
thinking budget (`max_thinking_tokens`) closing the think block after exactly that many tokens. The reply is
steered with logit_bias (`<think>` at +100: every free token is `<think>`), so what is reasoning and what is
content is known by hand: the first `<think>` opens the block, the budget's tokens are reasoning, the forced
`</think>` closes it, and the rest is content."""

import openai
import pytest

from tests.infer.server_helpers import ServeProcess
from tests.infer.test_server_tools import checkpoint

pytest.importorskip("transformers")
SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
ADDED = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]
ASK = [{"role": "user", "content": "Think first."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run = checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", SPECIALS, ADDED)
    server = ServeProcess("--checkpoint", str(run), "--max-seqs", "2", "--reasoning-parser", "qwen3")
    from meshlm.data.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(run / "hf"))
    yield server, tokenizer
    assert server.stop() == 0, "".join(server.stderr)[-3000:]


def ask(server, tokenizer, stream=False, **extra):
    (think,) = tokenizer.encode("<think>")
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return c.chat.completions.create(model="run", messages=ASK, max_tokens=12, temperature=0, stream=stream,
                                     logit_bias={str(think): 100}, extra_body=extra or None)


def test_reasoning_content_is_split_from_content(served):
    server, tokenizer = served
    reply = ask(server, tokenizer).choices[0]
    assert reply.message.reasoning_content == "<think>" * 11  # the first opened the block, which never closed
    assert reply.message.content == "" and reply.finish_reason == "length"


@pytest.mark.parametrize("budget", [0, 4])
def test_the_thinking_budget_closes_the_block(served, budget):
    server, tokenizer = served
    reply = ask(server, tokenizer, max_thinking_tokens=budget).choices[0]
    assert reply.message.reasoning_content == ("<think>" * budget or None)
    assert reply.message.content == "<think>" * (12 - 2 - budget)  # after the forced </think>
    reasoning, content = "", ""
    for chunk in ask(server, tokenizer, stream=True, max_thinking_tokens=budget):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (reply.message.reasoning_content or "", reply.message.content)


@pytest.mark.parametrize("flags", [["--max-thinking-tokens", "5"],
                                   ["--max-thinking-tokens", "-1", "--reasoning-parser", "qwen3"]], ids=" ".join)
def test_a_thinking_budget_needs_a_reasoning_parser(tmp_path, capsys, flags):
    """One line `error: ...` naming the flag, exit 2, before anything is loaded."""
    from meshlm.cli import main

    code = main(["serve", "--checkpoint", str(tmp_path / "none"), *flags])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --max-thinking-tokens"), err
