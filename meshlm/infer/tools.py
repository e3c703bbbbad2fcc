"""Tool calls in a model's reply: one incremental parser per template family, as OpenAI streams the calls.

The families (`SYNTAXES`), each the way its chat template tells the model to call a tool:
- `hermes` (Qwen2.5, Hermes, ChatML models): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
  number of them, anywhere in the reply (text before, between and after is content);
- `llama3_json` (Llama 3.1/3.2): `{"name": ..., "parameters": {...}}` at the start of the reply, or after
  `<|python_tag|>` anywhere; several calls separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}` (or one such object).

`parser_for(template, name)` is the parser of a server: `name` (`meshlm serve --tool-parser`) if given, else the
family whose instructions the template renders when given a tool (`detect`). A `ToolParser` is fed the reply's
text as it grows (`feed(delta) -> Delta`) and closed with `finish() -> Delta`; each `Delta` holds the content
to show and the tool-call deltas to send: the first delta of a call carries its index, id, type and
function.name with empty arguments, the following ones argument fragments (the raw text the model wrote, so the
fragments joined are exactly the whole reply's `arguments`). Only text that may begin a call (a prefix of a
tag, an unfinished call object) is held back. A call whose name never completed (cut by max_tokens, not
JSON) is given back as content at `finish`; one cut inside its arguments keeps the arguments written so far.
`parse(parser, text)` runs a whole reply through a fresh parser: a non-streamed reply is exactly its stream.

Plain Python: the Responses API and any other route reuse this module as it is.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class Syntax:
    """How a family writes calls: the tag that opens calls (`open`), the tag after each call (`close`),
    whether a bare JSON object at the reply's start is a call (`bare_start`), whether the calls after `open`
    form a JSON array (`array`), the separator between calls (`separator`), the key of the arguments, and
    the stop strings a reply with calls may end at (`stops`)."""

    name: str
    open: str
    close: str = ""
    bare_start: bool = False
    array: bool = False
    separator: str = ""
    arguments_key: str = "arguments"
    stops: tuple[str, ...] = ()  # where the model ends a turn of calls, besides the template's end of turn

    def prefix(self) -> str:
        """What guided decoding writes before a call's JSON object."""
        return {"hermes": "<tool_call>\n", "mistral": "[TOOL_CALLS] ["}.get(self.name, "")

    def suffix(self) -> str:
        """What guided decoding writes after a call's JSON object."""
        return {"hermes": "\n</tool_call>", "mistral": "]"}.get(self.name, "")


SYNTAXES = {
    "hermes": Syntax("hermes", "<tool_call>", close="</tool_call>"),
    "llama3_json": Syntax("llama3_json", "<|python_tag|>", bare_start=True, separator=";",
                          arguments_key="parameters", stops=("<|eom_id|>",)),  # Llama ends a call turn with eom
    "mistral": Syntax("mistral", "[TOOL_CALLS]", array=True),
}


@dataclass
class CallDelta:
    """One tool-call delta as OpenAI streams it: `name` (with `id`) on a call's first delta only."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        if self.name is not None:
            out.update(id=self.id, type="function")
        out["function"] = {"arguments": self.arguments, **({"name": self.name} if self.name is not None else {})}
        return out


@dataclass
class Delta:
    """What one `feed` or `finish` releases: content text and tool-call deltas (in the order written)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


