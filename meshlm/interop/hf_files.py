"""The files of a Hugging Face model directory beside its weights: tokenizer files and sentence-transformers'.

Importing (`meshlm convert --from-hf`), the tokenizer files (with generation_config.json, which declares the
model's end-of-sequence ids), sentence-transformers' module files and the original config.json are carried into the checkpoint's `hf/` folder, so the checkpoint is usable as it is
(`data.tokenizer` points at that folder). A directory with a WordPiece `vocab.txt` or a GPT-2 style
`vocab.json` + `merges.txt` but no `tokenizer.json` gets one built from them (meshlm's tokenizers read
tokenizer.json or a SentencePiece tokenizer.model).

Exporting (`meshlm convert --to-hf`), the tokenizer files the checkpoint carries are copied back; a
checkpoint on the bundled `gpt2` or `bert` tokenizer gets those written out (GPT-2's vocab.json, merges.txt
and tokenizer.json rebuilt from the tiktoken ranks meshlm reads). A BERT encoder also gets the
sentence-transformers files (modules.json, 1_Pooling/config.json, sentence_bert_config.json) that make
`SentenceTransformer(DIR)` pool and normalise as `meshlm embed` does.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshlm.core.config import ConfigError, ModelConfig
from meshlm.data.tokenizers import SHAKESPEARE_BPE, HFTokenizer, get_tokenizer

# The tokenizer's files, and generation_config.json: with tokenizer_config.json it declares the model's end of
# sequence (`data.tokenizers.declared_eos`), read from beside the tokenizer.json a run's data.tokenizer names.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "chat_template.jinja",
                   "generation_config.json")
DECLARATION_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
ST_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
CARRIED = "hf"  # the checkpoint's folder of carried files
GPT2_EOT = "<|endoftext|>"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} cannot be read as JSON ({err})") from None


# ---- sentence-transformers ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SentenceModules:
    """What meshlm takes from a sentence-transformers directory."""

    pooling: str  # cls | mean
    normalize: bool
    pooling_dir: str  # where the Pooling module's config.json lies, relative to the directory
    max_seq_length: int | None


def _pooling_mode(config: dict[str, Any], where: Path) -> str:
    """'cls' or 'mean' from a Pooling config: the `pooling_mode` of sentence-transformers >= 5, or the
    `pooling_mode_*_token(s)` switches of earlier versions."""
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        modes = [k.removeprefix("pooling_mode_") for k, v in config.items() if k.startswith("pooling_mode_") and v]
    names = {"cls": "cls", "cls_token": "cls", "mean": "mean", "mean_tokens": "mean"}
    if len(modes) != 1 or modes[0] not in names:
        raise ConfigError(f"{where}: pooling {modes or 'none'} is not supported; meshlm embed pools by the mean "
                          "of the tokens or the [CLS] token, one of them")
    return names[modes[0]]


def read_sentence_modules(directory: Path) -> SentenceModules | None:
    """The pooling and normalisation of a sentence-transformers directory (None without modules.json);
    ConfigError for modules meshlm does not compute (Dense, a max pooling, ...), rather than vectors
    that differ from sentence-transformers'."""
    path = directory / "modules.json"
    if not path.exists():
        return None
    modules = _read_json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise ConfigError(f"{path} is not a list of modules with a 'type'")
    kinds = [str(m["type"]).rsplit(".", 1)[-1] for m in modules]
    unknown = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if unknown or kinds[:2] != ["Transformer", "Pooling"] or len(kinds) > 3:
        raise ConfigError(f"{path}: modules {kinds} are not supported; meshlm embed computes Transformer, "
                          "Pooling (mean or cls) and an optional Normalize")
    if modules[0].get("path", "") not in ("", "."):
        raise ConfigError(f"{path}: the Transformer module lies in {modules[0]['path']!r}; meshlm reads models "
                          "whose weights and config.json are in the directory itself")
    pooling_dir = str(modules[1].get("path", ""))
    pooling = _pooling_mode(_read_json(directory / pooling_dir / "config.json"), directory / pooling_dir)
    max_len = None
    bert_config = directory / "sentence_bert_config.json"
    if bert_config.exists():
        st = _read_json(bert_config)
        max_len = st.get("max_seq_length")
        if st.get("do_lower_case") and not _tokenizer_lowercases(directory):
            raise ConfigError(f"{bert_config}: do_lower_case=true lower-cases texts before a tokenizer that keeps "
                              "case; meshlm embed tokenizes the text as it is")
    return SentenceModules(pooling, len(kinds) == 3, pooling_dir, int(max_len) if max_len else None)


