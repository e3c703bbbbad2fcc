"""`meshlm chat`: an interactive conversation with a checkpoint in the terminal (as `ollama run` gives).

Each turn renders the whole conversation (an optional system message, the kept turns, the new user message)
with the checkpoint's own chat template (`data.chat.template_for`) and the generation prompt, tokenizes it as
`meshlm generate` tokenizes a prompt, and samples the reply through the serving engine in this process
(`infer/local.py`: its paged KV cache, with prefix caching, so each turn reuses the blocks of the conversation
so far), so a greedy reply is exactly what `meshlm generate --temperature 0` gives for the rendered text.
The reply is printed token by token (`ReplyStream`: bytes of a character split across tokens wait for the
rest; text that may begin a stop string waits until it cannot). It ends at any of the model's declared
end-of-sequence ids (the tokenizer's `stop_ids`), at the template's end-of-turn text (`data.chat.stop_strings`),
at --max-new-tokens, or at the end of the context.

History: when the next prompt would leave fewer than `min(max_new_tokens, context // 2)` tokens of the context
for the reply, the oldest turns (a user message and its reply) are dropped, said once on stderr. Ctrl-C while
a reply streams stops that reply (the part shown stays in the history); Ctrl-C at the prompt, EOF or `/exit`
quits; `/reset` forgets the conversation (the system message stays). Lines are read from stdin whether or not
it is a terminal (a pipe drives it in the tests).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TextIO

from meshlm.core.config import ConfigError

COMMANDS = {"/reset": "forget the conversation", "/exit": "quit (so do Ctrl-D and Ctrl-C at the prompt)"}


@dataclass(frozen=True)
class ChatSettings:
    """How replies are sampled and how much of the context the conversation may use."""

    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 512
    context: int = 2048  # tokens: the model's seq_len unless --context asks for less
    system: str | None = None


# ---- the checkpoint ------------------------------------------------------------------------------------------
def load_chat_model(checkpoint: str, device: str):
    """(model in eval mode, tokenizer, config) of a decoder checkpoint (a run, a step directory, a .gguf file),
    opened and loaded as `meshlm generate` does (the checkpoint door, `interop.checkpoints.open_checkpoint`)."""
    from meshlm.checkpoint.load import load_model
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec
    from meshlm.interop.checkpoints import open_checkpoint

    found = open_checkpoint(checkpoint)  # resolved and verified once
    cfg = found.config
    spec = get_spec(cfg.model.family)
    if not spec.decoder:
        raise ConfigError(f"{checkpoint} holds a model.family={cfg.model.family!r} model, which does not generate "
                          "text; chat with a GPT (decoder) checkpoint")
    return load_model(found, spec, device), get_tokenizer(cfg.data.tokenizer), cfg


def chat_template(tokenizer_spec: str, checkpoint: str, override: str | None):
    """The checkpoint's chat template (`data.chat.template_for`), or `override` (a file or the template text).
    A model imported from Hugging Face (its tokenizer folder holds config.json or tokenizer_config.json) that
    carries no template has none: meshlm's builtin one would be a format it never saw, so that is an error."""
    from meshlm.data.chat import BUILTIN, template_for
    from meshlm.interop.hf_files import carried_folder

    template = template_for(tokenizer_spec, override)
    folder = carried_folder(tokenizer_spec)
    imported = folder is not None and any((folder / n).is_file() for n in ("config.json", "tokenizer_config.json"))
    if override is None and template.source == BUILTIN and imported:
        raise ConfigError(f"{checkpoint} carries no chat template (its tokenizer files in {folder} have none); "
                          "pass --chat-template FILE, a Jinja2 chat template for this model")
    return template


