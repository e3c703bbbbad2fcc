"""Examples from JSON Lines files, for the commands that read labelled or conversational data (finetune,
tune, align, eval): each object with its `file:line`, so every error names where the bad line is."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from meshlm.data.items import DataError


@dataclass
class Line:
    where: str  # "file:line"
    obj: dict


def read_jsonl(path: str, flag: str) -> list[Line]:
    """The JSON objects of a .jsonl file, each with its file:line; blank lines skipped. `flag` (the option
    that named the file) opens each error message."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{flag} {path!r} does not exist; give a .jsonl file")
    if not p.is_file():
        raise DataError(f"{flag} {path!r} is not a file; give a .jsonl file")
    out = []
    try:
        with open(p, encoding="utf-8-sig") as fh:  # a byte-order mark is not part of the first line
            for n, text in enumerate(fh, 1):
                if not text.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as err:
                    raise DataError(f"{where}: not valid JSON ({err.msg}); one JSON object per line") from None
                if not isinstance(obj, dict):
                    raise DataError(f"{where}: a JSON {type(obj).__name__}, not an object; one object per line")
                out.append(Line(where, obj))
    except UnicodeDecodeError as err:
        raise DataError(f"{flag} {path!r} is not UTF-8 text (byte {err.start}); give a .jsonl file") from None
    except OSError as err:
        raise DataError(f"{flag} {path!r} cannot be read ({err.strerror or err})") from None
    if not out:
        raise DataError(f"{flag} {path!r} holds no examples; give a .jsonl file with one example per line")
    return out


def get_field(line: Line, key: str, kind, task: str, optional: bool = False):
    """`line`'s value of `key`, of type `kind` (a type or a tuple of types; a bool is none of them); a
    DataError naming the file:line when it is missing (unless `optional`: None) or of another type."""
    if key not in line.obj:
        if optional:
            return None
        raise DataError(f"{line.where}: no {key!r} field; every line of a {task} file needs one")
    value = line.obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise DataError(f"{line.where}: {key!r} is {type(value).__name__} {short_json(value)}, not {names}")
    return value


def short_json(value) -> str:
    """`value` as JSON, cut to 40 characters (for an error message)."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
