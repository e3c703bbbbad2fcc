"""The OpenAI-compatible API's requests and responses: the chat prompt (the checkpoint's chat template,
`data/chat.py`), the JSON error body (`APIError`), each endpoint's request schema checked field by field
(`validate`: unknown fields and wrong types are 400s), and the pieces of the response bodies (logprobs, usage).
Plain Python: nothing here imports fastapi or torch.
"""

import json
import math

CHAT_ROLES = ("system", "user", "assistant")
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


def chat_text(template, messages: list[dict]) -> tuple[str, tuple[str, ...]]:
    """(the prompt of `messages` with the generation prompt, the stop strings that end the reply) by the chat
    template `template`; a conversation the template refuses (its `raise_exception`) is a 400 naming `messages`."""
    from meshlm.data.chat import render, stop_strings
    from meshlm.data.items import DataError

    try:
        return render(template, messages, add_generation_prompt=True), stop_strings(template)
    except DataError as err:
        raise bad(str(err), "messages") from None


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
               "top_logprobs": ((INT, "null"), None), "max_completion_tokens": ((INT, "null"), None)}
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
