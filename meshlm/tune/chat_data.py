"""Chat fine-tuning data: conversations in OpenAI's messages form, the loss on the assistant's turns only.

A line `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}` is one conversation of
any number of turns. It is rendered with the run's chat template (`meshlm.data.chat`: the base checkpoint's,
or `--chat-template FILE`) and tokenized as the template's text is; every token the template marks as the
assistant's (its `{% generation %}` spans: each assistant turn's content and the end-of-turn it writes) is a
target, every other target is ignored (-100), as TRL's `assistant_only_loss=True`. The tokenizer's
document separator (`eod_id`) ends every conversation, so a conversation's tokens are the same whether it has
a row of its own or shares one.

The separator is the tokenizer's document token, not its declared end of sequence, where the two differ
(`data.tokenizers`, `document_separator`): a ChatML model (SmolLM2, Qwen2.5-Instruct) declares `<|im_end|>`,
which ends every turn inside a conversation and so cannot mark where one packed conversation ends; its
`<|endoftext|>` separates them. What the model learns at the end of a reply is what the template renders
there, as TRL trains it: the assistant turn's `<|im_end|>` and the newline after it are targets, and the
separator is never one (the position before it predicts nothing, like the last token of a TRL row). The
template renders no separator after a reply, so the model is not taught to emit one; it stops at the declared
`<|im_end|>`, and generation stops at every declared id and the separator (`stop_ids`).

Rows:

* one conversation per row (default): [virtual tokens] + conversation + end-of-document, then padding
  (end-of-document tokens, targets ignored);
* `--pack`: several conversations per row, placed first-fit-decreasing by length, each followed by its
  end-of-document token; the run gets `data.document_mask=true`, so a token attends only to its own
  conversation and positions restart at each one (`data/documents.py`). Each conversation's losses then
  equal its unpacked ones, with fewer rows (less padding) for the same data.

A conversation longer than a row is an error naming its file:line, unless `--truncate`, which keeps its
first tokens (the end of the conversation is dropped, as TRL's `truncation_mode="keep_start"`), the last
kept one followed by the end-of-document token; one with no assistant token left is still an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshlm.data.items import DataError
from meshlm.data.jsonl import Line, short_json
from meshlm.models.loss import IGNORE_INDEX as IGNORE
from meshlm.tune.data import TuneDataset

ROLES = ("system", "user", "assistant")
FIELD = "messages"


def is_chat(train: list[Line], valid: list[Line]) -> bool:
    """Whether the files hold conversations (lines with a `messages` field) rather than input/output or task
    lines; one kind in both files, else a DataError naming the first line of the other kind."""
    chat = FIELD in train[0].obj
    for line in [*train, *valid]:
        if (FIELD in line.obj) != chat:
            first = train[0].where
            kind, other = ("a line without 'messages'", "conversations") if chat else \
                ("a conversation ('messages')", "input/output or task lines")
            raise DataError(f"{line.where}: {kind} among {other} (as {first}); one kind of line per run: "
                            "write every line as {\"messages\": [...]} or none")
    return chat


def messages(line: Line) -> list[dict]:
    """The line's conversation as [{"role", "content"}, ...], checked: known roles, text contents, at least
    one assistant turn (a DataError naming the file:line otherwise)."""
    value = line.obj[FIELD]
    if not isinstance(value, list) or not value:
        raise DataError(f"{line.where}: 'messages' is {short_json(value)}, not a list of turns; write "
                        "[{\"role\": \"user\", \"content\": \"...\"}, {\"role\": \"assistant\", ...}]")
    out = []
    for n, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise DataError(f"{line.where}: messages[{n}] is {short_json(turn)}, not an object with role and content")
        role, content = turn.get("role"), turn.get("content")
        if role not in ROLES:
            raise DataError(f"{line.where}: messages[{n}] has role {short_json(role)}; a role is one of "
                            f"{', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{line.where}: messages[{n}] ({role}) has content {short_json(content)}, not text")
        out.append({"role": role, "content": content})
    if not any(t["content"].strip() for t in out):
        raise DataError(f"{line.where}: every message of the conversation is empty; there is nothing to learn from "
                        "it (drop the line or fill in its contents)")
    if not any(t["role"] == "assistant" for t in out):
        raise DataError(f"{line.where}: the conversation has no assistant turn; the loss is on the assistant's "
                        "turns, so every conversation needs one")
    return out


@dataclass
class Conversation:
    """One encoded conversation: ids ending with the end-of-document token, and per position the target
    (the next token where it is the assistant's, else IGNORE)."""

    where: str
    ids: list[int]
    targets: list[int]


def encode_conversation(line: Line, tokenizer, template, room: int, truncate: bool, pack: bool) -> tuple[Conversation, bool]:
    """`line`'s conversation in at most `room` tokens (end-of-document included); returns it and whether
    it was cut (`truncate`)."""
    from meshlm.data.chat import as_template, encode_chat

    turns = messages(line)
    ids, mask = encode_chat(tokenizer, template, turns)
    ids, mask, eod = [int(i) for i in ids], [bool(m) for m in mask], tokenizer.eod_id
    if pack and eod in ids:
        if tokenizer.decode([eod]) in as_template(template).text:
            why = ("the template's end of turn, which this tokenizer also separates documents with (it holds no "
                   "document token such as <|endoftext|> or </s>); train without --pack")
        else:
            why = "which would split it in a packed row; remove it from the text, or train without --pack"
        raise DataError(f"{line.where}: the conversation encodes to the document separator ({eod}), {why}")
    ids, mask = ids + [eod], mask + [False]
    cut = len(ids) > room
    if cut and not truncate:
        raise DataError(f"{line.where}: the conversation is {len(ids)} tokens (end-of-document included), longer "
                        f"than the {room} of a row; shorten it, raise --max-length (at most model.seq_len), or pass "
                        "--truncate to keep its first tokens")
    if cut:
        ids, mask = ids[:room - 1] + [eod], mask[:room - 1] + [False]
    targets = [ids[i + 1] if mask[i + 1] else IGNORE for i in range(len(ids) - 1)] + [IGNORE]
    if all(t == IGNORE for t in targets):
        why = f"within the {room} tokens --truncate keeps" if cut else "(the template marks none)"
        raise DataError(f"{line.where}: the conversation has no assistant token to learn {why}; check the chat "
                        "template's {% generation %} spans, or shorten the turns before the assistant's")
    return Conversation(line.where, ids, targets), cut


def pack_rows(lengths: list[int], room: int) -> list[list[int]]:
    """First-fit-decreasing: the indices of the items placed in each row of `room` tokens, longest first
    (ties in the given order); every length must be <= room."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, left in enumerate(free):
            if lengths[i] <= left:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(room - lengths[i])
    return rows


def chat_dataset(convs: list[Conversation], length: int, eod: int, n_virtual: int = 0, pack: bool = False,
                 task_index: int = 0) -> TuneDataset:
    """Rows of `length` tokens: one conversation each after `n_virtual` placeholders, or packed (`pack`,
    no virtual tokens); the rest padded with end-of-document tokens whose targets are ignored."""
    groups = pack_rows([len(c.ids) for c in convs], length) if pack else [[i] for i in range(len(convs))]
    ids = np.full((len(groups), length), eod, dtype=np.int64)
    targets = np.full((len(groups), length), IGNORE, dtype=np.int64)
    for row, group in enumerate(groups):
        at = 0 if pack else n_virtual
        ids[row, :at] = task_index
        for i in group:
            c = convs[i]
            ids[row, at:at + len(c.ids)] = c.ids
            targets[row, at:at + len(c.ids)] = c.targets
            at += len(c.ids)
    return TuneDataset(ids, targets)


def encode_chats(lines: list[Line], tokenizer, template, length: int, n_virtual: int, truncate: bool,
                 pack: bool) -> tuple[TuneDataset, int, int]:
    """A file's conversations as a TuneDataset; returns it, the number of conversations cut (`truncate`)
    and the number of conversations."""
    convs, cut = [], 0
    for line in lines:
        conv, was_cut = encode_conversation(line, tokenizer, template, length - n_virtual, truncate, pack)
        convs.append(conv)
        cut += was_cut
    return chat_dataset(convs, length, tokenizer.eod_id, n_virtual, pack), cut, len(convs)
