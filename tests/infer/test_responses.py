"""POST /v1/responses on a real server (uvicorn in a thread over a tiny random GPT): the official openai
client's `responses.create`, whole and streamed, against the engine run in this process on the prompt the
chat template renders (and against /v1/chat/completions for the same conversation); the event sequence of a
stream; `text.format` guided by a JSON schema; every malformed field a 400 naming it, /health still 200."""

import json

import openai
import pytest
import torch

from meshlm.core.config import ModelConfig
from meshlm.data.chat import BUILTIN_TEMPLATE, ChatTemplate, render, stop_strings
from meshlm.data.tokenizers import get_tokenizer
from meshlm.infer.engine import Engine, SamplingParams
from meshlm.models.gpt import GPT
from tests.infer.server_helpers import http
from tests.infer.test_server_load import serve_in_thread

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
          "required": ["color"], "additionalProperties": False}
EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
ENDS = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def served():
    """(base URL, engine): a tiny random GPT (context 256) behind the app, 4 rows."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layers=1, hidden_size=32, n_heads=4, seq_len=256, vocab_size=50257)).eval()
    engine = Engine(model, get_tokenizer("gpt2"), max_seqs=4, max_queue=16)
    with serve_in_thread(engine) as url:
        yield url, engine


def reference(engine: Engine, messages: list[dict], max_tokens: int):
    """The greedy request of a fresh engine over the same model on `messages` rendered by the builtin template."""
    template = ChatTemplate(BUILTIN_TEMPLATE)
    ids = engine.tokenizer.encode(render(template, messages, add_generation_prompt=True))
    alone = Engine(engine.model, engine.tokenizer, max_seqs=1, max_len=engine.max_len)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=tuple(stop_strings(template)))
    return alone.generate([ids], [sp])[0]


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_responses_create_equals_the_engine_on_the_rendered_chat(served):
    url, engine = served
    out = client(url).responses.create(model="tiny", input="Hello there", max_output_tokens=6, temperature=0)
    expected = reference(engine, [{"role": "user", "content": "Hello there"}], 6)
    assert out.object == "response" and out.id.startswith("resp_") and out.store is False
    assert out.output_text == expected.text
    assert out.output[0].type == "message" and out.output[0].role == "assistant"
    assert out.usage.output_tokens == len(expected.output_ids)
    assert out.usage.input_tokens == len(expected.prompt_ids)
    if expected.finish_reason == "length":  # cut by max_output_tokens
        assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    else:
        assert out.status == "completed" and out.incomplete_details is None


def test_message_items_and_instructions_equal_chat_completions(served):
    url, _ = served
    c = client(url)
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
             {"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "output_text",
                                                                                  "text": "hello"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "more "},
                                                             {"type": "input_text", "text": "please"}]}]
    out = c.responses.create(model="tiny", instructions="You are terse.", input=items, max_output_tokens=5,
                             temperature=0)
    chat = c.chat.completions.create(model="tiny", max_tokens=5, temperature=0, messages=[
        {"role": "system", "content": "You are terse."}, {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more please"}])
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens and out.instructions == "You are terse."


def test_streamed_events_come_in_order_and_add_up_to_the_whole_reply(served):
    url, _ = served
    c = client(url)
    whole = c.responses.create(model="tiny", input="Once upon", max_output_tokens=7, temperature=0)
    events = list(c.responses.create(model="tiny", input="Once upon", max_output_tokens=7, temperature=0,
                                     stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == EVENTS and kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    final = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[4 + len(deltas):] == [*ENDS, final]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == whole.output_text == events[-1].response.output_text
    assert events[-4].text == whole.output_text and events[-1].response.usage.output_tokens == whole.usage.output_tokens
    # raw HTTP: each event's `event:` line names its data's type
    status, _, body = http("POST", url + "/v1/responses", {"input": "Once upon", "max_output_tokens": 3,
                                                           "stream": True})
    blocks = [b.split("\n") for b in body.strip().split("\n\n")]
    assert status == 200 and all(b[0] == "event: " + json.loads(b[1][len("data: "):])["type"] for b in blocks)


def test_text_format_json_schema_is_guided(served):
    url, _ = served
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    for seed_text in ("a", "b", "c"):
        out = client(url).responses.create(model="tiny", input=seed_text, max_output_tokens=24, temperature=1.0,
                                           text={"format": fmt})
        assert out.status == "completed", out
        value = json.loads(out.output_text)
        assert set(value) == {"color"} and value["color"] in ("red", "green", "blue")


@pytest.mark.parametrize("body, param", [
    ({"input": "a", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]}, "input"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
    ({"input": "a", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "a", "tools": [{"type": "function", "name": "f", "parameters": 3}]}, "tools"),
    ({"input": "a", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function",
                                                                                 "name": "g"}}, "tool_choice"),
    ({"input": "a", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "a", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": "a", "temperature": -1}, "temperature"),
    ({"input": "a", "top_p": 2}, "top_p"),
    ({"input": "a", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": "a", "text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text"),
    ({"input": "a", "text": {"fmt": {}}}, "text"),
    ({"input": "a", "instructions": ["x"]}, "instructions"),
    ({"input": "a", "stream": "yes"}, "stream"),
    ({"input": "a", "truncation": "auto"}, "truncation"),
    ({"input": "a", "tool_choice": "required"}, "tool_choice"),
    ({"input": "a", "metadata": {"k": 1}}, "metadata"),
    ({"input": "a", "model": "other"}, "model"),
    ({"input": "word " * 300}, "input"),
    ({"input": "a", "frobnicate": True}, "frobnicate"),
])
def test_malformed_fields_are_400s_naming_them(served, body, param):
    url, _ = served
    status, _, text = http("POST", url + "/v1/responses", body)
    err = json.loads(text)["error"]
    assert status == (404 if param == "model" else 400) and err["param"] == param, (status, text)
    assert http("GET", url + "/health")[0] == 200


# ---- tools: a function_call item, and the loop back ----------------------------------------------------------
@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(base URL, run): a tiny random GPT whose tokenizer folder carries Qwen2.5's template (hermes calls)."""
    from meshlm.infer.server import build_server
    from tests.infer.test_server_ops import serving
    from tests.infer.test_server_tools import checkpoint

    run = checkpoint(tmp_path_factory.mktemp("qwen"), "qwen2_5")
    with serving(build_server(str(run), max_seqs=2, model_name="run")) as url:
        yield url, run


