"""Chat templates: a conversation (a list of `{"role", "content"}` messages) rendered to text and tokens, with
the characters and tokens the loss covers (the assistant's turns), exactly as `transformers` renders it.

A chat template is a Jinja2 template, as Hugging Face tokenizers carry it (`chat_template.jinja`, or
`chat_template` in `tokenizer_config.json`). `render` runs it with the semantics of transformers'
`apply_chat_template`: a sandboxed, immutable environment with `trim_blocks` and `lstrip_blocks`, the
`raise_exception(message)` and `strftime_now(format)` functions, a `tojson` filter that does not escape HTML,
the `{% generation %}...{% endgeneration %}` tag that marks what the assistant generates, and the variables
`messages`, `tools` (None), `documents` (None), `add_generation_prompt` and the tokenizer's special tokens
(`bos_token`, `eos_token`, ...) plus any the caller passes.

`template_for(tokenizer)` finds a checkpoint's template: a Hugging Face tokenizer folder's (what
`meshlm convert --from-hf` carries into the checkpoint's `hf/` folder), else `BUILTIN_TEMPLATE`, the template
of meshlm-trained models. It returns a `ChatTemplate` (the text, the special-token variables, where it came
from); every function here takes a `ChatTemplate` or a plain template string.

The loss spans (`render_with_spans`): every assistant turn. From the template's `{% generation %}` blocks when
it has them (as transformers' `return_assistant_tokens_mask`); else by prefix rendering: assistant turn i is
what rendering `messages[:i + 1]` adds to rendering `messages[:i]` with the generation prompt, its end-of-turn
text included (a template that does not render a conversation's prefixes as prefixes of it is an error).
`encode_chat` tokenizes the whole text once and marks the tokens overlapping a span.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from meshlm.data.items import DataError, read_json_object
from meshlm.data.tokenizers import SHAKESPEARE_BPE

# The template of meshlm-trained models: per message `<|role|>` newline, the content, newline, `<|end|>`
# newline; `<|assistant|>` newline prompts the reply. The assistant's generation is its content, newline, `<|end|>`
# and newline, so a model fine-tuned on it learns to close its turn; a server stops the reply at the
# end-of-document token or at `<|` (the model opens `<|end|>`).
BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '\\n<|end|>\\n' }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] + '\\n<|end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
BUILTIN_STOP = "<|"  # the builtin template's end of turn as a stop string: the model opens `<|end|>`
BUILTIN = "builtin"
# The special-token variables a tokenizer passes to its template (transformers' named special tokens).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's text, the variables it is rendered with (the tokenizer's special tokens) and where
    it came from (a file path, or "builtin")."""

    text: str
    variables: dict[str, str] = field(default_factory=dict)
    source: str = BUILTIN


# ---- the Jinja2 environment ------------------------------------------------------------------------------------
_tracking: ContextVar = ContextVar("meshlm_chat_generation", default=None)


def _generation_extension():
    import jinja2
    from jinja2.ext import Extension

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body; while spans are tracked, records the
        body's character span in the text rendered so far."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("track"), [], [], body).set_lineno(lineno)

        def track(self, caller):
            text = caller()
            state = _tracking.get()
            if state is not None:
                blocks, spans = state
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

    return Generation


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_):
    return datetime.now().strftime(format_)


class _SafeDict:
    """`dict(...)` in a template, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace_class():
    import jinja2

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace, refusing underscore-prefixed attribute names."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r}")

    return Namespace


@functools.lru_cache(maxsize=64)
def _compile(text: str):
    """The compiled template (jinja2.TemplateSyntaxError for a bad one)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_SafeDict(),
                       namespace=_namespace_class())
    return env.from_string(text)


def compile_template(template: ChatTemplate | str):
    """The compiled template; a bad one is a DataError naming where it came from."""
    import jinja2

    t = as_template(template)
    try:
        return _compile(t.text)
    except jinja2.TemplateError as err:
        where = f" (line {err.lineno})" if getattr(err, "lineno", None) else ""
        raise DataError(f"chat template {t.source}: not a valid Jinja2 template{where}: {err.message}; fix the "
                        "template or pass another") from None


def as_template(template: ChatTemplate | str) -> ChatTemplate:
    if isinstance(template, ChatTemplate):
        return template
    if isinstance(template, str):
        return ChatTemplate(template, {}, BUILTIN if template == BUILTIN_TEMPLATE else "the given template")
    raise TypeError(f"a chat template is a ChatTemplate or a string, not {type(template).__name__}")


