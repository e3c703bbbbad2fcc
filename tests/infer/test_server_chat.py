"""`meshlm serve` renders /v1/chat/completions with the checkpoint's own chat template: a checkpoint whose
tokenizer folder carries a ChatML template (chat_template.jinja, as after `meshlm convert --from-hf`) is
prompted with exactly the ids transformers' apply_chat_template gives, and its reply ends at `<|im_end|>`."""

import json
from pathlib import Path

import openai
import pytest
import torch

from meshlm.data.tokenizers import train_bpe
from meshlm.models.generate import generate
from tests.checkpoint_helpers import load_run
from tests.conftest import tiny_config
from tests.infer.server_helpers import GPT_MODEL, ServeProcess

transformers = pytest.importorskip("transformers")
CHATML = (Path(__file__).parents[1] / "data" / "chat_templates" / "smollm2.jinja").read_text()
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": "A pear."}, {"role": "user", "content": "Another one?"}]


def chatml_checkpoint(root: Path) -> Path:
    """A tiny random GPT whose tokenizer folder is what `meshlm convert --from-hf` leaves in RUN/hf for a
    ChatML model: a byte-level BPE with the ChatML specials as added tokens, tokenizer_config.json and
    chat_template.jinja (the carrying itself: tests/data/test_chat_template.py)."""
    from tokenizers import Tokenizer

    from meshlm.checkpoint.single import save_checkpoint
    from meshlm.models.gpt import GPT

    folder = root / "run" / "hf"
    path = train_bpe([m["content"] for m in MESSAGES] * 4 + ["system user assistant\n"] * 4, 300, folder,
                     min_frequency=1)
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(path))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    (folder / "chat_template.jinja").write_text(CHATML)
    run = root / "run"
    cfg = tiny_config(run, model={**GPT_MODEL, "vocab_size": 320}, data={"tokenizer": str(folder)})
    torch.manual_seed(0)
    save_checkpoint(run, 1, {"model": GPT(cfg.model).state_dict()}, cfg.to_dict())
    return run


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run = chatml_checkpoint(tmp_path_factory.mktemp("chatml"))
    server = ServeProcess("--checkpoint", str(run), "--max-seqs", "2")
    yield server, run
    assert server.stop() == 0, "".join(server.stderr)[-3000:]


def test_chat_uses_the_checkpoints_template(served):
    server, run = served
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(run / "hf"))
    ids = list(hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert ids[:1] == [hf.convert_tokens_to_ids("<|im_start|>")]  # the specials are single ids
    model, tokenizer, _ = load_run(str(run))
    out = generate(model, torch.tensor([ids]), 12, temperature=0)[0, len(ids):].tolist()
    if tokenizer.eod_id in out:
        out = out[:out.index(tokenizer.eod_id)]
    expected = tokenizer.decode(out).split("<|im_end|>")[0]

    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    reply = c.chat.completions.create(model="run", messages=MESSAGES, max_tokens=12, temperature=0)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == expected

