"""Tool calling on a real `meshlm serve`, with the official openai client: for each parser family a tiny random
GPT whose tokenizer folder carries the real template (Qwen2.5: hermes, Llama 3.1: llama3_json, vLLM's Mistral
tool template: mistral; tests/data/chat_templates/), a full tool loop (tools -> tool_calls -> a tool message ->
the answer) streamed and not, the call turn steered by guided `tool_choice` (the calls are the model's own
sampled tokens, only constrained to the call syntax and the tool's schema), and over many seeds at temperature
1 every forced call parses and validates. Plus the 400s of malformed tools, tool_choice and messages."""

import json
from pathlib import Path

import openai
import pytest
import torch

from meshlm.data.tokenizers import train_bpe
from tests.conftest import tiny_config
from tests.infer.server_helpers import GPT_MODEL, ServeProcess, http

transformers = pytest.importorskip("transformers")
pytest.importorskip("xgrammar")
TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
FAMILIES = {  # template: (parser family, special-token variables, added tokens)
    "qwen2_5": ("hermes", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]),
    "llama3_1": ("llama3_json", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                 ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"]),
    "mistral_tools": ("mistral", {"bos_token": "<s>", "eos_token": "</s>"}, ["<s>", "</s>"]),
}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tōkyō", "New \"York\""]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CONVERT = {"type": "object", "properties": {"celsius": {"type": "boolean"}}, "required": ["celsius"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city {today}.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_unit", "description": "Choose the unit.",
                                           "parameters": CONVERT}}]
ASK = [{"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                    {"type": "text", "text": "in Paris?"}]}]


def valid(name: str, arguments: str) -> bool:
    """Whether a call's arguments (JSON text) follow its tool's schema, checked by hand."""
    args = json.loads(arguments)
    if name == "get_weather":
        return (set(args) == {"city", "days"} and args["city"] in WEATHER["properties"]["city"]["enum"]
                and type(args["days"]) is int and 1 <= args["days"] <= 7)
    return name == "set_unit" and set(args) == {"celsius"} and isinstance(args["celsius"], bool)


def checkpoint(root: Path, name: str, specials: dict | None = None, added: list | None = None) -> Path:
    """A tiny random GPT (context 1024) whose tokenizer folder holds a byte-level BPE trained on this test's
    conversations, the template's special tokens (`FAMILIES[name]` unless given), tokenizer_config.json and the
    template."""
    from tokenizers import Tokenizer

    from meshlm.checkpoint.single import save_checkpoint
    from meshlm.data.chat import ChatTemplate, render
    from meshlm.models.gpt import GPT

    if specials is None:
        _, specials, added = FAMILIES[name]
    folder = root / "run" / "hf"
    text = (TEMPLATES / f"{name}.jinja").read_text()
    sample = render(ChatTemplate(text, specials), [{"role": "user", "content": "What is the weather in Paris?"}],
                    add_generation_prompt=True, tools=TOOLS)
    path = train_bpe([sample] * 4 + ['<tool_call>\n{"name": "get_weather", "arguments": {"days": 3}}'] * 4, 300,
                     folder, min_frequency=1)
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens(added)
    tok.save(str(path))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              **specials}))
    (folder / "chat_template.jinja").write_text(text)
    run = root / "run"
    cfg = tiny_config(run, model={**GPT_MODEL, "vocab_size": 320, "seq_len": 1024}, data={"tokenizer": str(folder)})
    torch.manual_seed(0)
    save_checkpoint(run, 1, {"model": GPT(cfg.model).state_dict()}, cfg.to_dict())
    return run


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    run = checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    server = ServeProcess("--checkpoint", str(run), "--max-seqs", "4")
    yield server, run, request.param
    assert server.stop() == 0, "".join(server.stderr)[-3000:]


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def streamed_call(stream) -> tuple[list[tuple[str, str]], str | None, str]:
    """([(name, arguments)], finish_reason, content) of a streamed chat reply, checking OpenAI's delta rules."""
    calls, finish, content = {}, None, ""
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:  # a call's first delta: its name, no arguments yet
                assert d.index == len(calls) and d.type == "function" and d.function.arguments == ""
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.function.name is None
                calls[d.index][1] += d.function.arguments
        finish = choice.finish_reason or finish
    return [tuple(c) for c in calls.values()], finish, content