def _tokenizer_lowercases(directory: Path) -> bool:
    path = directory / "tokenizer.json"
    if not path.exists():
        return False
    normalizer = _read_json(path).get("normalizer") or {}
    parts = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
    return any(p.get("type") == "Lowercase" or (p.get("type") == "BertNormalizer" and p.get("lowercase"))
               for p in parts)


def carried_folder(tokenizer_spec: str) -> Path | None:
    """The folder of a checkpoint's tokenizer files (its hf/ folder after an import), or None for the
    bundled tokenizers and a path that is gone."""
    if tokenizer_spec in ("gpt2", "bert"):
        return None
    path = Path(tokenizer_spec).expanduser()
    return path if path.is_dir() else path.parent if path.is_file() else None


def checkpoint_files(checkpoint: Path, tokenizer_spec: str) -> Path | None:
    """The folder of the files carried with a resolved checkpoint: its run's hf/ folder (`meshlm convert
    --from-hf`), else the folder of its tokenizer files, else None."""
    checkpoint = Path(checkpoint)
    if checkpoint.parent.name == "checkpoints" and (checkpoint.parent.parent / CARRIED).is_dir():
        return checkpoint.parent.parent / CARRIED
    return carried_folder(tokenizer_spec)


def max_seq_length(folder: Path | None) -> int | None:
    """sentence-transformers' max_seq_length in the carried files' `folder` (`checkpoint_files`)."""
    config = folder / "sentence_bert_config.json" if folder is not None else None
    if config is None or not config.exists():
        return None
    value = _read_json(config).get("max_seq_length")
    return int(value) if value else None


def write_sentence_modules(cfg: ModelConfig, directory: Path, max_len: int | None) -> None:
    """modules.json, 1_Pooling/config.json and sentence_bert_config.json for a BERT encoder in `directory`."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if cfg.normalize_embeddings:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (directory / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": cfg.hidden_size, "pooling_mode_cls_token": cfg.pooling == "cls",
               "pooling_mode_mean_tokens": cfg.pooling == "mean", "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
    st = {"max_seq_length": min(max_len or cfg.seq_len, cfg.seq_len), "do_lower_case": False}
    (directory / "sentence_bert_config.json").write_text(json.dumps(st, indent=2) + "\n")


# ---- importing ----------------------------------------------------------------------------------------------
def carry_files(source: Path, target: Path, modules: SentenceModules | None) -> list[str]:
    """Copy the tokenizer files, the sentence-transformers files and config.json from `source` into
    `target` (created); build tokenizer.json from vocab.txt or vocab.json + merges.txt when it is absent.
    Returns the names written."""
    target.mkdir(parents=True, exist_ok=True)
    names = [n for n in (*TOKENIZER_FILES, "config.json") if (source / n).is_file()]
    if modules is not None:
        names += [n for n in ST_FILES if (source / n).is_file()]
        names.append(str(Path(modules.pooling_dir) / "config.json"))
    for name in names:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, target / name)
    if not (target / "tokenizer.json").exists() and not (target / "tokenizer.model").exists():
        if (target / "vocab.txt").exists():
            _wordpiece_json(target)
            names.append("tokenizer.json")
        elif (target / "vocab.json").exists() and (target / "merges.txt").exists():
            _byte_bpe_json(target)
            names.append("tokenizer.json")
    return names


def _wordpiece_json(folder: Path) -> None:
    """tokenizer.json for a BERT WordPiece `vocab.txt` (lower-casing as its tokenizer_config.json says)."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece

    settings = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").exists() else {}
    tok = Tokenizer(WordPiece.from_file(str(folder / "vocab.txt"), unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=bool(settings.get("do_lower_case", True)))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(folder / "tokenizer.json"))


