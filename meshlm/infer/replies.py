"""A chat reply read as the API returns it: `reasoning_content`, `content` and `tool_calls`, whole or as deltas.

`ReplyReader` chains the reasoning parser (`infer/reasoning.py`, when the server has one) and the tool parser
(`infer/tools.py`, when the request has tools and may call them) over one reply's text: `feed(text)` gives
the delta fields a stream sends now, `finish()` the rest, `message(text)` the whole reply's message. A
non-streamed reply goes through the same code as a streamed one, so the two agree.

`ToolPlan.of(...)` turns a request's validated `tools` and `tool_choice` into what the reply needs: the parser
family, and for "required" or a named function the guided-decoding `Format` that forces the call
(`infer/guided.compile_tool_call`, in the family's syntax). Plain Python; the Responses API can reuse both.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.infer.reasoning import ReasoningParser
from meshlm.infer.tools import SYNTAXES, ToolParser

NO_PARSER = (f"this model's chat template does not say how to call tools in a format meshlm reads; serve it with "
             f"--tool-parser {'|'.join(SYNTAXES)}, or send tool_choice 'none'")


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools as the reply needs them: `family` (None: the reply is not parsed for calls), `forced`
    (the tools one of which must be called: "required" or a named function), `parallel` (several calls kept)."""

    family: str | None = None
    forced: tuple = ()
    parallel: bool = True

    @staticmethod
    def of(tools: list[dict] | None, choice, family: str | None, parallel: bool | None) -> ToolPlan:
        """The plan of validated `tools` and `tool_choice` (`protocol.check_tools`, `check_tool_choice`) for a
        server whose tool parser family is `family`; ValueError (NO_PARSER) when calls are possible but no
        family is known."""
        if not tools or choice == "none":
            return ToolPlan()
        if family is None:
            raise ValueError(NO_PARSER)
        forced = tuple(tools) if choice == "required" else (choice,) if isinstance(choice, dict) else ()
        return ToolPlan(family, forced, parallel is not False)

    @property
    def stops(self) -> tuple[str, ...]:
        """The family's own end of a turn of calls (Llama's `<|eom_id|>`), as stop strings."""
        return SYNTAXES[self.family].stops if self.family else ()

    def guide(self, tokenizer, vocab_size: int):
        """The `Format` forcing one call of `forced` (None when nothing is forced)."""
        if not self.forced:
            return None
        from meshlm.infer.guided import compile_tool_call

        syntax = SYNTAXES[self.family]
        return compile_tool_call(tokenizer, vocab_size, list(self.forced), syntax.prefix(), syntax.suffix(),
                                 syntax.arguments_key)


class ReplyReader:
    """One reply's reader (see the module docstring): `reasoning` a reasoning parser name or None, `plan` the
    request's ToolPlan."""

    def __init__(self, reasoning: str | None, plan: ToolPlan):
        self.reasoner = ReasoningParser(reasoning) if reasoning else None
        self.tools = ToolParser(SYNTAXES[plan.family]) if plan.family else None
        self.parallel = plan.parallel

    @property
    def called(self) -> bool:
        return bool(self.tools is not None and self.tools.calls)

    def _fields(self, reasoning: str, text: str, last: bool) -> dict:
        out = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if self.tools is None:
            content = text
        else:
            d = self.tools.feed(text)
            if last:
                rest = self.tools.finish()
                d.content += rest.content
                d.calls += rest.calls
            content = d.content
            calls = [c.to_openai() for c in d.calls if self.parallel or c.index == 0]
            if calls:
                out["tool_calls"] = calls
        if content:
            out["content"] = content
        return out

    def feed(self, text: str) -> dict:
        """The delta fields of the reply's next characters (empty: nothing to send yet)."""
        reasoning, content = self.reasoner.feed(text) if self.reasoner else ("", text)
        return self._fields(reasoning, content, last=False)

    def finish(self) -> dict:
        """The delta fields of what was held back, at the reply's end."""
        reasoning, content = self.reasoner.finish() if self.reasoner else ("", "")
        return self._fields(reasoning, content, last=True)

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI's finish_reason: "tool_calls" for a reply that called a tool and ended by itself."""
        return "tool_calls" if self.called and engine_reason == "stop" else engine_reason

    def message(self, text: str) -> dict:
        """The whole reply's assistant message (this reader fresh): content (null when the reply is only calls),
        tool_calls and reasoning_content when there are any."""
        a, b = self.feed(text), self.finish()
        reasoning = a.get("reasoning_content", "") + b.get("reasoning_content", "")
        content = a.get("content", "") + b.get("content", "")
        out = {"role": "assistant", "content": content}
        if self.reasoner is not None:
            out["reasoning_content"] = reasoning or None
        if self.called:
            calls = self.tools.tool_calls()
            out["tool_calls"] = calls if self.parallel else calls[:1]
            out["content"] = content or None
        return out
