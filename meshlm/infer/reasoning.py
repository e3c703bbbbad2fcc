"""Reasoning in a thinking model's reply: `reasoning_content` split from `content`, and a thinking budget.

Parsers (`meshlm serve --reasoning-parser NAME`, `PARSERS`), both for `<think>...</think>`:
- `qwen3`: the reply thinks only when it opens with `<think>` (Qwen3's template leaves the choice to the model,
  or closes an empty block itself when `enable_thinking` is false); the text up to `</think>` is reasoning,
  the rest (its leading whitespace dropped) content; a reply that does not open with `<think>` is all content.
- `deepseek_r1`: the template has opened the block (DeepSeek-R1 prompts end with `<think>\\n`), so the reply
  starts inside it: reasoning until `</think>` (a leading `<think>` is dropped too), content after; a reply
  that never closes the block is all reasoning.

`ReasoningParser.feed(text) -> (reasoning, content)` is incremental, holding back only text that may begin a
tag; `finish()` releases the rest. Whole replies go through the same code (`split`).

The thinking budget (`max_thinking_tokens`): `ThinkingBudget`, a guide for `SamplingParams.guide` (the
engine's per-request logit control, `infer/sampling.py`), counts the tokens written inside the think block and,
once the budget is spent without a `</think>`, forces the tokens of `</think>` one by one (every other logit
-inf), so the model goes on to answer.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


class ReasoningParser:
    """Splits one reply into reasoning and content as it arrives (see the module docstring)."""

    def __init__(self, name: str):
        if name not in PARSERS:
            raise KeyError(name)
        self.name = name
        self.mode = "start"  # start -> (think -> after | content)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) released by the reply's next characters `text`."""
        self.pending += text
        reasoning = content = ""
        while self.pending:
            before = (self.mode, len(self.pending))
            r, c = getattr(self, f"_{self.mode}")()
            reasoning, content = reasoning + r, content + c
            if (self.mode, len(self.pending)) == before:
                break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning while the block is open (it never closed), else content."""
        rest, self.pending = self.pending, ""
        if self.mode == "start" and self.name == "qwen3":
            return "", rest
        return (rest, "") if self.mode in ("start", "think") else ("", rest)

    def _start(self) -> tuple[str, str]:
        stripped = self.pending.lstrip()
        if stripped.startswith(OPEN):
            self.pending, self.mode = stripped[len(OPEN):], "think"
        elif not OPEN.startswith(stripped):  # not a `<think>` (nor the start of one)
            self.mode = "think" if self.name == "deepseek_r1" else "content"
        return "", ""

    def _think(self) -> tuple[str, str]:
        at = self.pending.find(CLOSE)
        if at >= 0:
            out, self.pending, self.mode = self.pending[:at], self.pending[at + len(CLOSE):], "after"
            return out, ""
        hold = max((n for n in range(1, len(CLOSE)) if self.pending.endswith(CLOSE[:n])), default=0)
        out, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return out, ""

    def _after(self) -> tuple[str, str]:
        self.pending = self.pending.lstrip()
        if self.pending:
            self.mode = "content"
        return "", ""

    def _content(self) -> tuple[str, str]:
        out, self.pending = self.pending, ""
        return "", out


def split(name: str, text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole reply by the parser `name`."""
    parser = ReasoningParser(name)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return r1 + r2, c1 + c2


# ---- the thinking budget ------------------------------------------------------------------------------------------
class ThinkingBudget:
    """A guide (`SamplingParams.guide`) that closes the think block after `budget` tokens in it: `close_ids` (the
    tokens of `</think>`) are forced one at a time. `starts_open`: the reply starts inside the block
    (deepseek_r1); else the block begins when the reply opens with `<think>` (qwen3)."""

    def __init__(self, budget: int, close_ids: list[int], decode, starts_open: bool):
        self.budget, self.close_ids, self.decode, self.starts_open = budget, list(close_ids), decode, starts_open

    def start(self) -> _BudgetState:
        return _BudgetState(self)


class _BudgetState:
    """One request's place: the reply's text so far, the tokens spent thinking, the forced tokens left."""

    def __init__(self, budget: ThinkingBudget):
        self.b = budget
        self.text = ""
        self.thinking = budget.starts_open
        self.spent = 0
        self.forcing: list[int] = []
        self.closed = False

    def mask(self, logits):
        if self.closed or not self.thinking:
            return logits
        if not self.forcing and self.spent >= self.b.budget:
            self.forcing = list(self.b.close_ids)
        if not self.forcing:
            return logits
        forced = logits.new_full(logits.shape, float("-inf"))
        forced[self.forcing[0]] = 0.0
        return forced

    def advance(self, token: int) -> None:
        self.text += self.b.decode([token])
        if self.forcing and token == self.forcing[0]:
            self.forcing.pop(0)
        if self.closed:
            return
        if not self.thinking:
            stripped = self.text.lstrip()
            if stripped.startswith(OPEN):
                self.thinking = True  # the block opened: its tokens count from here
            elif not OPEN.startswith(stripped):
                self.closed = True  # the reply does not think
            return
        if CLOSE in self.text:
            self.closed, self.forcing = True, []
            return
        self.spent += 1