def new_call_id() -> str:
    """An OpenAI-style call id: `call_` and 24 hex digits (alphanumeric after the underscore, long enough for
    templates that keep its last 9 characters, as Mistral's)."""
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- one call object, read as it arrives -------------------------------------------------------------------------
class CallReader:
    """Reads one JSON call object (`{"name": ..., "arguments": ...}`) character by character: the name once its
    string is complete, the arguments' raw text as it arrives. `failed`: the text is not a call object (its
    first character is not `{`, or its first key is not a call's); `done`: the object closed."""

    def __init__(self):
        self.depth = 0
        self.in_string = self.escape = False
        self.key: str | None = None  # the top-level key whose value is being read
        self.token = ""  # the top-level string (key or name) being read
        self.expect_key = True
        self.name: str | None = None
        self.arguments = ""  # raw text of the arguments value so far
        self.in_arguments = False
        self.failed = self.done = False
        self.started = False

    def push(self, c: str) -> None:
        if not self.started:
            if c.isspace():
                return
            self.started = True
            if c != "{":
                self.failed = True
                return
            self.depth = 1
            return
        if self.in_arguments:
            self._argument_char(c)
            return
        if self.in_string:
            self.token += c
            if self._string_ends(c):
                self._string_done(json_string(self.token))
            return
        if c == '"':
            self.in_string, self.token = True, '"'
        elif c == ":":
            self.expect_key = False
            if self.key in ARGUMENT_KEYS:
                self.in_arguments = True
        elif c == ",":
            self.expect_key, self.key = True, None
        elif c == "}":
            self.done = True  # (values of keys we do not read, numbers or literals, are skipped)

    def _string_done(self, value: str | None) -> None:
        if self.expect_key:
            self.key = value
            if self.name is None and not self.arguments and value not in ("name", *ARGUMENT_KEYS, "id", "type"):
                self.failed = True
        elif self.key == "name" and isinstance(value, str):
            self.name = value

    def _argument_char(self, c: str) -> None:
        """One character of the arguments value: kept (raw) until the value is complete."""
        if not self.arguments and c.isspace():
            return
        if self.in_string:
            self.arguments += c
            if self._string_ends(c) and self.depth == 1:  # a string value: complete
                self._end_arguments()
            return
        if self.depth == 1 and self.arguments and c in ",}":  # a number, true, ... ended by what follows it
            self._end_arguments()
            self.push(c)
            return
        self.arguments += c
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1:
                self._end_arguments()

    def _string_ends(self, c: str) -> bool:
        """Inside a JSON string: track backslash escapes; True when `c` is its closing quote."""
        if self.escape:
            self.escape = False
        elif c == "\\":
            self.escape = True
        elif c == '"':
            self.in_string = False
            return True
        return False

    def _end_arguments(self) -> None:
        self.in_arguments, self.key = False, None
        self.arguments = self.arguments.rstrip()


def json_string(token: str) -> str | None:
    try:
        value = json.loads(token)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


