"""The OpenAI-compatible API's requests and responses: the chat prompt (the checkpoint's chat template,
`data/chat.py`), the JSON error body (`APIError`), each endpoint's request schema checked field by field
(`validate`: unknown fields and wrong types are 400s), and the pieces of the response bodies (logprobs, usage).
Plain Python: nothing here imports fastapi or torch.
"""

import json
import math

CHAT_ROLES = ("system", "user", "assistant", "tool")
CHAT_STOP = "<|"  # the builtin template's end of turn (data.chat.BUILTIN_STOP): the model opened the next tag


def chat_prompt(messages: list[dict]) -> str:
    """The builtin chat template's prompt (`data.chat.BUILTIN_TEMPLATE`, the template of meshlm-trained
    models), written out: each message as `<|role|>` newline, content, newline, `<|end|>` newline, then
    `<|assistant|>` newline for the reply. The reply ends at the end-of-document token or when the model opens a
    tag (`<|`, its `<|end|>`)."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n<|end|>\n" for m in messages) + "<|assistant|>\n"


def chat_template_of(tokenizer):
    """The chat template (a `data.chat.ChatTemplate`) of the checkpoint a server loaded, found from its
    tokenizer's spec (`data.tokenizer`): the template its Hugging Face tokenizer files carry, else the builtin
    one (`data.chat.template_for`); a bad template is a DataError naming its file."""
    from meshlm.data.chat import BUILTIN_TEMPLATE, ChatTemplate, template_for

    spec = getattr(tokenizer, "spec", None)
    return template_for(spec) if isinstance(spec, str) and spec else ChatTemplate(BUILTIN_TEMPLATE)


def chat_text(template, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, tuple[str, ...]]:
    """(the prompt of `messages` with the generation prompt, the stop strings that end the reply) by the chat
    template `template`, with `tools` as its `tools` variable (transformers' `apply_chat_template(tools=...)`);
    a conversation the template refuses (its `raise_exception`) is a 400 naming `messages`."""
    from meshlm.data.chat import render, stop_strings
    from meshlm.data.items import DataError

    try:
        return render(template, messages, add_generation_prompt=True, tools=tools), stop_strings(template)
    except DataError as err:
        raise bad(str(err), "messages") from None


# ---- chat messages, tools and tool_choice ------------------------------------------------------------------------
MESSAGE_FIELDS = {"system": {"name"}, "user": {"name"}, "assistant": {"name", "tool_calls", "reasoning_content"},
                  "tool": {"tool_call_id", "name"}}
TOOL_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def content_text(content, where: str) -> str:
    """A message's `content` as text: a string, or a list of `{"type": "text", "text": ...}` parts joined by
    newlines (as vLLM joins them); any other part (an image) is a 400 naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise bad(f"{where} must be a string or a non-empty list of text parts", "messages")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise bad(f"{where}[{j}] is a {kind!r} part; this server takes text parts only "
                      "({\"type\": \"text\", \"text\": ...})" if kind else f"{where}[{j}] must be an object "
                      "{\"type\": \"text\", \"text\": ...}", "messages")
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise bad(f"{where}[{j}] must be {{\"type\": \"text\", \"text\": <string>}}", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def assistant_calls(calls, where: str) -> list[dict]:
    """An assistant message's `tool_calls` for the template: each `function.arguments` (the JSON text OpenAI
    sends) parsed into the object templates expect (transformers' convention)."""
    if not isinstance(calls, list) or not calls:
        raise bad(f"{where} must be a non-empty list of calls", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(call.get("id"), str) \
                or call.get("type", "function") != "function":
            raise bad(f"{where}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                      "\"arguments\"}}}", "messages")
        try:
            arguments = json.loads(fn.get("arguments"))
        except (TypeError, ValueError, RecursionError):
            raise bad(f"{where}[{j}].function.arguments must be JSON text (a string holding a JSON object), not "
                      f"{preview(fn.get('arguments'))}", "messages") from None
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def chat_messages(raw: list) -> list[dict]:
    """The request's `messages` checked and made ready for the template: a role of CHAT_ROLES, content as text
    (`content_text`), a tool message's `tool_call_id`, an assistant message's `tool_calls` (`assistant_calls`;
    its content may then be null). Every problem is a 400 naming `messages` and the message."""
    messages = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in CHAT_ROLES:
            raise bad(f"{where} must be an object with 'role' ({', '.join(CHAT_ROLES)}) and 'content'", "messages")
        extra = sorted(set(m) - {"role", "content"} - MESSAGE_FIELDS[role])
        if extra:
            raise bad(f"{where} has unknown field {extra[0]!r} (a {role} message takes content"
                      f"{''.join(', ' + k for k in sorted(MESSAGE_FIELDS[role]))})", "messages")
        out = {"role": role}
        if not isinstance(m.get("name", ""), str):
            raise bad(f"{where}.name must be a string", "messages")
        if "name" in m:
            out["name"] = m["name"]
        if role == "assistant" and m.get("tool_calls") is not None:
            out["tool_calls"] = assistant_calls(m["tool_calls"], f"{where}.tool_calls")
            # no content: "" (templates that know tool calls skip an empty one; the others need a string)
            out["content"] = content_text(m["content"], f"{where}.content") if m.get("content") is not None else ""
        else:
            out["content"] = content_text(m.get("content"), f"{where}.content")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise bad(f"{where} is a tool message without 'tool_call_id' (the id of the call it answers)",
                          "messages")
            out["tool_call_id"] = m["tool_call_id"]
        messages.append(out)
    if not messages:
        raise bad("messages is empty", "messages")
    return messages


def check_tools(tools) -> list[dict] | None:
    """The request's `tools` checked: a list of `{"type": "function", "function": {"name", "description",
    "parameters" (a JSON Schema object), "strict"}}`, names distinct; None when absent or empty."""
    if not tools:
        return None
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
            raise bad(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= 64 or set(name) - TOOL_NAME_CHARS:
            raise bad(f"{where}.function.name must be 1 to 64 letters, digits, '_', '-' or '.', not "
                      f"{preview(name)}", "tools")
        if name in names:
            raise bad(f"{where}.function.name {name!r} is given twice", "tools")
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise bad(f"{where}.function has unknown field {extra[0]!r}", "tools")
        if not isinstance(fn.get("description", ""), str) or not isinstance(fn.get("strict", False), bool | None):
            raise bad(f"{where}.function.description must be a string and strict true or false", "tools")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise bad(f"{where}.function.parameters must be a JSON Schema object, not {preview(fn['parameters'])}",
                      "tools")
        names.add(name)
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def check_tool_choice(choice, tools: list[dict] | None) -> str | dict:
    """The request's `tool_choice`: "none", "auto" (the default with tools; "none" without), "required", or
    the tool of `{"type": "function", "function": {"name"}}` (which must be one of `tools`)."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
                      f"{{\"name\": ...}}}}, not {preview(choice)}", "tool_choice")
        if choice == "required" and not tools:
            raise bad("tool_choice 'required' needs tools", "tool_choice")
        return choice
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad("tool_choice must name a function as {\"type\": \"function\", \"function\": {\"name\": ...}}",
                  "tool_choice")
    named = [t for t in tools or [] if t["function"]["name"] == fn["name"]]
    if not named:
        raise bad(f"tool_choice names the function {fn['name']!r}, which is not one of tools "
                  f"({', '.join(t['function']['name'] for t in tools or []) or 'none given'})", "tool_choice")
    return named[0]


# ---- errors --------------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered as OpenAI's JSON `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    """A 400 invalid_request_error about `param`."""
    return APIError(400, message, param=param)


# ---- request validation --------------------------------------------------------------------------------------
INT, NUM, STR, BOOL = "integer", "number", "string", "boolean"
MAX_BODY_BYTES = 4 * 2 ** 20  # `meshlm serve --max-body-bytes`' default: a larger request body is a 413


def is_kind(value, kind) -> bool:
    """Whether a JSON value is of a schema kind (INT, NUM, STR, BOOL, "null", "string_list", ...)."""
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == NUM:  # finite, as a float too (an integer of 400 digits is not a float)
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(as_float(value))
    if kind == STR:
        return isinstance(value, str)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == "null":
        return value is None
    if kind == "string_list":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "int_list":
        return isinstance(value, list) and all(is_kind(v, INT) for v in value)
    if kind == "int_lists":
        return isinstance(value, list) and all(is_kind(v, "int_list") for v in value)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "list":
        return isinstance(value, list)
    raise AssertionError(kind)


def as_float(value: float) -> float:
    """`value` as a float; inf for an integer too large for one."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def preview(value) -> str:
    """A short JSON rendering of a request value for an error message, safe for any nesting depth."""
    if isinstance(value, dict | list):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'} of {len(value)} items"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate(body, schema: dict[str, tuple]) -> dict:
    """`body` checked against {field: (kinds, default)}: unknown fields and wrong types are 400s."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - set(schema))
    if unknown:
        raise bad(f"unknown field {unknown[0]!r}; this endpoint takes {', '.join(sorted(schema))}", unknown[0])
    out = {}
    for name, (kinds, default) in schema.items():
        if name not in body:
            if default is REQUIRED:
                raise bad(f"field {name!r} is required", name)
            out[name] = default
            continue
        value = body[name]
        if not any(is_kind(value, k) for k in kinds):
            raise bad(f"field {name!r} must be {' or '.join(k.replace('_', ' of ') for k in kinds)}, "
                      f"not {preview(value)}", name)
        out[name] = value
    return out


REQUIRED = object()
PROMPT_KINDS = (STR, "string_list", "int_list", "int_lists")
SAMPLING_FIELDS = {
    "model": ((STR, "null"), None), "max_tokens": ((INT, "null"), None), "temperature": ((NUM, "null"), None),
    "top_p": ((NUM, "null"), None), "top_k": ((INT, "null"), None), "n": ((INT, "null"), None),
    "stream": ((BOOL, "null"), False), "stream_options": (("object", "null"), None),
    "stop": ((STR, "string_list", "null"), None), "seed": ((INT, "null"), None),
    "presence_penalty": ((NUM, "null"), None), "frequency_penalty": ((NUM, "null"), None),
    "repetition_penalty": ((NUM, "null"), None), "stop_token_ids": (("int_list", "null"), None),
    "ignore_eos": ((BOOL, "null"), None), "user": ((STR, "null"), None),
    "logit_bias": (("object", "null"), None), "response_format": (("object", "null"), None),
}
MAX_N = 128  # choices per prompt (`n`), as OpenAI allows
MAX_BEST_OF = 20  # candidates per prompt (`best_of`), as OpenAI allows
COMPLETION_SCHEMA = {**SAMPLING_FIELDS, "prompt": (PROMPT_KINDS, REQUIRED), "logprobs": ((INT, "null"), None),
                     "echo": ((BOOL, "null"), None), "best_of": ((INT, "null"), None)}
CHAT_SCHEMA = {**SAMPLING_FIELDS, "messages": (("list",), REQUIRED), "logprobs": ((BOOL, "null"), None),
               "top_logprobs": ((INT, "null"), None), "max_completion_tokens": ((INT, "null"), None),
               "tools": (("list", "null"), None), "tool_choice": ((STR, "object", "null"), None),
               "parallel_tool_calls": ((BOOL, "null"), None), "max_thinking_tokens": ((INT, "null"), None)}
EMBEDDING_SCHEMA = {"model": ((STR, "null"), None), "input": (PROMPT_KINDS, REQUIRED),
                    "encoding_format": ((STR, "null"), None), "dimensions": ((INT, "null"), None),
                    "user": ((STR, "null"), None)}
MEGATRON_SCHEMA = {
    "prompts": (("string_list",), REQUIRED), "tokens_to_generate": ((INT,), 64), "temperature": ((NUM,), 1.0),
    "top_k": ((INT,), 0), "top_p": ((NUM,), 0.0), "top_p_decay": ((NUM,), 0.0), "top_p_bound": ((NUM,), 0.0),
    "logprobs": ((BOOL,), False), "add_BOS": ((BOOL,), False), "stop_on_double_eol": ((BOOL,), False),
    "stop_on_eol": ((BOOL,), False), "prevent_newline_after_colon": ((BOOL,), False),
    "random_seed": ((INT, "null"), None), "no_log": ((BOOL,), False), "beam_width": ((INT, "null"), None),
    "length_penalty": ((NUM,), 1.0), "stop_token": ((INT, "null"), None),
}


def or_default(value, default):
    """`value`, or `default` when it is None (a JSON null or an absent field)."""
    return default if value is None else value


def choice_counts(f: dict) -> tuple[int, int]:
    """(n, best_of) of a validated request: n choices returned per prompt, the best of best_of candidates (the
    highest cumulative log-probability of their output); best_of needs best_of >= n and no streaming."""
    n = or_default(f.get("n"), 1)
    if not 1 <= n <= MAX_N:
        raise bad(f"n must be in 1..{MAX_N}, not {n}", "n")
    best_of = or_default(f.get("best_of"), n)
    if not n <= best_of <= MAX_BEST_OF:
        raise bad(f"best_of must be in n..{MAX_BEST_OF} (n={n}), not {best_of}", "best_of")
    if best_of > n and f.get("stream"):
        raise bad("best_of cannot be used with stream: the best candidates are known only at the end; drop best_of "
                  "or stream", "best_of")
    return n, best_of


def sampling_fields(f: dict, default_max: int | None, logprobs: int | None, echo: bool = False) -> dict:
    """The engine's `SamplingParams` fields (a dict: this module stays torch-free) of a validated request's
    sampling fields (`SAMPLING_FIELDS`, one choice: n and best_of are the route's), each checked (a 400 naming
    it). `default_max`: max_tokens when the request has none; `echo`: max_tokens 0 is allowed (scoring)."""
    stop = f.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not s for s in stop):
        raise bad("stop strings must not be empty", "stop")
    max_tokens = f.get("max_tokens")
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        raise bad(f"max_tokens must be >= 1, not {max_tokens}", "max_tokens")
    return {"max_tokens": or_default(max_tokens, default_max),
            "temperature": float(or_default(f.get("temperature"), 1.0)), "top_k": or_default(f.get("top_k"), 0),
            "top_p": float(or_default(f.get("top_p"), 1.0)), "seed": f.get("seed"), "stop": stop,
            "stop_token_ids": tuple(or_default(f.get("stop_token_ids"), ())), "ignore_eos": bool(f.get("ignore_eos")),
            "repetition_penalty": float(or_default(f.get("repetition_penalty"), 1.0)),
            "presence_penalty": float(or_default(f.get("presence_penalty"), 0.0)),
            "frequency_penalty": float(or_default(f.get("frequency_penalty"), 0.0)), "logprobs": logprobs,
            "echo": echo}


def logit_bias_of(value, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's `logit_bias` ({"token id": bias in [-100, 100]}) as {id: bias}; a bad key or value is a 400."""
    if not value:
        return None
    out = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or not 0 <= int(key) < vocab_size:
            raise bad(f"logit_bias keys must be token ids in 0..{vocab_size - 1} written as strings, not "
                      f"{preview(key)}", "logit_bias")
        if not is_kind(bias, NUM) or not -100 <= bias <= 100:
            raise bad(f"logit_bias[{key!r}] must be a number in [-100, 100], not {preview(bias)}", "logit_bias")
        out[int(key)] = float(bias)
    return out


# ---- the response bodies ---------------------------------------------------------------------------------------
def completion_logprobs(tokens, offset: int, decode) -> dict:
    """The legacy completions' logprobs object of `tokens` (TokenInfo), text offsets from `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        out["tokens"].append(t.text)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({decode([i]): lp for i, lp in t.top} if t.logprob is not None else None)
        out["text_offset"].append(offset)
        offset += len(t.text)
    return out


def chat_logprobs(tokens, decode) -> dict:
    return {"content": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode()),
                         "top_logprobs": [{"token": decode(i), "logprob": lp, "bytes": list(decode(i).encode())}
                                          for i, lp in t.top]} for t in tokens]}


def include_usage(f: dict) -> bool:
    """Whether a validated request asks for the usage chunk of a stream; `stream_options` without `stream:
    true` is a 400, as OpenAI answers it."""
    if f.get("stream_options") is not None and not f.get("stream"):
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    options = f.get("stream_options") or {}
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise bad(f"stream_options has unknown field {unknown[0]!r}", "stream_options")
    if any(not isinstance(v, bool | None) for v in options.values()):
        raise bad("stream_options' fields must be true or false", "stream_options")
    return bool(options.get("include_usage"))


def usage(reqs: list, per_prompt: int = 1) -> dict:
    """OpenAI's usage of requests made `per_prompt` at a time for each prompt (n or best_of choices): the prompt's
    tokens once per prompt (as OpenAI and vLLM count them), every candidate's output tokens."""
    p = sum(len(r.prompt_ids) for r in reqs[::per_prompt])
    c = sum(len(r.output_ids) for r in reqs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