# ---- rendering -------------------------------------------------------------------------------------------------
def _plain(value):
    """`value` rebuilt from plain JSON types (the template only sees those); None-valued message keys dropped."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _messages(messages: list[dict]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise DataError(f"chat messages[{i}] must be an object with 'role' and 'content', not "
                            f"{type(m).__name__}")
        out.append({k: _plain(v) for k, v in m.items() if v is not None})
    return out


def _context(template: ChatTemplate, messages: list[dict], add_generation_prompt: bool, variables: dict) -> dict:
    return {"tools": None, "documents": None, **_plain({**template.variables, **variables}),
            "messages": _messages(messages), "add_generation_prompt": bool(add_generation_prompt)}


def _generate(template: ChatTemplate, context: dict, track: bool) -> tuple[str, list[tuple[int, int]]]:
    import jinja2

    compiled = compile_template(template)
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    token = _tracking.set((blocks, spans) if track else None)
    try:
        for block in compiled.generate(**context):  # block by block: a generation span starts at the length so far
            blocks.append(block)  # noqa: PERF402
    except jinja2.TemplateError as err:
        raise DataError(f"chat template {template.source} cannot render this conversation: {err}") from None
    finally:
        _tracking.reset(token)
    return "".join(blocks), spans


def render(template: ChatTemplate | str, messages: list[dict], add_generation_prompt: bool = False,
           **variables) -> str:
    """The conversation as the template renders it (transformers' `apply_chat_template(tokenize=False)`);
    `variables` add to (and override) the template's special-token variables."""
    t = as_template(template)
    return _generate(t, _context(t, messages, add_generation_prompt, variables), track=False)[0]


def has_generation_blocks(template: ChatTemplate | str) -> bool:
    return GENERATION_TAG.search(as_template(template).text) is not None


def render_with_spans(template: ChatTemplate | str, messages: list[dict], add_generation_prompt: bool = False,
                      **variables) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans [start, end) the loss covers: every assistant turn (see the
    module docstring for how they are found). Empty spans are dropped."""
    t = as_template(template)
    text, spans = _generate(t, _context(t, messages, add_generation_prompt, variables), track=True)
    if not has_generation_blocks(t):
        spans = _prefix_spans(t, messages, text, variables)
    return text, [(a, b) for a, b in spans if b > a]


def _prefix_spans(t: ChatTemplate, messages: list[dict], text: str, variables: dict) -> list[tuple[int, int]]:
    spans = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") != "assistant":
            continue
        before = render(t, messages[:i], add_generation_prompt=True, **variables)
        through = render(t, messages[:i + 1], **variables)
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(f"chat template {t.source} is not prefix-stable: rendering the conversation up to "
                            f"message {i} (the assistant's) is not a prefix of rendering all of it, so the "
                            "assistant's turns cannot be found; add {% generation %}...{% endgeneration %} "
                            "around the assistant's content in the template")
        spans.append((len(before), len(through)))
    return spans


# ---- tokens ----------------------------------------------------------------------------------------------------
def token_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The ids of `text` (the tokenizer's `encode`, added special tokens mapped to their ids) and each token's
    character span [start, end) in it."""
    hf = getattr(tokenizer, "_tok", None)  # an HFTokenizer's `tokenizers.Tokenizer`: offsets come with the ids
    if hf is not None and hasattr(hf, "encode"):
        enc = hf.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]
    ids = tokenizer.encode(text)
    enc = getattr(tokenizer, "_enc", None)  # GPT2Tokenizer's tiktoken Encoding: each token's start
    if enc is not None and hasattr(enc, "decode_with_offsets"):
        decoded, starts = enc.decode_with_offsets(ids)
    else:  # any other tokenizer: the length of the decoded prefix after each token
        decoded = tokenizer.decode(ids)
        starts = [len(tokenizer.decode(ids[:k])) for k in range(len(ids))]
    if decoded != text:
        raise DataError(f"tokenizer {getattr(tokenizer, 'name', '?')!r} does not decode its tokens back to the "
                        "chat text, so the assistant's tokens cannot be told apart; use a tokenizer.json tokenizer")
    ends = [*starts[1:], len(text)]
    return list(ids), [(a, max(a, b)) for a, b in zip(starts, ends)]


def spans_to_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """True for each token whose characters overlap a span (spans and offsets in order)."""
    mask, k = [], 0
    for start, end in offsets:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        mask.append(k < len(spans) and end > spans[k][0])
    return mask


