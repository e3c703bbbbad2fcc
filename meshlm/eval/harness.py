"""meshlm checkpoints as a model of EleutherAI's lm-evaluation-harness (`lm_eval`), registered as `meshlm`.

    meshlm harness --model meshlm --model_args checkpoint=DIR[,batch_size=N,device=cpu] --tasks ... [lm_eval flags]
    meshlm harness ... --apply_chat_template [TEMPLATE] [--fewshot_as_multiturn]   (prompts as chats)

`meshlm harness` runs the harness's own command line in this process after importing this module (which
registers the model), so every `lm_eval` flag works. With `--apply_chat_template` each prompt is a chat rendered
by the checkpoint's chat template (`data/chat.py`: the template its Hugging Face tokenizer files carry, else
meshlm's builtin one; a template file or text given after the flag replaces it), as the `hf` backend does. This module imports `lm_eval`; nothing else in
meshlm does (`import meshlm` never loads it). Install it with `pip install 'meshlm[eval]'`.

The three request types reduce to the batched `Scorer` (`scorer.py`):

* `loglikelihood(context, continuation)`: Σ log p(continuation tokens | context) and whether each of them
  is the greedy choice. The continuation's tokens are those of encoding context + continuation after the
  context's tokens (whitespace ending the context moves to the continuation); an empty context is the
  end-of-document token; context + continuation is cut from the left to seq_len + 1 tokens.
* `loglikelihood_rolling(text)`: Σ log p over every token of the text, the end-of-document token before
  the first, in non-overlapping windows of seq_len predictions where the last window keeps a full context
  (the harness's rolling windows).
* `generate_until(context, {until, max_gen_toks})`: greedy decoding, all requests of a batch advancing one
  token per forward pass, stopping at a stop string (cut there), the end-of-document token, max_gen_toks
  (default 256) or the model's context (learned positions); the context keeps its last
  seq_len − max_gen_toks tokens when that is positive.
"""

from __future__ import annotations

import sys

from meshlm.core.config import ConfigError

INSTALL = "pip install 'meshlm[eval]'"


def require_lm_eval():
    try:
        import lm_eval  # noqa: F401
        from lm_eval.api.model import LM
        from lm_eval.api.registry import register_model
    except ImportError as err:
        raise ConfigError(f"meshlm harness needs lm-evaluation-harness (the lm_eval package), which is not "
                          f"installed ({err}); {INSTALL}") from None
    return LM, register_model


LM, register_model = require_lm_eval()


def _batch_size(value) -> int:
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return 8
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--model_args batch_size={value!r} is not a number; e.g. batch_size=8") from None
    if n < 1:
        raise ConfigError(f"--model_args batch_size={n} must be >= 1")
    return n


@register_model("meshlm")
class MeshlmLM(LM):
    """A meshlm GPT-family checkpoint (`checkpoint=DIR`: a run directory, a step directory, or a .gguf file)."""

    def __init__(self, checkpoint: str | None = None, batch_size=None, device: str | None = None,
                 max_gen_toks: int = 256, **_ignored):
        super().__init__()
        from meshlm.eval.load import load
        from meshlm.interop.checkpoints import open_checkpoint

        if not checkpoint:
            raise ConfigError("--model meshlm needs --model_args checkpoint=DIR (a meshlm run or checkpoint directory)")
        import torch

        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm_eval's --device defaults to cuda; its hf backend falls back to the CPU too
            print(f"note: device {device!r} is not available; evaluating on the CPU", file=sys.stderr)
            device = "cpu"
        loaded = load(open_checkpoint(str(checkpoint)), [], _batch_size(batch_size), progress=False, device=device)
        if loaded.scorer is None:
            raise ConfigError(f"--model_args checkpoint={checkpoint}: a model.family={loaded.cfg.model.family!r} "
                              "model; the harness needs a language model (GPT family)")
        from meshlm.data.chat import template_for

        self.scorer = loaded.scorer
        self.tok = loaded.tokenizer
        self.seq_len = loaded.cfg.model.seq_len
        self.max_gen_toks = int(max_gen_toks)
        self._device = self.scorer.device
        self.tokenizer_spec = loaded.cfg.data.tokenizer
        self.template = template_for(self.tokenizer_spec)  # the checkpoint's chat template (a bad one fails here)

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's name, which lm_eval keys its request cache on (with the chat template's text)."""
        return self.tok.name

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """`--apply_chat_template [TEMPLATE]`: the checkpoint's chat template (`data.chat.template_for`: its
        Hugging Face tokenizer files' template, else meshlm's builtin one); TEMPLATE, when given, is a template
        file or text used instead. None when chat templates are off."""
        from meshlm.data.chat import template_for

        if chat_template is False or chat_template is None:
            return None
        if isinstance(chat_template, str) and chat_template not in ("", "default"):
            self.template = template_for(self.tokenizer_spec, override=chat_template)
        return self.template.text

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The few-shot chat as the checkpoint's chat template renders it (transformers' semantics)."""
        from meshlm.data.chat import render

        return render(self.template, chat_history, add_generation_prompt=add_generation_prompt)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        from meshlm.eval.tasks import encode_pair

        pairs = []
        for req in requests:
            context, continuation = req.args
            if context == "":
                pairs.append(([self.tok.eod_id], self.tok.encode(continuation)))
            else:
                pairs.append(encode_pair(self.tok, context, continuation))
        out = []
        for pair, (ll, greedy, _, _) in zip(pairs, self.scorer.continuation(pairs, desc="loglikelihood")):
            out.append((ll, greedy))
            self.cache_hook.add_partial("loglikelihood", pair, (ll, greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from meshlm.eval.scorer import windows

        docs = [windows(self.tok.encode(req.args[0]), self.tok.eod_id, self.seq_len, self.seq_len) for req in requests]
        return [float(x.sum()) for x in self.scorer.score_windows(docs, desc="loglikelihood_rolling")]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        states = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            budget = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok.encode(context) if context else [self.tok.eod_id]
            room = self.seq_len - budget
            if room > 0:
                ids = ids[-room:]
            states.append({"ids": ids[-self.seq_len:], "new": [], "until": until, "budget": budget, "done": budget <= 0})
        while True:
            active = [s for s in states if not s["done"]]
            if not active:
                break
            items = [((s["ids"] + s["new"])[-self.seq_len:], [-1] * len((s["ids"] + s["new"])[-self.seq_len:]))
                     for s in active]
            for s, scored in zip(active, self.scorer.score(items, desc="generate_until")):
                token = int(scored.greedy[-1])
                if token in getattr(self.tok, "stop_ids", (self.tok.eod_id,)):  # each declared end, the separator
                    s["done"] = True
                    continue
                s["new"].append(token)
                text = self.tok.decode(s["new"])
                full = len(s["ids"]) + len(s["new"]) >= self.seq_len  # the model's context is full
                if any(u in text for u in s["until"]) or len(s["new"]) >= s["budget"] or full:
                    s["done"] = True
        out = []
        for s, req in zip(states, requests):
            text = self.tok.decode(s["new"])
            for u in s["until"]:
                if u and u in text:
                    text = text[:text.index(u)]
            out.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out


def run_harness_cli(argv: list[str]) -> int:
    """lm_eval's command line on `argv` with the `meshlm` model registered; its exit status."""
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["meshlm harness", *argv]
    try:
        cli_evaluate()
    except SystemExit as stop:
        code = stop.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0
