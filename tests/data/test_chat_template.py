"""meshlm.data.chat renders, masks and tokenizes conversations exactly as transformers' apply_chat_template.

The real templates (tests/data/chat_templates/, their origins in its README.md) run on tiny tokenizers built here:
a byte-level BPE trained on a few lines, with each model's special tokens added, wrapped in transformers'
PreTrainedTokenizerFast (no hub).
"""

import json
from pathlib import Path

import pytest

from meshlm.data.chat import (
    BUILTIN_TEMPLATE,
    ChatTemplate,
    encode_chat,
    render,
    render_with_spans,
    stop_strings,
    template_for,
    token_offsets,
)
from meshlm.data.items import DataError
from meshlm.data.tokenizers import GPT2_EOD, HFTokenizer, get_tokenizer, train_bpe

TEMPLATES = Path(__file__).parent / "chat_templates"
# Each template's special tokens, as its model's tokenizer_config.json names them.
SPECIALS = {
    # meta-llama/Llama-3.1-8B-Instruct
    "llama3_1": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "llama3_training": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    # Qwen/Qwen2.5-0.5B-Instruct, Qwen/Qwen3-0.6B
    "qwen2_5": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen2_5_training": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                "pad_token": "<|im_end|>"},
    # google/gemma-2-2b-it
    "gemma": {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"},
}
# The text each template writes after an assistant message: where a served reply stops.
END_OF_TURN = {"llama3_1": "<|eot_id|>", "qwen2_5": "<|im_end|>", "qwen3": "<|im_end|>", "smollm2": "<|im_end|>",
               "gemma": "<end_of_turn>"}
ADDED = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
         "<|python_tag|>", "<|im_start|>", "<|im_end|>", "<bos>", "<eos>", "<unk>", "<pad>", "<start_of_turn>",
         "<end_of_turn>"]

SYSTEM = {"role": "system", "content": "You are terse & <careful>."}
U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "Paris.\nIt is on the Seine."}
U2 = {"role": "user", "content": "  And of Italy?  "}
A2 = {"role": "assistant", "content": "Rome"}
CONVERSATIONS = [[U1], [SYSTEM, U1], [U1, A1], [U1, A1, U2], [SYSTEM, U1, A1, U2, A2], [U1, A1, U2, A2]]


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> Path:
    """A tiny byte-level BPE (a few hundred merges of the test conversations) with every template's specials."""
    from tokenizers import Tokenizer

    out = tmp_path_factory.mktemp("bpe")
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 3 + ["system user assistant model\n\n"] * 3
    path = train_bpe(texts, 320, out, min_frequency=1)
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens(ADDED)
    tok.save(str(path))
    return path


