"""Tools through the real chat templates: meshlm.data.chat renders `tools`, assistant `tool_calls` and `tool`
messages exactly as transformers' apply_chat_template(..., tools=...) does (Qwen2.5, Llama 3.1, and vLLM's
Mistral tool template: tests/data/chat_templates/README.md), with the messages the server builds from an
OpenAI request (meshlm.infer.protocol.chat_messages: arguments parsed from their JSON text)."""

import json
from pathlib import Path

import pytest

from meshlm.data.chat import render, template_for
from meshlm.infer.protocol import chat_messages

transformers = pytest.importorskip("transformers")
TEMPLATES = Path(__file__).parent / "chat_templates"
SPECIALS = {"qwen2_5": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
            "llama3_1": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
            "mistral_tools": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, today & tomorrow.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. \"Paris\""},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]
CALL = {"id": "call_0123456789abcdef", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
# as an OpenAI client sends them: arguments as JSON text, content of the call turn null
REQUEST = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": CALL["id"], "content": "{\"temp\": 21}"}]


def folder_of(tmp_path: Path, name: str) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / name
    folder.mkdir()
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **SPECIALS[name],
        "chat_template": (TEMPLATES / f"{name}.jinja").read_text()}))
    return folder


@pytest.mark.parametrize("name", ["qwen2_5", "llama3_1", "mistral_tools"])
def test_tools_render_as_transformers(tmp_path, name):
    folder = folder_of(tmp_path, name)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    template = template_for(folder)
    messages = chat_messages(REQUEST)
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    hf_messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    for upto in (2, 4):  # the call turn's prompt, then the answer turn's (after the tool result)
        expected = hf.apply_chat_template(hf_messages[:upto], tools=TOOLS, tokenize=False, add_generation_prompt=True)
        got = render(template, messages[:upto], add_generation_prompt=True, tools=TOOLS)
        assert got == expected, (name, upto)
        assert "get_weather" in got
    assert '"city": "Paris"' in render(template, messages, add_generation_prompt=True, tools=TOOLS)


def test_content_parts_render_as_the_joined_text(tmp_path):
    template = template_for(folder_of(tmp_path, "qwen2_5"))
    parts = chat_messages([{"role": "user", "content": [{"type": "text", "text": "Weather"},
                                                        {"type": "text", "text": "in Paris?"}]}])
    assert render(template, parts) == render(template, [{"role": "user", "content": "Weather\nin Paris?"}])