def test_full_tool_loop_streamed_and_not(served):
    server, run, _ = served
    c = client(server)
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = c.chat.completions.create(model="run", messages=ASK, tools=TOOLS, tool_choice=named, temperature=1.0,
                                      seed=1, max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and valid(call.function.name, call.function.arguments)
    stream = c.chat.completions.create(model="run", messages=ASK, tools=TOOLS, tool_choice=named, temperature=1.0,
                                       seed=1, max_tokens=80, stream=True)
    calls, finish, content = streamed_call(stream)
    assert calls == [(call.function.name, call.function.arguments)] and finish == "tool_calls" and content == ""

    # the call goes back in as the client sends it, with the tool's result; the answer is free text
    messages = [*ASK, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "{\"temp\": 21}"}]
    answer = c.chat.completions.create(model="run", messages=messages, tools=TOOLS, max_tokens=6, temperature=0)
    assert answer.choices[0].message.tool_calls is None and isinstance(answer.choices[0].message.content, str)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(run / "hf"))
    hf_messages = [{"role": "user", "content": "What is the weather\nin Paris?"},
                   {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {
                       "name": "get_weather", "arguments": json.loads(call.function.arguments)}}]}, messages[-1]]
    ids = hf.apply_chat_template(hf_messages, tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                 return_dict=False)
    assert answer.usage.prompt_tokens == len(ids)  # the tool call and result were rendered as transformers does
    again = c.chat.completions.create(model="run", messages=messages, tools=TOOLS, max_tokens=6, temperature=0,
                                      stream=True)
    _, finish, text = streamed_call(again)
    assert text == answer.choices[0].message.content and finish == answer.choices[0].finish_reason


def test_required_calls_always_parse_and_validate(served):
    server, _, _ = served
    c = client(server)
    names = set()
    for seed in range(12):
        reply = c.chat.completions.create(model="run", messages=ASK, tools=TOOLS, tool_choice="required",
                                          temperature=1.0, seed=seed, max_tokens=80)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert valid(call.function.name, call.function.arguments), call
        names.add(call.function.name)
    assert names == {"get_weather", "set_unit"}  # the union over the tools: either may be called


BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools", "parameters"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools", "tools[0]"),
    ({"tools": "f"}, "tools", "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'required'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": [*ASK, {"role": "tool", "content": "21"}]}, "messages", "tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "call_123456789", "type": "function", "function": {"name": "f", "arguments": "{city: Paris"}}]}]},
     "messages", "JSON text"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "call_123456789", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages", "JSON text"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     "'image_url' part"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages", "content[0]"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "content"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "a"}]}, "messages", "tool_call_id"),
    ({"max_thinking_tokens": 5}, "max_thinking_tokens", "--reasoning-parser"),
]


@pytest.mark.parametrize("served", ["qwen2_5"], indirect=True)  # one server is enough for the 400s
@pytest.mark.parametrize("extra,param,says", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_malformed_tool_fields_are_400s_naming_them(served, extra, param, says):
    server = served[0]
    status, _, body = http("POST", server.url + "/v1/chat/completions", {"messages": ASK, **extra})
    assert status == 400, (status, body)
    err = json.loads(body)["error"]
    assert err["param"] == param and says in err["message"], err
    assert http("GET", server.url + "/health")[0] == 200


@pytest.mark.parametrize("served", ["qwen2_5"], indirect=True)
def test_tool_choice_none_renders_the_tools_and_parses_nothing(served):
    server, run, _ = served
    c = client(server)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(run / "hf"))
    plain = [{"role": "user", "content": "What is the weather\nin Paris?"}]
    with_tools = hf.apply_chat_template(plain, tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    without = hf.apply_chat_template(plain, tokenize=True, add_generation_prompt=True, return_dict=False)
    out = {choice: c.chat.completions.create(model="run", messages=ASK, tools=TOOLS, tool_choice=choice,
                                             max_tokens=6, temperature=0) for choice in ("none", "auto")}
    assert out["none"].usage.prompt_tokens == out["auto"].usage.prompt_tokens == len(with_tools) > len(without)
    assert out["none"].choices[0].message.tool_calls is None and out["none"].choices[0].finish_reason != "tool_calls"
    assert out["none"].choices[0].message.content == out["auto"].choices[0].message.content
