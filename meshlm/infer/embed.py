"""Sentence embeddings from a BERT checkpoint: `meshlm embed --checkpoint RUN --input FILE --output OUT`
(`embed_file`; the command line is `meshlm/commands/embed.py`).

Each text is tokenized as [CLS] text [SEP] (one segment) and cut to `max_length` tokens; batches are padded
with [PAD] and masked, texts sorted by length so a batch pads little, and the rows put back in input order.
The vector of a text is the checkpoint's `model.pooling` of the encoder's last hidden states, as
sentence-transformers computes it: `mean` averages the real tokens' states, `cls` takes the [CLS] token's
state (not the pooler's tanh output); `model.normalize_embeddings` scales it to unit length.

`max_length` defaults to sentence-transformers' `max_seq_length` when the checkpoint carries
sentence_bert_config.json (`meshlm convert --from-hf` of a sentence-transformers model), else
`model.seq_len`. A text longer than the model can read at all (`model.seq_len` tokens) is an error naming
its line, unless `truncate`; nothing is written then. The output file is written whole or not at all.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from meshlm.core.config import ConfigError


def read_texts(path: str | Path) -> list[str]:
    """One text per line of a text file (line i is row i; a trailing newline ends the last line), or the
    `text` field of every record of a .jsonl file (blank lines skipped)."""
    return read_numbered_texts(path)[0]


def read_numbered_texts(path: str | Path) -> tuple[list[str], list[int]]:
    """`read_texts`, and the line number of each text in the file."""
    path = Path(path).expanduser()
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--input {str(path)!r} does not exist; give a .txt (one text per line) or .jsonl "
                          "(a 'text' field per line) file") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"--input {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ConfigError(f"--input {str(path)!r} cannot be read ({err.strerror})") from None
    lines = raw.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    lines = [line.removesuffix("\r") for line in lines]
    numbers = list(range(1, len(lines) + 1))
    if path.suffix == ".jsonl":
        texts, numbers = [], []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ConfigError(f"--input {str(path)!r} line {number} is not JSON ({err})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ConfigError(f"--input {str(path)!r} line {number} has no string field 'text'")
            texts.append(record["text"])
            numbers.append(number)
        lines = texts
    if not lines:
        raise ConfigError(f"--input {str(path)!r} holds no text; give one text per line")
    return lines, numbers


def tokenize(tokenizer, texts: list[str], max_length: int, seq_len: int, truncate: bool,
             where: list[str] | None = None) -> list[list[int]]:
    """[CLS] ids [SEP] of each text, cut to `max_length`; ConfigError for a text over `seq_len` tokens
    unless `truncate`, naming it by `where[i]` (default: text i, from 1)."""
    special = tokenizer.special_ids
    absent = [f"[{n.upper()}]" for n in ("cls", "sep", "pad") if n not in special]
    if absent:
        raise ConfigError(f"the checkpoint's tokenizer has no {', '.join(absent)} token; meshlm embed needs a BERT "
                          "tokenizer (data.tokenizer)")
    cls, sep = special["cls"], special["sep"]
    out = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text)
        if len(ids) + 2 > seq_len and not truncate:
            raise ConfigError(f"{where[i] if where else f'text {i + 1}'} is {len(ids) + 2} tokens with [CLS] and [SEP], more than the "
                              f"model's model.seq_len={seq_len}; shorten it or pass --truncate (keeps the first "
                              f"{max_length})")
        out.append([cls, *ids[:max_length - 2], sep])
    return out


def embed_ids(model, ids: list[list[int]], pad_id: int, batch_size: int = 32, pooling: str = "cls",
              normalize: bool = False):
    """(len(ids), hidden) float32 numpy array: the pooled last hidden states of each id list."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from meshlm.models.bert import mean_pool, pack_inputs

    device = next(model.parameters()).device
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    out = np.zeros((len(ids), model.cfg.hidden_size), dtype=np.float32)
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            width = max(len(ids[i]) for i in rows)
            batch = torch.full((len(rows), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                batch[r, :len(ids[i])] = torch.tensor(ids[i])
                mask[r, :len(ids[i])] = 1
            hidden = model.encode(pack_inputs(batch, None, mask).to(device)).float()
            vectors = mean_pool(hidden, mask.to(device)) if pooling == "mean" else hidden[:, 0]
            if normalize:
                vectors = F.normalize(vectors, p=2, dim=-1)
            out[rows] = vectors.cpu().numpy()
    return out


def write_embeddings(vectors, output: str | Path) -> Path:
    """OUT.npy (float32 rows) or OUT.jsonl ({"embedding": [...]} per line), written to a temporary file
    beside it and renamed into place."""
    import numpy as np

    out = Path(output).expanduser()
    tmp = Path(tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.tmp-")[1])
    try:
        with open(tmp, "wb") as fh:
            if out.suffix == ".jsonl":
                fh.writelines((json.dumps({"embedding": row}) + "\n").encode() for row in vectors.tolist())
            else:
                np.save(fh, np.ascontiguousarray(vectors, dtype=np.float32))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def _check_output(output: str) -> None:
    out = Path(output).expanduser()
    if out.suffix not in (".npy", ".jsonl"):
        raise ConfigError(f"--output {output!r} must end in .npy (float32 rows) or .jsonl (one "
                          '{"embedding": [...]} per line)')
    if out.is_dir():
        raise ConfigError(f"--output {output!r} is a directory; name a file")
    if not out.parent.is_dir():
        raise ConfigError(f"--output {output!r}: directory {str(out.parent)!r} does not exist; create it first")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--output {output!r}: directory {str(out.parent)!r} is not writable")


def embed_file(checkpoint: str, input_path: str, output: str, batch_size: int = 32, max_length: int | None = None,
               truncate: bool = False) -> Path:
    """`meshlm embed`: the sentence embeddings of the texts of `input_path` (`read_texts`) by the BERT
    `checkpoint`, written to `output` (`write_embeddings`); `max_length` None: the default of the module's
    docstring. Prints what it wrote and returns its path."""
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size} must be >= 1")
    _check_output(output)
    from meshlm.checkpoint.load import load_model
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec
    from meshlm.interop.checkpoints import open_checkpoint
    from meshlm.interop.hf_files import checkpoint_files, max_seq_length

    opened = open_checkpoint(checkpoint)  # resolved and verified once
    source, cfg = opened.path, opened.config
    m = cfg.model
    spec = get_spec(m.family)
    if not spec.sentence_embeddings:
        raise ConfigError(f"meshlm embed needs a BERT checkpoint (model.family='bert'); {checkpoint} is "
                          f"model.family={m.family!r}")
    carried = max_seq_length(checkpoint_files(source, cfg.data.tokenizer))
    max_length = max_length or min(carried or m.seq_len, m.seq_len)
    if not 3 <= max_length <= m.seq_len:
        raise ConfigError(f"--max-length {max_length} must be in 3..{m.seq_len} (model.seq_len: [CLS], at least one "
                          "token, [SEP])")
    texts, numbers = read_numbered_texts(input_path)
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    ids = tokenize(tokenizer, texts, max_length, m.seq_len, truncate,
                   [f"--input {input_path!r} line {n}" for n in numbers])
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(opened, spec, device)
    vectors = embed_ids(model, ids, tokenizer.special_ids["pad"], batch_size, m.pooling, m.normalize_embeddings)
    path = write_embeddings(vectors, output)
    print(f"wrote {len(texts)} embeddings of {vectors.shape[1]} dims ({m.pooling} pooling"
          f"{', normalised' if m.normalize_embeddings else ''}) to {path}")
    return path