def tokenizer_dir(tmp_path: Path, bpe_file: Path, name: str) -> Path:
    """A Hugging Face tokenizer folder: the tiny BPE, and tokenizer_config.json with `name`'s template."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(bpe_file.read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIALS[name],
              "chat_template": (TEMPLATES / f"{name}.jinja").read_text()}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def hf_tokenizer(folder: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def usable(name: str, conversation: list[dict]) -> bool:
    return not (name == "gemma" and conversation[0]["role"] == "system")  # Gemma's template raises on it


@pytest.mark.parametrize("name", ["llama3_1", "qwen2_5", "qwen3", "smollm2", "gemma"])
def test_render_equals_transformers(tmp_path, bpe_file, name):
    folder = tokenizer_dir(tmp_path, bpe_file, name)
    hf = hf_tokenizer(folder)
    template = template_for(folder)
    assert template.text == (TEMPLATES / f"{name}.jinja").read_text()
    assert template.variables == SPECIALS[name]
    assert stop_strings(template)[0] == END_OF_TURN[name] and SPECIALS[name]["eos_token"] in stop_strings(template)
    for conversation in filter(lambda c: usable(name, c), CONVERSATIONS):
        for prompt in (False, True):
            expected = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
            assert render(template, conversation, add_generation_prompt=prompt) == expected, (conversation, prompt)
    # the ids too: the whole text tokenized once, the special tokens as their ids
    ours = HFTokenizer.from_file(folder / "tokenizer.json", str(folder))
    ids, _ = token_offsets(ours, render(template, [U1, A1, U2], add_generation_prompt=True))
    assert ids == list(hf.apply_chat_template([U1, A1, U2], tokenize=True, add_generation_prompt=True,
                                              return_dict=False))
    ids, mask = encode_chat(ours, template, [U1], add_generation_prompt=True)
    assert ids == list(hf.apply_chat_template([U1], tokenize=True, add_generation_prompt=True, return_dict=False))
    assert not any(mask)


def test_raise_exception_is_a_data_error(tmp_path, bpe_file):
    from jinja2.exceptions import TemplateError

    folder = tokenizer_dir(tmp_path, bpe_file, "gemma")
    with pytest.raises(TemplateError) as theirs:
        hf_tokenizer(folder).apply_chat_template([SYSTEM, U1], tokenize=False)
    with pytest.raises(DataError, match="cannot render this conversation") as ours:
        render(template_for(folder), [SYSTEM, U1])
    assert str(theirs.value) in str(ours.value)
    assert str(folder / "tokenizer_config.json") in str(ours.value)


def test_filters_and_namespace_as_transformers(tmp_path, bpe_file):
    folder = tokenizer_dir(tmp_path, bpe_file, "smollm2")
    hf = hf_tokenizer(folder)
    text = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
            "{{ m | tojson }}{{ m | tojson(indent=2) }}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}"
            "{{ ns.n }} {{ bos_token }}{{ eos_token }} {{ dict(a=1) | tojson }} {{ extra }}")
    conversation = [SYSTEM, {"role": "user", "content": "é \"q\"", "name": None}, U1]
    expected = hf.apply_chat_template(conversation, chat_template=text, tokenize=False, extra="X")
    assert render(ChatTemplate(text, SPECIALS["smollm2"]), conversation, extra="X") == expected
    assert "&lt;" not in expected and "None" not in expected  # HTML left alone, None-valued keys dropped


@pytest.mark.parametrize("name", ["qwen2_5_training", "llama3_training"])
def test_generation_masks_equal_transformers(tmp_path, bpe_file, name):
    folder = tokenizer_dir(tmp_path, bpe_file, name)
    hf = hf_tokenizer(folder)
    ours = HFTokenizer.from_file(folder / "tokenizer.json", str(folder))
    template = template_for(folder)
    for conversation in CONVERSATIONS:
        out = hf.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        ids, mask = encode_chat(ours, template, conversation)
        assert ids == list(out["input_ids"])
        assert [int(m) for m in mask] == list(out["assistant_masks"]), conversation
        turns = sum(m["role"] == "assistant" for m in conversation)
        _, spans = render_with_spans(template, conversation)
        assert len(spans) == turns  # every assistant turn, not only the last


def test_prefix_spans_hand_checked(tmp_path, bpe_file):
    """SmolLM2's ChatML template has no generation blocks: the spans come from prefix rendering."""
    template = template_for(tokenizer_dir(tmp_path, bpe_file, "smollm2"))
    text, spans = render_with_spans(template, [U1, A1, U2, A2])
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    expected = (system + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
                "Paris.\nIt is on the Seine.<|im_end|>\n<|im_start|>user\n  And of Italy?  <|im_end|>\n"
                "<|im_start|>assistant\nRome<|im_end|>\n")
    assert text == expected
    assert [text[a:b] for a, b in spans] == ["Paris.\nIt is on the Seine.<|im_end|>\n", "Rome<|im_end|>\n"]
    # and the tokens: those of each assistant turn, end of turn included, and nothing else
    ours = HFTokenizer.from_file(bpe_file, str(bpe_file))
    ids, mask = encode_chat(ours, template, [U1, A1, U2, A2])
    marked = ours.decode([i for i, m in zip(ids, mask) if m])
    assert marked == "Paris.\nIt is on the Seine.<|im_end|>\nRome<|im_end|>\n"


def test_builtin_template_is_the_served_format():
    from meshlm.infer.protocol import chat_prompt

    for conversation in CONVERSATIONS:
        assert render(BUILTIN_TEMPLATE, conversation, add_generation_prompt=True) == chat_prompt(conversation)
    text, spans = render_with_spans(BUILTIN_TEMPLATE, [SYSTEM, U1, A1, U2, A2])
    assert [text[a:b] for a, b in spans] == [A1["content"] + "\n<|end|>\n", "Rome\n<|end|>\n"]
    # the prefix method finds the same spans on the template without its generation blocks
    plain = BUILTIN_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert render_with_spans(plain, [SYSTEM, U1, A1, U2, A2]) == (text, spans)
    # GPT-2 (tiktoken) offsets: the marked tokens are the assistant turns
    gpt2 = get_tokenizer("gpt2")
    ids, mask = encode_chat(gpt2, BUILTIN_TEMPLATE, [SYSTEM, U1, A1, U2, A2])
    assert ids == gpt2.encode(text)
    assert gpt2.decode([i for i, m in zip(ids, mask) if m]) == A1["content"] + "\n<|end|>\n" + "Rome\n<|end|>\n"
    assert stop_strings(BUILTIN_TEMPLATE) == ("<|",)