def test_a_function_call_item_streamed_and_not_then_the_loop_back(qwen):
    from tests.infer.test_server_tools import ASK, TOOLS, valid

    url, _ = qwen
    c = client(url)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses shape
    ask = [{"role": "user", "content": "What is the weather\nin Paris?"}]
    out = c.responses.create(model="run", input=ask, tools=tools, tool_choice="required", temperature=1.0,
                             max_output_tokens=80)
    calls = [o for o in out.output if o.type == "function_call"]
    assert out.status == "completed" and len(calls) >= 1 and out.output_text == ""
    assert all(valid(o.name, o.arguments) and o.call_id.startswith("call_") for o in calls)
    events = list(c.responses.create(model="run", input=ask, tools=tools, tool_choice={"type": "function",
                                                                                        "name": "get_weather"},
                                     temperature=1.0, max_output_tokens=80, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [a.type for a in added] == ["function_call"] and added[0].name == "get_weather"
    assert done[0].arguments == args == events[-1].response.output[0].arguments and valid("get_weather", args)
    assert events[-1].type == "response.completed"
    # the loop: the call and its output go back in `input`; the reply equals chat's for the same conversation
    call = calls[0]
    back = [*ask, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "{\"temp\": 21}"}]
    answer = c.responses.create(model="run", input=back, tools=tools, max_output_tokens=6, temperature=0)
    chat = c.chat.completions.create(model="run", tools=TOOLS, max_tokens=6, temperature=0, messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "{\"temp\": 21}"}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    message = chat.choices[0].message
    assert answer.output_text == (message.content or "")
    assert [o.name for o in answer.output if o.type == "function_call"] == [t.function.name for t in
                                                                             message.tool_calls or []]
