"""Guided decoding: OpenAI's `response_format` (`{"type": "json_object"}`, `{"type": "json_schema", ...}`)
and forced tool calls (`tool_choice` "required" or a named function: `compile_tool_call`, a tool parser's call
syntax around JSON arguments that match the tool's `parameters`) through xgrammar (the extra `meshlm[guided]`).

`compile_format(tokenizer, vocab_size, response_format)` checks the request's field and compiles its grammar
(cached per tokenizer and format: the first request of a format pays for it), before the request is submitted:
a bad schema is an `InvalidRequest` naming `response_format`, as is a missing xgrammar; the `Format` it returns
goes in `SamplingParams.guide`. Per request, `Format.start()` (in `sampling.begin`) is a `Guide`, a matcher over
that grammar: `mask(logits)` leaves only the tokens the grammar allows next (a token it
refuses gets -inf, whatever its logit or bias), `advance(token)` moves it past the chosen one. The end of
document token is the grammar's only way out, so a request ends ("stop") as soon as its JSON is complete.

The tokenizer's vocabulary is read as xgrammar needs it: the raw bytes of each token (GPT-2's tiktoken ranks
file), a Hugging Face tokenizer.json through transformers, else each token's decoded text.
"""

from __future__ import annotations

import json
import threading

from meshlm.infer.sampling import InvalidRequest

INSTALL = "pip install 'meshlm[guided]'"
FORMAT_TYPES = ("text", "json_object", "json_schema")
_compilers: dict[tuple[int, int], object] = {}  # (id of the tokenizer, vocab size) -> xgrammar.GrammarCompiler
_grammars: dict[tuple[int, int, str], object] = {}  # ... + the format's JSON -> CompiledGrammar
_lock = threading.Lock()


def require_xgrammar():
    """The xgrammar module, or an InvalidRequest naming `response_format` and the extra that installs it."""
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequest("response_format (and tool_choice 'required' or a named function) need guided "
                             f"decoding, whose package (xgrammar) is not installed on this server; {INSTALL}",
                             "response_format") from None
    return xgrammar


def check_format(response_format) -> dict | None:
    """The request's `response_format` checked: None for plain text, else {"type", "schema" (or None)}."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or response_format.get("type") not in FORMAT_TYPES:
        raise InvalidRequest("response_format must be an object with type 'text', 'json_object' or "
                             "'json_schema'", "response_format")
    kind = response_format["type"]
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra = sorted(set(response_format) - allowed)
    if extra:
        raise InvalidRequest(f"response_format has unknown field {extra[0]!r}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": kind, "schema": None}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise InvalidRequest("response_format.json_schema must be an object with a 'name' (and 'schema', "
                             "'strict', 'description')", "response_format")
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise InvalidRequest(f"response_format.json_schema has unknown field {extra[0]!r}", "response_format")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict) or not isinstance(spec.get("strict", False), bool | None):
        raise InvalidRequest("response_format.json_schema.schema must be a JSON Schema object and strict true or "
                             "false", "response_format")
    return {"type": kind, "schema": schema}


def token_vocabulary(xgr, tokenizer, vocab_size: int):
    """xgrammar's TokenizerInfo of a meshlm tokenizer (`data.tokenizers`) for a model of `vocab_size` logits."""
    stop = list(getattr(tokenizer, "stop_ids", None) or [tokenizer.eod_id])  # every declared end of sequence
    path = str(getattr(tokenizer, "vocab_file", "") or "")
    if getattr(tokenizer, "spec", None) == "gpt2" and path:  # tiktoken's ranks file: base64 bytes, rank
        import base64

        vocab: list[bytes] = [b""] * tokenizer.vocab_size
        with open(path, "rb") as fh:
            for line in fh:
                if line.strip():
                    token, rank = line.split()
                    vocab[int(rank)] = base64.b64decode(token)
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)
    if path.endswith(".json"):  # a Hugging Face tokenizer.json
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_file=path)
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop)
    vocab = [tokenizer.decode([i]).encode() for i in range(tokenizer.vocab_size)]  # whole characters only
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)


def compile_format(tokenizer, vocab_size: int, response_format):
    """The `Format` of a request's `response_format` (None for plain text), for `SamplingParams.guide`; slow the
    first time for a format (run it off the event loop). InvalidRequest naming `response_format` for a bad one."""
    fmt = check_format(response_format)
    if fmt is None:
        return None
    # json_object: any JSON object (OpenAI's JSON mode); compact JSON, no free whitespace to loop in
    schema = {"type": "object"} if fmt["schema"] is None else fmt["schema"]
    return compiled(tokenizer, vocab_size, json.dumps(fmt, sort_keys=True), "response_format",
                    lambda xgr: xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False),
                    Recipe("format", (response_format,)))


