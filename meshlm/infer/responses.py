"""POST /v1/responses: OpenAI's Responses API, its stateless core, on the same engine as chat
(docs/serving.md, "Responses API").

`input` is a string (one user message) or a list of message items (`role` user, system, developer or
assistant; `content` a string or a list of `input_text` / `output_text` parts); `instructions` comes first as
a system message; the conversation is rendered by the checkpoint's chat template, exactly as
/v1/chat/completions renders it (a developer message is a system message there). `max_output_tokens`,
`temperature`, `top_p` and `text.format` (a JSON schema, guided as chat's `response_format`) shape the
reply. Nothing is stored: `store` is answered false, and `previous_response_id` is a 400 (send the whole
conversation in `input`).

Tools (`tools` of type function, `tool_choice`, `parallel_tool_calls`) go through chat's machinery
(`infer/replies.py`: the template's tools, the server's tool parser, guided decoding for "required" or a named
function): each call in the reply is a `function_call` output item (`call_id`, `name`, `arguments`), and a
tool loop sends them back in `input` with `function_call_output` items (`call_id`, `output`), which become the
template's assistant tool calls and tool messages. A thinking model's reasoning (`--reasoning-parser`) is a
`reasoning` item.

With `stream: true` the reply comes as the Responses event sequence: response.created,
response.in_progress, then per output item response.output_item.added, its content (for a message
response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done; for a call response.function_call_arguments.delta..., ...done; for reasoning
response.reasoning_text.delta..., ...done) and response.output_item.done, then response.completed
(response.incomplete when max_output_tokens cut it, response.failed on an engine error), each a server-sent
event `event: TYPE` with its JSON. A whole reply is built by the same code from the whole text, so the two
agree.
"""

import asyncio
import json
import time
import uuid

from meshlm.infer.protocol import BOOL, INT, NUM, REQUIRED, STR, APIError, bad, validate

RESPONSES_SCHEMA = {
    "model": ((STR, "null"), None), "input": ((STR, "list"), REQUIRED), "instructions": ((STR, "null"), None),
    "max_output_tokens": ((INT, "null"), None), "temperature": ((NUM, "null"), None), "top_p": ((NUM, "null"), None),
    "text": (("object", "null"), None), "stream": ((BOOL, "null"), False), "store": ((BOOL, "null"), None),
    "previous_response_id": ((STR, "null"), None), "tools": (("list", "null"), None),
    "tool_choice": ((STR, "object", "null"), None), "parallel_tool_calls": ((BOOL, "null"), None),
    "metadata": (("object", "null"), None), "user": ((STR, "null"), None), "truncation": ((STR, "null"), None),
    "reasoning": (("object", "null"), None), "include": (("list", "null"), None),
}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
ITEM_FIELDS = {"message": {"type", "role", "content", "id", "status"},
               "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
               "function_call_output": {"type", "call_id", "output", "id", "status"},
               "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"}}


def add_responses_route(app, server) -> None:
    """Register POST /v1/responses on `app`."""
    from fastapi import Request as HTTPRequest

    from meshlm.infer.routes import body_of

    @app.post("/v1/responses")
    async def responses_route(request: HTTPRequest):
        return await responses(server, await body_of(request, server.max_body_bytes), request)


