"""A rule-based sentence splitter for `meshlm prepare --split-sentences` (no extra dependency).

A sentence ends

- after end punctuation (`.`, `!`, `?`, `…`, runs of them such as `?!` or `...`), with any closing
  quotes or brackets that follow, when whitespace (or the end of the text) comes next; a lone `.` after
  a known abbreviation (`Mr.`, `Dr.`, `St.`, `e.g.`, ...) or a single capital letter (an initial,
  `J. Smith`; not `I`) does not end one, nor does any end followed, on the same line, by a lower-case
  letter (`"Oh!" he said`, `etc. and so on`);
- at a blank line (a paragraph break), whatever precedes it.

A sentence may span lines (verse). The whitespace after a sentence's end belongs to that sentence, so
the sentences of a text concatenate back to the text exactly, and every sentence but a text's first
starts with a non-space character.

Every decision looks only at the text before the boundary, at the whitespace right after it and, when
that whitespace holds no newline, at the next character: never past a newline. `meshlm prepare` cuts a long document into pieces right after a newline between two
printable characters; splitting each piece on its own, and joining a piece's unfinished last sentence
to the next piece's first, therefore gives the sentences of the whole text.
"""

from __future__ import annotations

import re

ENDS = ".!?\u2026"  # sentence-ending punctuation (… is U+2026)
CLOSERS = "\"')]}\u00bb\u2019\u201d"  # may follow the end punctuation: quotes, brackets, », ’ and ”
OPENERS = "\"'([{\u00ab\u2018\u201c"
# Lower-cased words that a single "." follows without ending a sentence. Words that also end sentences
# in ordinary (or Shakespeare's) English are left out: no, art, mar, fig, may.
ABBREVIATIONS = frozenset({
    "mr", "mrs", "ms", "mx", "dr", "prof", "rev", "fr", "sr", "jr", "st", "mt", "ft", "gen", "col", "capt", "lt",
    "sgt", "maj", "cmdr", "adm", "gov", "sen", "hon", "pres", "messrs", "mme", "mlle", "esq", "vs", "viz", "cf",
    "al", "approx", "dept", "univ", "assn", "bros", "inc", "ltd", "co", "corp", "vol", "vols", "ed", "eds",
    "p", "pp", "ch", "sec", "jan", "feb", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec",
})


def _end_pattern(ends: str) -> re.Pattern:
    punct, close = re.escape(ends), re.escape(CLOSERS)
    # `word`: the shortest run of non-space before the punctuation (a match starts at a word's start)
    return re.compile(rf"(?P<word>\S*?)(?P<punct>[{punct}]+)(?P<close>[{close}]*)(?:\s+|\Z)")


_END = _end_pattern(ENDS)
_BLANK = re.compile(r"(?<=\S)\s*?\n[^\S\n]*\n\s*")  # a blank line after text, with all whitespace around it
_INITIALS = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]")  # e.g, i.e, U.S.A (the last dot is the match's)


def is_abbreviation(word: str) -> bool:
    """Does `word` followed by a single `.` not end a sentence?"""
    word = word.lstrip(OPENERS)
    if len(word) == 1:
        return word.isupper() and word != "I"  # an initial
    return word.lower() in ABBREVIATIONS or _INITIALS.fullmatch(word) is not None


def sentence_ends(text: str, ends: str = ENDS) -> list[int]:
    """Sorted positions p (0 < p <= len(text)) where a sentence of `text` ends: text[:p] | text[p:].
    `ends` may add e.g. `;:` to the end punctuation (those end a sentence before a lower-case letter too)."""
    pattern = _END if ends == ENDS else _end_pattern(ends)
    found = set()
    for m in pattern.finditer(text):
        if m["punct"] == "." and not m["close"] and is_abbreviation(m["word"]):
            continue
        end = m.end()
        if (end < len(text) and text[end].islower() and "\n" not in m[0]  # `"Oh!" he said`, `etc. and`
                and any(c in ENDS for c in m["punct"])):  # (not after an added end such as `;`)
            continue
        found.add(end)
    found.update(m.end() for m in _BLANK.finditer(text))
    return sorted(found)


def split_sentences(text: str, ends: str = ENDS) -> tuple[list[str], str]:
    """(the complete sentences of `text`, what follows the last one). The remainder is "" when the text
    ends at a sentence end; for a whole document it is the last sentence, for a piece of one it
    continues in the next piece. "".join(sentences) + remainder == text."""
    sentences, start = [], 0
    for end in sentence_ends(text, ends):
        sentences.append(text[start:end])
        start = end
    return sentences, text[start:]


def sentences_of(text: str, ends: str = ENDS) -> list[str]:
    """The sentences of a whole document (its remainder is its last sentence)."""
    sentences, rest = split_sentences(text, ends)
    return sentences + [rest] if rest else sentences