def call_schema(tools: list[dict], arguments_key: str) -> dict:
    """The JSON schema of one call of any of `tools` (OpenAI's `{"type": "function", "function": {...}}`):
    `{"name": <a tool's name>, <arguments_key>: <that tool's parameters>}`, name first."""
    options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 arguments_key: t["function"].get("parameters") or {"type": "object"}},
                "required": ["name", arguments_key], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def compile_tool_call(tokenizer, vocab_size: int, tools: list[dict], prefix: str, suffix: str,
                      arguments_key: str):
    """The `Format` that forces a reply to be one call of one of `tools` in a tool parser's syntax: `prefix`,
    the call's JSON object (`call_schema`: its arguments match the tool's `parameters`), `suffix`, then the end
    (`tool_choice` "required" or a named function). InvalidRequest naming `tools` when a tool's parameters are
    not a schema guided decoding can follow."""
    schema = call_schema(tools, arguments_key)
    key = json.dumps({"tool_call": schema, "prefix": prefix, "suffix": suffix}, sort_keys=True)

    def build(xgr):
        def literal(text):
            return [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")] if text else []

        pieces = [*literal(prefix), xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False),
                  *literal(suffix)]
        return xgr.Grammar.concat(*pieces) if len(pieces) > 1 else pieces[0]

    return compiled(tokenizer, vocab_size, key, "tools", build,
                    Recipe("tool_call", (tools, prefix, suffix, arguments_key)))


def compiled(tokenizer, vocab_size: int, key_text: str, param: str, build, recipe: Recipe):
    """The `Format` of the grammar `build(xgrammar)` (cached per tokenizer, vocab size and `key_text`);
    InvalidRequest naming `param` when xgrammar refuses it. `recipe`: how it was made (what it pickles as)."""
    xgr = require_xgrammar()
    key = (id(tokenizer), vocab_size)
    with _lock:
        if (*key, key_text) in _grammars:
            return _grammars[(*key, key_text)]
        if key not in _compilers:
            _compilers[key] = xgr.GrammarCompiler(token_vocabulary(xgr, tokenizer, vocab_size))
        compiler = _compilers[key]
        try:
            grammar = compiler.compile_grammar(build(xgr))
        except Exception as err:  # noqa: BLE001 -- xgrammar's errors (RuntimeError, ValueError, ...) are the schema's
            what = "response_format.json_schema.schema" if param == "response_format" else "a tool's parameters"
            raise InvalidRequest(f"{what} is not a JSON Schema guided decoding can follow "
                                 f"({str(err).splitlines()[0] if str(err) else type(err).__name__})", param) from None
        _grammars[(*key, key_text)] = Format(grammar, recipe)
        return _grammars[(*key, key_text)]


class Recipe:
    """How a `Format` was made (`compile_format`'s or `compile_tool_call`'s arguments after the tokenizer): what a
    Format pickles as, since xgrammar's compiled grammars do not pickle. An engine in another process
    (`infer/engine_process.py`) compiles it again with its own tokenizer (`compile`, cached there too)."""

    def __init__(self, kind: str, args: tuple):
        self.kind, self.args = kind, args

    def __reduce__(self):
        return Recipe, (self.kind, self.args)

    def compile(self, tokenizer, vocab_size: int) -> Format:
        make = compile_format if self.kind == "format" else compile_tool_call
        return make(tokenizer, vocab_size, *self.args)


class Format:
    """A compiled grammar, shared by the requests of its format; `start()` is one request's `Guide`. Pickled, it
    is its `Recipe`."""

    def __init__(self, grammar, recipe: Recipe):
        self.grammar, self.recipe = grammar, recipe

    def __reduce__(self):
        return Recipe, (self.recipe.kind, self.recipe.args)

    def start(self) -> Guide:
        return Guide(self.grammar)


class Guide:
    """One request's position in its grammar: the token mask before a draw, and the token drawn."""

    def __init__(self, grammar):
        import xgrammar as xgr

        self.xgr = xgr
        self.matcher = xgr.GrammarMatcher(grammar)
        self.bitmask = xgr.allocate_token_bitmask(1, grammar.tokenizer_info.vocab_size)

    def mask(self, logits):
        """(V,) logits with every token the grammar refuses next at -inf (a new tensor)."""
        logits = logits.clone()
        if self.matcher.is_terminated():  # complete: only the end of document remains (the engine stops at it)
            return logits
        self.matcher.fill_next_token_bitmask(self.bitmask)
        self.xgr.apply_token_bitmask_inplace(logits[None], self.bitmask.to(logits.device))
        return logits

    def advance(self, token: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)
