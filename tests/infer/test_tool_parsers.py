"""The tool-call parsers (meshlm.infer.tools) and the reasoning parsers (meshlm.infer.reasoning) on the cases
vLLM's issues list: several calls in one reply, calls after text, arguments with braces, quotes and unicode, a
call cut by max_tokens, a stream split inside the tag at every position; plus the template family detection.
The expected calls are written by hand (json.dumps of the arguments the reply holds)."""

import json
from pathlib import Path

import pytest

from meshlm.data.chat import ChatTemplate
from meshlm.infer.reasoning import ReasoningParser, split
from meshlm.infer.replies import ReplyReader, ToolPlan
from meshlm.infer.tools import SYNTAXES, ToolParser, detect, parse, parser_for

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
TRICKY = {"city": "Pa\"ris {not: a brace}", "note": "naïve café 東京 🌧", "nested": {"list": [1, {"x": "]}"}]},
          "path": "C:\\temp\\"}


def hermes(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}\n</tool_call>'


def llama(name, args):
    return f'{{"name": "{name}", "parameters": {json.dumps(args, ensure_ascii=False)}}}'


def mistral(*calls):
    items = ", ".join(f'{{"name": "{n}", "arguments": {json.dumps(a, ensure_ascii=False)}}}' for n, a in calls)
    return f"[TOOL_CALLS] [{items}]"


def calls_of(parser):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parser.tool_calls()]


def streamed(family: str, pieces: list[str]):
    """(content, [(name, arguments text)], the call deltas) of `pieces` fed one by one, checking OpenAI's delta
    rules on the way: a call's first delta has index, id, type and name with empty arguments; later ones only
    argument fragments of that index."""
    parser = ToolParser(SYNTAXES[family])
    content, deltas = "", []
    for piece in [*pieces, None]:
        d = parser.feed(piece) if piece is not None else parser.finish()
        content += d.content
        deltas += [c.to_openai() for c in d.calls]
    calls = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] == len(calls) and d["type"] == "function" and d["id"].startswith("call_")
            assert d["function"]["name"] and d["function"]["arguments"] == ""
            calls[d["index"]] = [d["function"]["name"], ""]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]][1] += d["function"]["arguments"]
    return content, [tuple(c) for c in calls.values()]


CASES = [
    ("hermes", hermes("get_weather", TRICKY), "", [("get_weather", TRICKY)]),
    ("hermes", "Let me look.\n" + hermes("a", {"q": 1}) + "\n" + hermes("b", {}) + "\nDone.", "Let me look.\nDone.",
     [("a", {"q": 1}), ("b", {})]),
    ("llama3_json", llama("get_weather", TRICKY), "", [("get_weather", TRICKY)]),
    ("llama3_json", llama("a", {"q": [1, 2]}) + "; " + llama("b", {"s": "x;y"}), "",
     [("a", {"q": [1, 2]}), ("b", {"s": "x;y"})]),
    ("llama3_json", "Sure. <|python_tag|>" + llama("a", {"q": "}{"}), "Sure. ", [("a", {"q": "}{"})]),
    ("mistral", mistral(("get_weather", TRICKY), ("b", {"k": "]"})), "", [("get_weather", TRICKY), ("b", {"k": "]"})]),
    ("mistral", "First text. " + mistral(("a", {})), "First text. ", [("a", {})]),
]


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_whole_reply_parses_into_content_and_calls(family, text, content, calls):
    parser = ToolParser(SYNTAXES[family])
    got_content, tool_calls = parse(parser, text)
    assert got_content == content
    assert calls_of(parser) == calls
    assert len({c["id"] for c in tool_calls}) == len(calls)


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_a_stream_split_anywhere_gives_the_same_calls(family, text, content, calls):
    whole = ToolParser(SYNTAXES[family])
    _, expected = parse(whole, text)
    for k in range(len(text) + 1):  # split at every position (inside each tag too)
        got_content, got = streamed(family, [text[:k], text[k:]])
        assert got_content == content, k
        assert got == [(c["function"]["name"], c["function"]["arguments"]) for c in expected], k
    got_content, got = streamed(family, list(text))  # one character at a time
    assert got_content == content and [(n, json.loads(a)) for n, a in got] == calls