def _byte_bpe_json(folder: Path) -> None:
    """tokenizer.json for a GPT-2 style byte-level BPE (vocab.json + merges.txt)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if tok.token_to_id(GPT2_EOT) is not None:
        tok.add_special_tokens([GPT2_EOT])
    tok.save(str(folder / "tokenizer.json"))


# ---- exporting ----------------------------------------------------------------------------------------------
def write_tokenizer_files(spec: str, target: Path, seq_len: int, log: Callable[[str], None] | None = None) -> list[str]:
    """The tokenizer files for `data.tokenizer = spec` in `target`: those it carries, or the bundled
    GPT-2 / BERT tokenizer's. Returns the names written (none for a tokenizer path that is gone)."""
    if spec == "gpt2":
        return write_chat_template(target, write_gpt2_tokenizer(target, seq_len))
    if spec == "bert":
        from meshlm.data.assets import minilm_dir

        return _copy_present(minilm_dir(), target, ("vocab.txt", "tokenizer.json", "tokenizer_config.json",
                                                    "special_tokens_map.json"))
    path = Path(spec).expanduser()
    if spec.startswith(SHAKESPEARE_BPE):  # trained from the bundled corpus into the cache: its tokenizer.json
        path = Path(get_tokenizer(spec).vocab_file)
    if path.is_dir():
        names = _copy_present(path, target, TOKENIZER_FILES)
    elif path.is_file():
        name = "tokenizer.model" if path.suffix == ".model" else "tokenizer.json"
        shutil.copyfile(path, target / name)
        names = [name, *_copy_present(path.parent, target, DECLARATION_FILES)]  # the eos declared beside it
    else:
        names = []
    if not names and log is not None:
        log(f"note: data.tokenizer={spec!r} is not there any more; no tokenizer files written")
    if "tokenizer.json" in names and "tokenizer_config.json" not in names:
        # the end of document meshlm used, declared for transformers (a bare tokenizer.json declares none)
        eos = HFTokenizer.from_file(target / "tokenizer.json", spec).eos_token
        (target / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len, "eos_token": eos},
            indent=2) + "\n")
        names.append("tokenizer_config.json")
    return write_chat_template(target, names) if names and "vocab.txt" not in names else names


def write_chat_template(target: Path, names: list[str]) -> list[str]:
    """`names` plus chat_template.jinja, meshlm's builtin chat template, written when the tokenizer files carry
    no template (neither chat_template.jinja nor tokenizer_config.json's chat_template): transformers'
    apply_chat_template then renders what `meshlm serve` does (docs/tune.md, Chat templates)."""
    from meshlm.data.chat import BUILTIN_TEMPLATE

    config = target / "tokenizer_config.json"
    if (target / "chat_template.jinja").exists() or (config.is_file() and "chat_template" in _read_json(config)):
        return names
    (target / "chat_template.jinja").write_text(BUILTIN_TEMPLATE)
    return [*names, "chat_template.jinja"]


def _copy_present(source: Path, target: Path, names: tuple[str, ...]) -> list[str]:
    found = [n for n in names if (source / n).is_file()]
    for name in found:
        shutil.copyfile(source / name, target / name)
    return found


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes for
    the code points from 256 up, in byte order (so every token is a printable string)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}


def _gpt2_ranks() -> dict[bytes, int]:
    from meshlm.data.assets import gpt2_ranks_file

    ranks = {}
    for line in gpt2_ranks_file().read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list of a byte-level BPE given only its ranks (tiktoken's form): the token of rank r is
    the last merge of BPE run on its own bytes with the ranks below r."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            candidates = [(ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)]
            best, i = min(candidates)
            if best >= rank:
                raise ValueError(f"token {token!r} of rank {rank} cannot be built from lower-ranked merges")
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        merges.append((parts[0], parts[1]))
    return merges


def write_gpt2_tokenizer(target: Path, seq_len: int) -> list[str]:
    """vocab.json, merges.txt, tokenizer.json and tokenizer_config.json of GPT-2's BPE (the ranks meshlm's
    `gpt2` tokenizer reads), which `transformers`' GPT-2 tokenizers load."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    ranks = _gpt2_ranks()
    alphabet = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {text(t): r for t, r in ranks.items()}
    vocab[GPT2_EOT] = len(ranks)
    merges = [(text(a), text(b)) for a, b in bpe_merges(ranks)]
    (target / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (target / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    tok = Tokenizer(BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([GPT2_EOT])
    tok.save(str(target / "tokenizer.json"))
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": GPT2_EOT, "eos_token": GPT2_EOT,
              "unk_token": GPT2_EOT, "add_prefix_space": False, "model_max_length": seq_len}
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"]


def carried_labels(folder: Path | None, num_labels: int) -> dict[str, Any] | None:
    """id2label / label2id of the imported config.json in the carried files' `folder` (`checkpoint_files`),
    when its classes are as many as the model's (so a round trip keeps the label names)."""
    config = folder / "config.json" if folder is not None else None
    if config is None or not config.is_file():
        return None
    try:
        d = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    labels = d.get("id2label") if isinstance(d, dict) else None
    if not isinstance(labels, dict) or len(labels) != num_labels:
        return None
    return {"id2label": labels, "label2id": d.get("label2id") or {v: int(k) for k, v in labels.items()}}