def encode_chat(tokenizer, template: ChatTemplate | str, messages: list[dict], add_generation_prompt: bool = False,
                **variables) -> tuple[list[int], list[bool]]:
    """The conversation's token ids (the whole rendered text tokenized once) and, per token, whether the loss
    covers it (it overlaps an assistant turn's span, as transformers' `return_assistant_tokens_mask`)."""
    text, spans = render_with_spans(template, messages, add_generation_prompt, **variables)
    ids, offsets = token_offsets(tokenizer, text)
    return ids, spans_to_mask(offsets, spans)


# ---- the checkpoint's template ---------------------------------------------------------------------------------
def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def special_token_variables(folder: Path) -> dict[str, str]:
    """bos_token, eos_token, ... from a tokenizer folder's tokenizer_config.json (then special_tokens_map.json)."""
    out: dict[str, str] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            data = read_json_object(folder / name)
            for key in SPECIAL_TOKEN_NAMES:
                text = _token_text(data.get(key))
                if text is not None and key not in out:
                    out[key] = text
    return out


def _config_template(path: Path) -> str | None:
    value = read_json_object(path).get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {d.get("name"): d.get("template") for d in value if isinstance(d, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise DataError(f"{path}: chat_template lists templates {sorted(map(str, named))} but none named "
                        "'default'; pass the template to use explicitly")
    raise DataError(f"{path}: chat_template must be a string or a list of {{name, template}}, not "
                    f"{type(value).__name__}")


def _tokenizer_folder(spec: str | Path) -> Path | None:
    if not str(spec) or str(spec) in ("gpt2", "bert") or str(spec).startswith(SHAKESPEARE_BPE):
        return None  # a bundled tokenizer: no folder, the builtin template
    path = Path(str(spec)).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        return path.parent
    return None  # a path that is not there


def _read_override(override: str) -> ChatTemplate:
    path = Path(override).expanduser()
    if "{" not in override and len(override) < 4096 and path.is_file():
        try:
            return ChatTemplate(path.read_text(encoding="utf-8"), {}, str(path))
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"chat template {path} cannot be read ({err})") from None
    if "{" not in override:
        raise DataError(f"chat template {override!r} is neither a file nor a Jinja2 template; pass a .jinja file "
                        "or the template's text")
    return ChatTemplate(override, {}, "the given template")


def template_for(tokenizer_spec_or_dir: str | Path, override: str | None = None) -> ChatTemplate:
    """The chat template of a checkpoint's tokenizer: `override` (a template file or text) if given, else its
    folder's `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or the
    `default` of a list of named templates), else BUILTIN_TEMPLATE; with the folder's special tokens as
    variables. The template is compiled here, so a bad one is a DataError naming its file."""
    folder = _tokenizer_folder(tokenizer_spec_or_dir)
    variables = special_token_variables(folder) if folder is not None else {}
    if override is not None:
        found = _read_override(override)
    elif folder is not None and (folder / "chat_template.jinja").is_file():
        path = folder / "chat_template.jinja"
        try:
            found = ChatTemplate(path.read_text(encoding="utf-8"), {}, str(path))
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"chat template {path} cannot be read ({err})") from None
    elif folder is not None and (folder / "tokenizer_config.json").is_file() and \
            (text := _config_template(folder / "tokenizer_config.json")) is not None:
        found = ChatTemplate(text, {}, f"{folder / 'tokenizer_config.json'} (chat_template)")
    else:
        found = ChatTemplate(BUILTIN_TEMPLATE, {}, BUILTIN)
    out = ChatTemplate(found.text, variables, found.source)
    compile_template(out)
    return out


# ---- serving ---------------------------------------------------------------------------------------------------
PROBE = "\x00meshlm-probe\x00"


def end_of_turn(template: ChatTemplate | str) -> str:
    """The text the template writes after an assistant's content (whitespace stripped), e.g. `<|im_end|>`;
    empty when it writes none or cannot render a probe conversation."""
    t = as_template(template)
    try:
        text = render(t, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PROBE}])
    except DataError:
        return ""
    at = text.rfind(PROBE)
    return text[at + len(PROBE):].strip() if at >= 0 else ""


def stop_strings(template: ChatTemplate | str) -> tuple[str, ...]:
    """Where a reply ends, as stop strings: the builtin template's `<|` (the model opens the next turn's tag),
    else the template's end-of-turn text and the tokenizer's eos_token."""
    t = as_template(template)
    if t.text == BUILTIN_TEMPLATE:
        return (BUILTIN_STOP,)
    out = [s for s in (end_of_turn(t), t.variables.get("eos_token")) if s]
    return tuple(dict.fromkeys(out))