def test_text_that_may_begin_a_tag_is_held_and_only_that():
    parser = ToolParser(SYNTAXES["hermes"])
    assert parser.feed("Hello <tool").content == "Hello "  # "<tool" may begin <tool_call>
    assert parser.feed("box> and more").content == "<toolbox> and more"
    assert parser.finish().content == ""
    assert parse(ToolParser(SYNTAXES["hermes"]), "a < b <tool_ca") == ("a < b <tool_ca", [])


def test_a_call_cut_by_max_tokens():
    parser = ToolParser(SYNTAXES["hermes"])
    text = hermes("f", {"city": "Paris", "days": 3})
    content, calls = parse(parser, text[:text.index('"days') + 2])
    assert content == "" and [c["function"]["name"] for c in calls] == ["f"]
    assert calls[0]["function"]["arguments"] == '{"city": "Paris", "d'  # what was written, not JSON
    # cut before the name is complete: no call, the text is given back
    assert parse(ToolParser(SYNTAXES["hermes"]), '<tool_call>\n{"name": "f') == ('<tool_call>\n{"name": "f', [])
    assert parse(ToolParser(SYNTAXES["mistral"]), "[TOOL_CALLS] [{") == ("[TOOL_CALLS] [{", [])


def test_text_that_is_no_call_stays_content():
    assert parse(ToolParser(SYNTAXES["llama3_json"]), '{"answer": 42}') == ('{"answer": 42}', [])
    assert parse(ToolParser(SYNTAXES["llama3_json"]), 'I think {"name": "f"}') == ('I think {"name": "f"}', [])
    assert parse(ToolParser(SYNTAXES["hermes"]), "<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [])


def test_reply_reader_finish_reason_and_parallel_calls():
    text = hermes("a", {"x": 1}) + hermes("b", {"y": 2})
    one = ReplyReader(None, ToolPlan("hermes", (), parallel=False))
    message = one.message(text)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a"] and message["content"] is None
    assert one.finish_reason("stop") == "tool_calls" and one.finish_reason("length") == "length"
    plain = ReplyReader(None, ToolPlan())
    assert plain.message(text) == {"role": "assistant", "content": text}


# ---- reasoning ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,text,expected", [
    ("qwen3", "<think>\nLet me think {about} it.\n</think>\n\nThe answer.", ("\nLet me think {about} it.\n",
                                                                              "The answer.")),
    ("qwen3", "No thinking here.", ("", "No thinking here.")),
    ("qwen3", "<think>cut short", ("cut short", "")),
    ("deepseek_r1", "reasoning first</think>answer", ("reasoning first", "answer")),
    ("deepseek_r1", "<think>r</think>\n\na", ("r", "a")),
    ("deepseek_r1", "never closed", ("never closed", "")),
])
def test_reasoning_split_whole_and_streamed(name, text, expected):
    assert split(name, text) == expected
    for k in range(len(text) + 1):
        parser = ReasoningParser(name)
        parts = [parser.feed(text[:k]), parser.feed(text[k:]), parser.finish()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == expected, k


def test_reasoning_then_tool_calls():
    reader = ReplyReader("qwen3", ToolPlan("hermes"))
    message = reader.message("<think>I should call f.</think>\n\n" + hermes("f", {"a": "b"}))
    assert message["reasoning_content"] == "I should call f."
    assert message["content"] is None and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": "b"}


# ---- which family a template asks for -----------------------------------------------------------------------------
@pytest.mark.parametrize("name,family", [("qwen2_5", "hermes"), ("qwen3", "hermes"), ("llama3_1", "llama3_json"),
                                         ("mistral_tools", "mistral"), ("smollm2", None), ("gemma", None)])
def test_detect_reads_the_family_from_what_the_template_renders(name, family):
    template = ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), {"bos_token": "<s>", "eos_token": "</s>"})
    assert detect(template) == family
    found = parser_for(template)
    assert (found.name if found else None) == family
    assert parser_for(template, "mistral").name == "mistral"  # --tool-parser wins
