"""Packing the conversations of a ChatML model, whose declared end of sequence `<|im_end|>` ends every turn:
SmolLM2-135M-Instruct's own tokenizer (written from its GGUF file) separates packed conversations with its
`<|endoftext|>` and still stops generating at `<|im_end|>` (transformers reads the same eos); each conversation
learns its reply, `<|im_end|>` and the newline as TRL does, never the separator; packed rows give each
conversation its unpacked losses (float64, a tiny random Llama on that vocabulary); and `meshlm tune --pack
--method lora` runs on the imported SmolLM2 itself (slow: the released model)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from meshlm.checkpoint.single import save_checkpoint
from meshlm.core.config import build
from meshlm.families.gpt import document_inputs
from meshlm.models.gpt import GPT
from meshlm.models.loss import IGNORE_INDEX as IGNORE
from tests.test_released_model import smol  # noqa: F401 (its cached import of the SmolLM2 GGUF, a fixture)
from tests.tune.test_chat_sft import prepared
from tests.tune.tune_helpers import LLAMA, QUIET, WORDS, run, write_jsonl

SMOL_VOCAB = 49152


def conversations(n: int) -> list[dict]:
    """ChatML conversations of one or two exchanges, some with a system turn, of different lengths."""
    rows = []
    for k in range(n):
        turns = [{"role": "system", "content": "Answer with one word."}] if k % 3 == 0 else []
        for j in range(1 + k % 2):
            word = WORDS[(k + j) % len(WORDS)]
            turns += [{"role": "user", "content": f"Which colour is {word}?"}, {"role": "assistant", "content": word}]
        rows.append({"messages": turns})
    return rows


@pytest.fixture(scope="module")
def smol_tokenizer(tmp_path_factory):
    """SmolLM2's tokenizer files as the GGUF import writes them (tokenizer.json, tokenizer_config.json with the
    ChatML template and eos <|im_end|>, generation_config.json), without dequantizing the weights."""
    from meshlm.data.assets import smollm2_gguf
    from meshlm.interop.gguf import metadata, open_gguf
    from meshlm.interop.gguf_tokenizer import write_tokenizer_files

    folder = tmp_path_factory.mktemp("smol_tokenizer")
    write_tokenizer_files(metadata(open_gguf(smollm2_gguf())), folder, 8192)
    return folder


def test_chatml_separator_is_endoftext_and_generation_still_stops_at_im_end(smol_tokenizer):
    transformers = pytest.importorskip("transformers")
    from meshlm.data.tokenizers import get_tokenizer

    tok = get_tokenizer(str(smol_tokenizer))
    theirs = transformers.AutoTokenizer.from_pretrained(str(smol_tokenizer))
    im_end, endoftext = theirs.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert theirs.eos_token_id == im_end != endoftext
    assert tok.eod_id == endoftext and tok.eod_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert tok.stop_ids == (im_end, endoftext)  # the declared eos first, then the separator


def tiny_base(out, tokenizer: str):
    """A random tiny Llama on SmolLM2's vocabulary, saved as a run whose data.tokenizer is `tokenizer`."""
    cfg = build({"model": {"family": "gpt", "vocab_size": SMOL_VOCAB, **LLAMA, "seq_len": 96},
                 "train": {"out_dir": str(out), "progress": False, "peak_tflops": 1.0}, "data": {"tokenizer": tokenizer}})
    torch.manual_seed(0)
    gpt = GPT(cfg.model)
    save_checkpoint(out, 0, {"model": gpt.state_dict(), "optim": torch.optim.AdamW(gpt.parameters()).state_dict(),
                             "state": {"step": 0, "tokens_seen": 0}}, cfg.to_dict())
    return out, gpt


def token_losses(model, ids: np.ndarray, targets: np.ndarray, eod: int | None) -> torch.Tensor:
    x = torch.from_numpy(ids)
    kw = document_inputs(x, eod) if eod is not None else {}
    with torch.no_grad():
        logits = model(x, **kw)
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), torch.from_numpy(targets),
                                             ignore_index=IGNORE, reduction="none")


def test_packed_chatml_rows_give_each_conversation_its_unpacked_losses(smol_tokenizer, tmp_path):
    base, gpt = tiny_base(tmp_path / "base", str(smol_tokenizer))
    data = {"train": write_jsonl(tmp_path / "train.jsonl", conversations(10)),
            "valid": write_jsonl(tmp_path / "valid.jsonl", conversations(2))}
    argv = ["tune", "--checkpoint", str(base), "--method", "lora", "--train", str(data["train"]), "--valid",
            str(data["valid"]), "--out", str(tmp_path / "x"), "--max-length", "96", *QUIET]
    _, tok, alone, _, _ = prepared(argv)
    cfg, _, packed, _, info = prepared([*argv, "--pack"])
    assert info["pack"] is True and cfg.data.document_mask
    im_end, nl, sep = tok.encode("<|im_end|>")[0], tok.encode("\n")[0], tok.eod_id
    assert sep == tok.encode("<|endoftext|>")[0] != im_end
    assert len(packed) < len(alone) and packed.num_tokens == alone.num_tokens
    for i in range(len(alone)):
        ids, targets = alone.ids[i].tolist(), alone.targets[i].tolist()
        end = ids.index(sep)  # the conversation, then its separator
        assert im_end in ids[:end] and sep not in ids[:end]
        learned = [t for t in targets if t != IGNORE]
        assert learned[-2:] == [im_end, nl] and sep not in learned  # as TRL: the turn's end, never the separator
        assert targets[end - 1] == IGNORE  # the newline before the separator predicts nothing
    model = gpt.double().eval()
    one = token_losses(model, alone.ids, alone.targets, None)
    many = token_losses(model, packed.ids, packed.targets, sep)
    # each conversation's losses, by its ids: in the packed rows they follow the separators
    found = 0
    for i in range(len(alone)):
        n = alone.ids[i].tolist().index(sep) + 1
        conv = alone.ids[i, :n]
        for row in range(len(packed)):
            starts = [0] + [k + 1 for k, t in enumerate(packed.ids[row]) if t == sep]
            at = next((s for s in starts if np.array_equal(packed.ids[row, s:s + n], conv)), None)
            if at is not None:
                assert np.array_equal(packed.targets[row, at:at + n], alone.targets[i, :n])
                assert float(one[i, :n].sum()) > 0
                torch.testing.assert_close(many[row, at:at + n], one[i, :n], rtol=1e-12, atol=1e-12)
                found += 1
                break
    assert found == len(alone)
    leaky = token_losses(model, packed.ids, packed.targets, None)  # no document mask: the check has teeth
    assert not torch.allclose(leaky, many)


@pytest.mark.slow
def test_tune_pack_lora_runs_on_imported_smollm2(smol, tmp_path):  # noqa: F811 (the imported fixture)
    data = {"train": write_jsonl(tmp_path / "train.jsonl", conversations(4)),
            "valid": write_jsonl(tmp_path / "valid.jsonl", conversations(2))}
    out = tmp_path / "packed"
    code, _, err = run("tune", "--checkpoint", smol["gguf"], "--method", "lora", "--pack", "--train",
                       str(data["train"]), "--valid", str(data["valid"]), "--max-length", "96", "--out", str(out),
                       *QUIET, "--train.max_steps=2", "--train.micro_batch_size=1", "--train.global_batch_size=1",
                       "--train.eval_iters=1", "--train.precision=fp32")
    assert code == 0, err
    info = json.loads((out / "tune.json").read_text())
    assert info["pack"] is True
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2] and all(0 < r["loss"] < 20 for r in steps)
    assert (out / "adapter_model.safetensors").exists()