# ---- the parser --------------------------------------------------------------------------------------------------
class ToolParser:
    """The incremental parser of one reply in one family's `Syntax` (see the module docstring)."""

    def __init__(self, syntax: Syntax):
        self.syntax = syntax
        self.pending = ""  # text read but not yet released (a possible tag, an unfinished call)
        self.mode = "start" if syntax.bare_start else "text"
        self.reader: CallReader | None = None
        self.raw = ""  # the current call's text, given back as content if it turns out not to be a call
        self.calls: list[dict] = []  # every call begun: {"id", "type", "function": {"name", "arguments"}}
        self.sent_arguments = 0
        self.announced = False  # the current call's first delta (its name) is sent
        self.opened = ""  # the open tag just read
        self.in_array = False

    @property
    def name(self) -> str:
        return self.syntax.name

    def feed(self, text: str) -> Delta:
        """The content and call deltas released by `text`, the reply's next characters."""
        out = Delta()
        self.pending += text
        while self.pending:
            before = (self.mode, len(self.pending))
            step = getattr(self, f"_{self.mode}")
            step(out)
            if (self.mode, len(self.pending)) == before:
                break  # waiting for more text
        return out

    def finish(self) -> Delta:
        """Close the reply: what was held back (a tag prefix, a call that never got its name) as content."""
        out = Delta()
        if self.reader is not None and self.reader.name is None:
            out.content += self.raw
        out.content += self.pending
        self.pending, self.reader, self.raw = "", None, ""
        return out

    # ---- modes: each consumes from `pending` what it can ----
    def _start(self, out: Delta) -> None:
        """The reply's start (bare_start families): a call object if it opens with `{"name"`, else text."""
        stripped = self.pending.lstrip()
        if not stripped:
            return
        if stripped[0] == "{":
            self._begin_call()
            self.mode = "call"
        else:
            self.mode = "text"

    def _text(self, out: Delta) -> None:
        tag = self.syntax.open
        at = self.pending.find(tag)
        if at >= 0:
            out.content += self.pending[:at]
            self.pending, self.opened = self.pending[at + len(tag):], tag
            self.mode = "after_open"
            return
        hold = max((n for n in range(1, len(tag)) if self.pending.endswith(tag[:n])), default=0)
        out.content += self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]

    def _after_open(self, out: Delta) -> None:
        stripped = self.pending.lstrip()
        if not stripped:
            return
        gap = ""
        if self.syntax.array and stripped[0] == "[":
            gap = self.pending[:len(self.pending) - len(stripped)] + "["
            self.pending, self.in_array = stripped[1:], True
        self._begin_call(self.opened + gap)
        self.opened = ""
        self.mode = "call"

    def _begin_call(self, raw: str = "") -> None:
        """A new call object starts; `raw`: the text before it (the open tag), given back if it is no call."""
        self.reader, self.raw, self.sent_arguments, self.announced = CallReader(), raw, 0, False

    def _call(self, out: Delta) -> None:
        r = self.reader
        while self.pending and not (r.done or r.failed):
            c, self.pending = self.pending[0], self.pending[1:]
            self.raw += c
            r.push(c)
        if r.failed:  # not a call: its text is content, and the rest is read as text
            out.content += self.raw
            self.reader, self.raw, self.mode = None, "", "text"
            return
        self._release(out)
        if r.done:
            self.reader, self.raw = None, ""
            self.mode = "between"

    def _release(self, out: Delta) -> None:
        """The new deltas of the call being read: its first (name) once the name is known, then arguments."""
        r = self.reader
        if r.name is None:
            return
        if not self.announced:
            self.announced = True
            call = {"id": new_call_id(), "type": "function", "function": {"name": r.name, "arguments": ""}}
            self.calls.append(call)
            out.calls.append(CallDelta(len(self.calls) - 1, "", call["id"], r.name))
        new = r.arguments[self.sent_arguments:]
        if new:
            self.sent_arguments = len(r.arguments)
            self.calls[-1]["function"]["arguments"] += new
            index = len(self.calls) - 1
            if out.calls and out.calls[-1].index == index and out.calls[-1].name is None:
                out.calls[-1].arguments += new
            else:
                out.calls.append(CallDelta(index, new))

    def _between(self, out: Delta) -> None:
        """After a call object: the close tag, the separator or the next array item, else back to text."""
        stripped = self.pending.lstrip()
        if not stripped:
            return
        s = self.syntax
        for token, then in ((s.close, "gap"), (s.separator, "after_open"), ("," if self.in_array else "", "call"),
                            ("]" if self.in_array else "", "text")):
            if not token:
                continue
            if stripped.startswith(token):
                self.pending = stripped[len(token):]
                self.in_array = self.in_array and token == ","
                if then == "call":
                    self._begin_call()
                self.mode = then
                return
            if token.startswith(stripped):
                return  # may be the token: wait
        self.pending, self.mode, self.in_array = stripped, "text", False

    def _gap(self, out: Delta) -> None:
        """After a call's close tag: whitespace is dropped, then text."""
        self.pending = self.pending.lstrip()
        if self.pending:
            self.mode = "text"

    def tool_calls(self) -> list[dict]:
        """The calls found so far, as a message's `tool_calls`."""
        return [{**c, "function": dict(c["function"])} for c in self.calls]


def parse(parser: ToolParser, text: str) -> tuple[str, list[dict]]:
    """(content, tool_calls) of a whole reply, read by `parser` (fresh) exactly as its stream would be."""
    content = parser.feed(text).content + parser.finish().content
    return content, parser.tool_calls()


# ---- choosing a family -------------------------------------------------------------------------------------------
PROBE_TOOL = {"type": "function", "function": {"name": "meshlm_probe", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}


def detect(template) -> str | None:
    """The family a chat template (`data.chat.ChatTemplate`) asks for, read from what it renders for a
    conversation with one tool: None when it renders no tools (or in no family we know)."""
    from meshlm.data.chat import render
    from meshlm.data.items import DataError

    try:
        text = render(template, [{"role": "user", "content": "hi"}], add_generation_prompt=True, tools=[PROBE_TOOL])
    except DataError:
        return None
    if "meshlm_probe" not in text:
        return None
    if "<tool_call>" in text:
        return "hermes"
    if "[AVAILABLE_TOOLS]" in text or "[TOOL_CALLS]" in text:
        return "mistral"
    if '"parameters"' in text and ("<|start_header_id|>" in text or "<|python_tag|>" in text):
        return "llama3_json"
    return None


def parser_for(template, name: str | None = None) -> ToolParser | None:
    """A fresh parser of `name` (a key of SYNTAXES) or, without one, of the family `detect` finds in
    `template`; None when neither names a family. KeyError for an unknown `name` (the CLI checks it first)."""
    family = name or detect(template)
    return ToolParser(SYNTAXES[family]) if family else None