def test_not_prefix_stable_is_a_clear_error():
    unstable = "{{ messages | length }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    with pytest.raises(DataError, match="not prefix-stable"):
        render_with_spans(unstable, [U1, A1, U2, A2])
    # Qwen3's template writes an empty <think></think> into the last assistant turn only: its turns move
    qwen3 = ChatTemplate((TEMPLATES / "qwen3.jinja").read_text(), source="qwen3.jinja")
    with pytest.raises(DataError, match="qwen3.jinja is not prefix-stable"):
        render_with_spans(qwen3, [U1, A1, U2, A2])


def test_template_for_a_converted_checkpoint(tmp_path, bpe_file):
    from meshlm.interop.hf_files import carry_files

    source = tokenizer_dir(tmp_path, bpe_file, "qwen2_5")
    (source / "chat_template.jinja").write_text((TEMPLATES / "smollm2.jinja").read_text())
    carried = carry_files(source, tmp_path / "ckpt" / "hf", None)  # what `meshlm convert --from-hf` copies
    assert "chat_template.jinja" in carried
    found = template_for(tmp_path / "ckpt" / "hf")
    assert found.text == (TEMPLATES / "smollm2.jinja").read_text()  # chat_template.jinja wins over the config's
    assert found.source == str(tmp_path / "ckpt" / "hf" / "chat_template.jinja")
    assert found.variables["eos_token"] == "<|im_end|>"
    assert stop_strings(found) == ("<|im_end|>",)
    # the tokenizer.json path works as the folder does; no template at all is the builtin one
    (tmp_path / "ckpt" / "hf" / "chat_template.jinja").unlink()
    assert template_for(tmp_path / "ckpt" / "hf" / "tokenizer.json").text == (TEMPLATES / "qwen2_5.jinja").read_text()
    assert template_for("gpt2").text == BUILTIN_TEMPLATE
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes(bpe_file.read_bytes())
    assert template_for(bare).text == BUILTIN_TEMPLATE
    assert template_for(bare, override=str(TEMPLATES / "gemma.jinja")).text == (TEMPLATES / "gemma.jinja").read_text()


def test_template_for_named_list_and_bad_templates(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": {"content": "</s>", "special": True},
                                  "chat_template": [{"name": "tool_use", "template": "T"},
                                                    {"name": "default", "template": "D{{ eos_token }}"}]}))
    found = template_for(folder)
    assert (found.text, found.variables) == ("D{{ eos_token }}", {"eos_token": "</s>"})
    assert render(found, [U1]) == "D</s>"
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(DataError, match="none named 'default'"):
        template_for(folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}")  # no endfor
    with pytest.raises(DataError) as err:
        template_for(folder)
    assert str(folder / "chat_template.jinja") in str(err.value) and "not a valid Jinja2 template" in str(err.value)
    assert "\n" not in str(err.value)


def test_eod_token_is_not_special_for_gpt2():
    """The bundled GPT-2 tokenizer encodes a template's text as ordinary text (the builtin needs no specials)."""
    ids, mask = encode_chat(get_tokenizer("gpt2"), ChatTemplate("{{ messages[0]['content'] }}" + GPT2_EOD),
                            [U1])
    assert get_tokenizer("gpt2").eod_id not in ids and not any(mask)


def test_export_writes_the_builtin_template(tmp_path, bpe_file):
    """`meshlm convert --to-hf` of a checkpoint without a template: transformers renders what meshlm serves."""
    from meshlm.infer.protocol import chat_prompt
    from meshlm.interop.hf_files import write_tokenizer_files

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes(bpe_file.read_bytes())
    (tmp_path / "out").mkdir()
    names = write_tokenizer_files(str(bare), tmp_path / "out", 64)
    assert "chat_template.jinja" in names
    hf = hf_tokenizer(tmp_path / "out")
    for conversation in CONVERSATIONS:
        assert hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == \
            chat_prompt(conversation)
    # a carried template is copied back as it is, not replaced
    carried = tokenizer_dir(tmp_path, bpe_file, "qwen2_5")
    (tmp_path / "out2").mkdir()
    assert "chat_template.jinja" not in write_tokenizer_files(str(carried), tmp_path / "out2", 64)
    assert hf_tokenizer(tmp_path / "out2").chat_template == (TEMPLATES / "qwen2_5.jinja").read_text()