# ---- the request ---------------------------------------------------------------------------------------------
def input_messages(f: dict) -> list[dict]:
    """The chat messages of a validated request: `instructions` (a system message), then `input`'s items
    (messages; function calls joined to the assistant turn before them; call outputs as tool messages), checked
    as chat checks its messages (`protocol.chat_messages`)."""
    from meshlm.infer.protocol import chat_messages

    messages = [{"role": "system", "content": f["instructions"]}] if f["instructions"] is not None else []
    items = [{"role": "user", "content": f["input"]}] if isinstance(f["input"], str) else f["input"]
    if not items:
        raise bad("input is empty", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = check_item(item, where)
        if kind == "message":
            messages.append(input_message(item, where))
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    try:
        return chat_messages(messages)
    except APIError as err:
        raise bad(f"input: {err.message}", "input") from None


def check_item(item, where: str) -> str:
    """The type of one `input` item, its fields checked (a reasoning item is taken and left out: the
    templates drop earlier turns' reasoning)."""
    if not isinstance(item, dict):
        raise bad(f"{where} must be an input item object (a message, function_call or function_call_output)",
                  "input")
    kind = item.get("type", "message")
    if kind not in ITEM_FIELDS:
        raise bad(f"{where}.type {kind!r} is not supported; input items are message, function_call, "
                  "function_call_output (and reasoning)", "input")
    extra = sorted(set(item) - ITEM_FIELDS[kind])
    if extra:
        raise bad(f"{where} has unknown field {extra[0]!r}", "input")
    needs = {"function_call": ("call_id", "name", "arguments"), "function_call_output": ("call_id", "output")}
    missing = [k for k in needs.get(kind, ()) if not isinstance(item.get(k), str) or not item[k] and k != "output"]
    if missing:
        raise bad(f"{where} is a {kind} item whose {missing[0]!r} must be a non-empty string", "input")
    return kind


def input_message(item: dict, where: str) -> dict:
    """One message item of `input` as a chat message (its text parts joined)."""
    if item.get("role") not in ROLES:
        raise bad(f"{where}.role must be one of {', '.join(ROLES)}, not {json.dumps(item.get('role'))[:40]}", "input")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": ROLES[item["role"]], "content": content}
    if not isinstance(content, list) or not content:
        raise bad(f"{where}.content must be a string or a non-empty list of input_text parts", "input")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise bad(f"{where}.content[{j}] must be a text part {{'type': 'input_text', 'text': ...}}"
                      + (f"; {kind!r} parts are not supported (text models)" if isinstance(kind, str) else ""),
                      "input")
        extra = sorted(set(part) - {"type", "text", "annotations", "logprobs"})
        if extra:
            raise bad(f"{where}.content[{j}] has unknown field {extra[0]!r}", "input")
        texts.append(part["text"])
    return {"role": ROLES[item["role"]], "content": "".join(texts)}


def chat_tools(f: dict):
    """(chat's `tools`, chat's `tool_choice`) of the request's Responses-shaped ones (`{"type": "function",
    "name", "description", "parameters", "strict"}`, a choice `{"type": "function", "name"}`), checked as
    chat checks them (`protocol.check_tools`, `check_tool_choice`)."""
    from meshlm.infer.protocol import check_tool_choice, check_tools

    tools = []
    for i, tool in enumerate(f["tools"] or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad(f"tools[{i}] must be a function tool {{'type': 'function', 'name', 'parameters', ...}}"
                      + (f"; {kind!r} tools are not supported" if isinstance(kind, str) else ""), "tools")
        extra = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
        if extra:
            raise bad(f"tools[{i}] has unknown field {extra[0]!r}", "tools")
        tools.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    tools = check_tools(tools)
    choice = f["tool_choice"]
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) - {"type", "name"}:
            raise bad("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                      "tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools, check_tool_choice(choice, tools)


def response_format_of(text) -> dict | None:
    """Chat's `response_format` of the request's `text` field (`text.format`: text, json_object, or
    json_schema with name, schema, strict, description); a bad one is a 400 naming `text`."""
    from meshlm.infer.guided import check_format
    from meshlm.infer.sampling import InvalidRequest

    if text is None:
        return None
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise bad(f"text has unknown field {extra[0]!r}; it takes format", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("text.format must be an object with type 'text', 'json_object' or 'json_schema'", "text")
    if fmt["type"] != "json_schema":
        out = dict(fmt)
    else:
        out = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    try:
        check_format(out)
    except InvalidRequest as err:
        raise bad(str(err).replace("response_format.json_schema", "text.format").replace("response_format",
                                                                                         "text.format"), "text") from None
    return out


def check_stateless(f: dict) -> None:
    """400s for what a stateless server cannot do, and for fields out of range."""
    if f["previous_response_id"] is not None:
        raise bad("previous_response_id is not supported: this server stores no responses (stateless); send the "
                  "whole conversation in input", "previous_response_id")
    if f["truncation"] not in (None, "disabled"):
        raise bad("truncation must be 'disabled' (a conversation longer than the context is a 400)", "truncation")
    if f["reasoning"]:
        raise bad("reasoning options are not supported by this server (a thinking model thinks by its template)",
                  "reasoning")
    if f["max_output_tokens"] is not None and f["max_output_tokens"] < 1:
        raise bad(f"max_output_tokens must be >= 1, not {f['max_output_tokens']}", "max_output_tokens")
    if f["metadata"] is not None and any(not isinstance(v, str) for v in f["metadata"].values()):
        raise bad("metadata values must be strings", "metadata")


# ---- the response body ---------------------------------------------------------------------------------------
class Reply:
    """One response's ids, the pieces of its body in the Responses API's shapes, and its stream's events."""

    def __init__(self, f: dict, model: str, tools: list[dict] | None):
        self.f, self.model, self.tools = f, model, tools
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0

    def body(self, status: str, output: list, req=None) -> dict:
        f = self.f
        usage = None
        if req is not None:
            p, c = len(req.prompt_ids), len(req.output_ids)
            usage = {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": c,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}
        choice = f["tool_choice"] or ("auto" if self.tools else "none")
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": {"code": "server_error", "message": req.error or "generation failed"}
                if status == "failed" else None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": f["instructions"], "max_output_tokens": f["max_output_tokens"], "model": self.model,
                "output": output, "parallel_tool_calls": f["parallel_tool_calls"] is not False,
                "previous_response_id": None, "reasoning": None, "store": False, "temperature": f["temperature"],
                "text": {"format": (f["text"] or {}).get("format") or {"type": "text"}}, "tool_choice": choice,
                "tools": [{"type": "function", **t["function"]} for t in self.tools or []], "top_p": f["top_p"],
                "truncation": "disabled", "usage": usage, "user": f["user"], "metadata": f["metadata"] or {}}

    def event(self, kind: str, **fields) -> str:
        """One server-sent event of the stream (numbered in order, as OpenAI numbers them)."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def status_of(req) -> str:
    """The Responses status of a finished request."""
    return {"stop": "completed", "length": "incomplete"}.get(req.finish_reason, "failed")


class Output:
    """The output items of one reply, built from its reader's delta fields (`replies.ReplyReader`: reasoning,
    content, tool-call deltas) as they come; `feed` returns the stream events of each, `close` those that end
    every open item. A whole reply is the same calls on its whole text (its events unused)."""

    def __init__(self, reply: Reply):
        self.reply, self.items = reply, []  # [{"kind", "item", "text"}] in output order
        self.open: dict[str, dict] = {}  # "reasoning" / "message" / call index → its entry

    def _add(self, key, kind: str, item: dict) -> tuple[dict, list[str]]:
        entry = {"kind": kind, "item": item, "text": "", "index": len(self.items)}
        self.items.append(entry)
        self.open[key] = entry
        events = [self.reply.event("response.output_item.added", output_index=entry["index"], item=item)]
        if kind == "message":
            events.append(self.reply.event("response.content_part.added", **self._where(entry), part=text_part("")))
        return entry, events

    def _where(self, entry: dict) -> dict:
        out = {"item_id": entry["item"]["id"], "output_index": entry["index"]}
        return out if entry["kind"] == "function_call" else {**out, "content_index": 0}

    def feed(self, fields: dict) -> list[str]:
        events = []
        for key, kind, delta in (("reasoning", "reasoning", fields.get("reasoning_content")),
                                 ("message", "message", fields.get("content"))):
            if not delta:
                continue
            entry = self.open.get(key)
            if entry is None:
                entry, added = self._add(key, kind, new_item(kind))
                events += added
            entry["text"] += delta
            name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            events.append(self.reply.event(name, **self._where(entry), delta=delta,
                                           **({"logprobs": []} if kind == "message" else {})))
        for call in fields.get("tool_calls", ()):
            entry = self.open.get(call["index"])
            if entry is None:
                item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                        "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
                entry, added = self._add(call["index"], "function_call", item)
                events += added
            if call["function"]["arguments"]:
                entry["text"] += call["function"]["arguments"]
                events.append(self.reply.event("response.function_call_arguments.delta", **self._where(entry),
                                               delta=call["function"]["arguments"]))
        return events

    def close(self) -> list[str]:
        events = []
        if not self.items:  # an empty reply is an empty message
            events += self._add("message", "message", new_item("message"))[1]
        for entry in self.items:
            where, text, r = self._where(entry), entry["text"], self.reply
            if entry["kind"] == "message":
                events += [r.event("response.output_text.done", **where, text=text, logprobs=[]),
                           r.event("response.content_part.done", **where, part=text_part(text))]
            elif entry["kind"] == "reasoning":
                events.append(r.event("response.reasoning_text.done", **where, text=text))
            else:
                events.append(r.event("response.function_call_arguments.done", **where, arguments=text))
            events.append(r.event("response.output_item.done", output_index=entry["index"], item=finished(entry)))
        self.open.clear()
        return events

    def output(self) -> list[dict]:
        return [finished(e) for e in self.items]


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def new_item(kind: str) -> dict:
    if kind == "message":
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress", "role": "assistant",
                "content": []}
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": [],
            "status": "in_progress"}


def finished(entry: dict) -> dict:
    """An output item done: its text in place, status completed."""
    item, text = dict(entry["item"]), entry["text"]
    item["status"] = "completed"
    if entry["kind"] == "message":
        item["content"] = [text_part(text)]
    elif entry["kind"] == "reasoning":
        item["content"] = [{"type": "reasoning_text", "text": text}]
    else:
        item["arguments"] = text
    return item


def final_body(reply: Reply, reader, req) -> dict:
    """The whole response of a finished request, its text read by `reader` (fresh)."""
    output = Output(reply)
    output.feed(reader.feed(req.text))
    output.feed(reader.finish())
    output.close()
    return reply.body(status_of(req), output.output(), req)


async def stream_events(server, reply: Reply, reader, req, wake: asyncio.Event):
    """The Responses event sequence of one streamed request (see the module docstring)."""
    from meshlm.infer.routes import cancel_unfinished

    output = Output(reply)
    try:
        yield reply.event("response.created", response=reply.body("in_progress", []))
        yield reply.event("response.in_progress", response=reply.body("in_progress", []))
        sent = 0
        while True:
            await wake.wait()
            wake.clear()
            finished_now, upto = req.finished, req.emitted
            if upto > sent:
                for event in output.feed(reader.feed(req.text[sent:upto])):
                    yield event
                sent = upto
            if finished_now:
                break
        status = status_of(req)
        if status != "failed":
            for event in output.feed(reader.finish()) + output.close():
                yield event
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        yield reply.event(kind, response=reply.body(status, output.output(), req))
    finally:
        cancel_unfinished(server, [req])


# ---- the route -------------------------------------------------------------------------------------------------
async def responses(server, request_body, http_request=None):
    """POST /v1/responses: the assistant's reply to `input` (see the module docstring)."""
    from fastapi.responses import StreamingResponse

    from meshlm.infer.protocol import chat_template_of, chat_text
    from meshlm.infer.replies import ReplyReader, ToolPlan
    from meshlm.infer.routes import chat_sampling, client_of, run, tool_family, waker

    f = validate(request_body, RESPONSES_SCHEMA)
    check_stateless(f)
    adapter = server.check_model(f["model"])
    server.need("engine")
    template = chat_template_of(server.tokenizer)
    messages, (tools, choice) = input_messages(f), chat_tools(f)
    try:
        plan = ToolPlan.of(tools, choice, tool_family(server, template), f["parallel_tool_calls"])
    except ValueError as err:
        raise bad(str(err), "tools") from None
    text, stops = chat_text(template, messages, tools)
    ids = await asyncio.to_thread(server.tokenizer.encode, text)
    room = server.max_len - len(ids) - len(server.engine.head(adapter))
    fields = {"max_tokens": f["max_output_tokens"], "temperature": f["temperature"], "top_p": f["top_p"],
              "logit_bias": None, "response_format": response_format_of(f["text"]), "stream": f["stream"],
              "logprobs": None, "top_logprobs": None, "max_thinking_tokens": None}
    try:
        sp, _ = await chat_sampling(server, fields, room, plan, stops)
    except APIError as err:
        if err.param == "response_format":
            raise bad(err.message.replace("response_format", "text.format"), "text") from None
        raise
    reply = Reply(f, f["model"] or server.model_name, tools)

    def reader():
        return ReplyReader(getattr(server, "reasoning_parser", None), plan)

    names = {"max_tokens": "max_output_tokens", "prompt": "input"}
    if f["stream"]:
        wake, wake_up = asyncio.Event(), waker(asyncio.get_running_loop())
        req = server.submit_all([ids], [sp], lambda _r: wake_up(wake), adapter, names,
                                client_of(http_request))[0]
        return StreamingResponse(stream_events(server, reply, reader(), req, wake), media_type="text/event-stream")
    return await run(server, lambda cb: server.submit_all([ids], [sp], cb, adapter, names, client_of(http_request)),
                     False, None, lambda reqs: final_body(reply, reader(), reqs[0]), None, http_request)