# ---- streaming the reply's text ------------------------------------------------------------------------------
@dataclass
class ReplyStream:
    """A reply's text as its tokens arrive: `push(token)` returns the text that can be shown now.

    Tokens are decoded in a short window (the tokens since the last shown text, after the ones before them,
    whose text is subtracted), so a tokenizer that decodes words with separators or leading spaces shows them
    right, and a character whose bytes span tokens (U+FFFD at the end) waits for the rest. Text that may be the
    start of a stop string is held until it is not; a stop string ends the reply (`stopped`), cut before it."""

    decode: Callable[[list[int]], str]
    stops: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    text: str = ""  # the decoded reply so far (cut at a stop string once one is found)
    shown: int = 0  # characters of `text` already returned
    stopped: bool = False
    _prefix: int = 0  # ids[_prefix:_read] were decoded last time, as context for the next piece
    _read: int = 0

    def push(self, token: int) -> str:
        if self.stopped:  # the reply ended at a stop string: nothing after it is shown
            return ""
        self.ids.append(int(token))
        before = self.decode(self.ids[self._prefix:self._read])
        after = self.decode(self.ids[self._prefix:])
        if after.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its next token
            return ""
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        return self._visible()

    def finish(self, cut: bool = False) -> str:
        """The rest of the text: what was held back (a stop-string prefix, an incomplete character). `cut` (the
        reply was interrupted): an incomplete character's bytes so far are dropped, not shown as U+FFFD, so what
        was shown is a prefix of the reply it would have been (its next token may have completed the character)."""
        if cut:
            self.ids = self.ids[:self._read]
        if not self.stopped and self._read < len(self.ids):
            before = self.decode(self.ids[self._prefix:self._read])
            self.text += self.decode(self.ids[self._prefix:])[len(before):]
            self._read = len(self.ids)
        out, self.shown = self.text[self.shown:], len(self.text)
        return out

    def _visible(self) -> str:
        longest = max((len(s) for s in self.stops), default=0)
        start = max(0, self.shown - longest)
        hits = [at for at in (self.text.find(s, start) for s in self.stops) if at >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
            return self.finish()
        hold = max((n for s in self.stops for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
        safe = max(self.shown, len(self.text) - hold)
        out, self.shown = self.text[self.shown:safe], safe
        return out


# ---- the conversation ----------------------------------------------------------------------------------------
@dataclass
class Conversation:
    """The messages kept, and the prompt of the next reply fitted into the context."""

    encode: Callable[[list[dict]], list[int]]  # messages → the rendered prompt's ids (generation prompt added)
    settings: ChatSettings
    turns: list[tuple[str, str]] = field(default_factory=list)  # (user, assistant) pairs, oldest first
    dropped_said: bool = False

    def messages(self, turns: Iterable[tuple[str, str]], user: str | None = None) -> list[dict]:
        out = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        for question, answer in turns:
            out += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return out + ([{"role": "user", "content": user}] if user is not None else [])

    def prompt(self, user: str, note: Callable[[str], None]) -> list[int] | None:
        """The ids of the conversation with `user` next, the oldest turns dropped until the reply has room
        (`min(max_new_tokens, context // 2)` tokens); None (said) when `user` alone leaves it none."""
        s = self.settings
        budget = s.context - min(s.max_new_tokens, s.context // 2)
        kept = list(self.turns)
        ids = self.encode(self.messages(kept, user))
        while len(ids) > budget and kept:
            kept.pop(0)
            ids = self.encode(self.messages(kept, user))
        if len(ids) > budget:
            note(f"error: this message makes a prompt of {len(ids)} tokens, leaving the reply too little of the "
                 f"context of {s.context} tokens; shorten it (or /reset, or a shorter --system)")
            return None
        if len(kept) < len(self.turns):
            if not self.dropped_said:
                note(f"note: the conversation no longer fits the context of {s.context} tokens; its oldest turns "
                     "are dropped from now on")
                self.dropped_said = True
            self.turns = kept
        return ids

    def reset(self) -> None:
        self.turns = []


# ---- the loop ------------------------------------------------------------------------------------------------
class Decoder:
    """The model and its in-process engine of one sequence of `context` positions (`infer/local.py`), built on
    first use and again after a Ctrl-C (an interrupted step leaves it unfit)."""

    def __init__(self, model, tokenizer, context: int):
        self.model, self.tokenizer, self.context = model, tokenizer, context
        self.engine = None

    def stream(self, prompt: list[int], params) -> Iterable[int]:
        from meshlm.infer.local import local_engine, stream

        if self.engine is None:
            self.engine = local_engine(self.model, self.tokenizer, self.context, prefix_caching=True)
        return stream(self.engine, prompt, params)


def reply(decoder: Decoder, prompt: list[int], settings: ChatSettings, stream_out: ReplyStream,
          write: Callable[[str], None], stop_ids: Iterable[int], seed: int | None) -> bool:
    """Sample and write one reply to `prompt`, ending at any of `stop_ids`; True when Ctrl-C stopped it (what
    was written stays)."""
    from meshlm.infer.sampling import SamplingParams

    room = min(settings.max_new_tokens, settings.context - len(prompt))
    stops = set(stop_ids)
    params = SamplingParams(max_tokens=room, temperature=settings.temperature, top_k=settings.top_k,
                            top_p=settings.top_p, seed=seed)  # the engine stops at the tokenizer's stop ids
    try:
        for token in decoder.stream(prompt, params) if room > 0 else ():
            if token in stops:
                break
            write(stream_out.push(token))
            if stream_out.stopped:
                break
    except KeyboardInterrupt:
        decoder.engine = None
        write(stream_out.finish(cut=True))
        return True
    write(stream_out.finish())
    return False


@dataclass
class Terminal:
    """Where the chat reads and writes: lines from `stdin` (a `>>> ` prompt on a terminal), the reply on
    `stdout`, notes on `stderr`."""

    stdin: TextIO = sys.stdin
    stdout: TextIO = sys.stdout
    stderr: TextIO = sys.stderr

    @property
    def interactive(self) -> bool:
        return self.stdin.isatty()

    def read(self) -> str | None:
        """The next line without its newline; None at EOF."""
        if self.interactive:
            try:
                return input(">>> ")
            except EOFError:
                return None
        line = self.stdin.readline()
        return None if line == "" else line.rstrip("\r\n")

    def write(self, text: str) -> None:
        if text:
            self.stdout.write(text)
            self.stdout.flush()

    def note(self, text: str) -> None:
        print(text, file=self.stderr, flush=True)


def run_chat(model, tokenizer, template, settings: ChatSettings, term: Terminal) -> int:
    """The read-reply loop (see the module docstring); returns the exit code, 0."""
    from meshlm.data.chat import render, stop_strings
    from meshlm.data.items import DataError

    def encode(messages: list[dict]) -> list[int]:
        return tokenizer.encode(render(template, messages, add_generation_prompt=True))

    conversation = Conversation(encode, settings)
    decoder = Decoder(model, tokenizer, settings.context)
    stops, turn = stop_strings(template), 0
    if term.interactive:
        term.note(f"context {settings.context} tokens; " + "; ".join(f"{k}: {v}" for k, v in COMMANDS.items()))
    while True:
        try:
            line = term.read()
        except KeyboardInterrupt:
            term.write("\n")
            return 0
        if line is None or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            conversation.reset()
            if term.interactive:
                term.note("(conversation cleared)")
            continue
        if not line.strip():
            continue
        try:
            prompt = conversation.prompt(line, term.note)
        except DataError as err:  # the template refuses this conversation (its raise_exception)
            term.note(f"error: {err}")
            continue
        if prompt is None:
            continue
        out = ReplyStream(tokenizer.decode, stops)
        seed = None if settings.seed is None else settings.seed + turn  # a seeded session replays exactly
        interrupted = reply(decoder, prompt, settings, out, term.write, tokenizer.stop_ids, seed)
        term.write("\n")
        if interrupted:
            term.note("(reply stopped)")
        conversation.turns.append((line, out.text))
        turn += 1


def start(checkpoint: str, settings: ChatSettings, template_override: str | None, term: Terminal | None = None,
          context: int | None = None) -> int:
    """Load `checkpoint` once and chat with it (`run_chat`); ConfigError for a bad checkpoint or template."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, cfg = load_chat_model(checkpoint, device)
    template = chat_template(cfg.data.tokenizer, checkpoint, template_override)
    seq_len = cfg.model.seq_len
    if context is not None and not 1 < context <= seq_len:
        raise ConfigError(f"--context {context} must be from 2 to the model's context, model.seq_len={seq_len}")
    settings = ChatSettings(**{**settings.__dict__, "context": context or seq_len})
    if term is None:
        term = Terminal()
        if term.interactive:
            try:
                import readline  # noqa: F401 -- line editing and history for input()
            except ImportError:
                pass
    return run_chat(model, tokenizer, template, settings, term)

