"""meshlm align's losses equal TRL's on the same tiny model and data: a policy and a different frozen reference
(two GPT-2-style bases exported with `meshlm convert --to-hf`), one batch of four pairs, no training step.
DPO (sigmoid) and IPO against `trl.DPOTrainer`'s own loss computation (its tokenization of the texts too),
and DPO on conversational lines (meshlm's builtin chat template given to TRL's tokenizer too), SimPO (with label
smoothing) against `trl.experimental.cpo.CPOTrainer` (loss_type="simpo", cpo_alpha=0) on meshlm's token ids:
the loss, TRL's metrics (rewards/*, logps/*, logits/*) and the gradients (embeddings, a norm, the fused qkv,
and the whole gradient's norm) within 1e-5."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from meshlm.checkpoint.load import open_checkpoint
from meshlm.data.chat import BUILTIN_TEMPLATE
from meshlm.data.jsonl import Line
from meshlm.data.tokenizers import get_tokenizer
from meshlm.models.loss import cross_entropy
from meshlm.tune import preference
from meshlm.tune.align import reference_logps
from tests.checkpoint_helpers import load_run
from tests.tune.tune_helpers import GPT2, run, save_base

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
TOL = 1e-5
BETA = 0.3
PAIRS = [{"prompt": "say red:", "chosen": " red", "rejected": " blue"},
         {"prompt": "say gold now:", "chosen": " gold gold", "rejected": " green"},
         {"prompt": "colour of the sky?", "chosen": " blue", "rejected": " red, or gold, or green"},
         {"prompt": "x", "chosen": " y z", "rejected": " z"}]
# meshlm name → (Hugging Face GPT-2 name, transposed: GPT-2's Conv1D stores (in, out))
GRADS = {"tok_emb.weight": ("transformer.wte.weight", False), "pos_emb.weight": ("transformer.wpe.weight", False),
         "layers.0.norm1.weight": ("transformer.h.0.ln_1.weight", False),
         "layers.1.attn.qkv.weight": ("transformer.h.1.attn.c_attn.weight", True),
         "layers.1.attn.proj.bias": ("transformer.h.1.attn.c_proj.bias", False)}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("align_trl")
    for name, seed in (("policy", 1), ("reference", 0)):
        save_base(root / name, {**GPT2, "seq_len": 48}, seed=seed)  # room for a chat-rendered pair
        assert run("convert", "--checkpoint", str(root / name), "--to-hf", str(root / f"{name}_hf"))[0] == 0
    return root


def hf_model(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(str(path)).float().eval()


CHAT = [{"prompt": [{"role": "user", "content": p["prompt"]}],
         "chosen": [{"role": "assistant", "content": p["chosen"].strip()}],
         "rejected": [{"role": "assistant", "content": p["rejected"].strip()}]} for p in PAIRS]


def meshlm_side(bases, objective: preference.Objective, rows=PAIRS, length: int = 16):
    """(loss, metrics, gradients by name, ids) of meshlm's preference loss on `rows` (conversational ones through
    meshlm's builtin chat template)."""
    tokenizer = get_tokenizer("gpt2")
    lines = [Line(f"pairs:{i + 1}", row) for i, row in enumerate(rows)]
    texts = [preference.pair_texts(line, lambda: BUILTIN_TEMPLATE) for line in lines]
    data = preference.encode_pairs(texts, [x.where for x in lines], tokenizer, length)
    if objective.reference:
        data = data.with_reference(reference_logps(open_checkpoint(bases / "reference"), [data], "cpu")[0])
    model, _, _ = load_run(str(bases / "policy"))
    x, y = data.collate(np.stack([data[i] for i in range(len(data))]))
    loss_fn = preference.make_loss(objective, cross_entropy, whole=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    sums, n = loss_fn.take()
    metrics = dict(zip(loss_fn.part_names, (sums / n).tolist()))
    return loss.item(), metrics, {k: p.grad for k, p in model.named_parameters()}, x


def assert_grads_equal(ours: dict, hf: torch.nn.Module) -> None:
    theirs = {k: p.grad for k, p in hf.named_parameters()}
    for name, (hf_name, transposed) in GRADS.items():
        want = theirs[hf_name].t() if transposed else theirs[hf_name]
        torch.testing.assert_close(ours[name], want, rtol=TOL, atol=TOL * float(want.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")
    norm_ours = torch.sqrt(sum((g.double() ** 2).sum() for g in ours.values() if g is not None))
    norm_hf = torch.sqrt(sum((g.double() ** 2).sum() for g in theirs.values() if g is not None))
    assert float(norm_ours) == pytest.approx(float(norm_hf), rel=TOL)
    assert float(norm_ours) > 0


def assert_metrics_equal(ours: dict, theirs: dict) -> None:
    assert set(preference.PART_NAMES + preference.LOGIT_NAMES) <= set(ours)
    for key, value in ours.items():
        want = theirs[key] if not isinstance(theirs[key], list) else theirs[key][-1]
        assert value == pytest.approx(want, rel=TOL, abs=TOL), (key, value, want)


@pytest.mark.parametrize("method", ["dpo", "ipo", "dpo_chat"])
def test_dpo_and_ipo_equal_trl_dpo_trainer(bases, method, tmp_path):
    """`dpo_chat`: the conversational form, rendered by the same chat template on both sides."""
    from trl import DPOConfig, DPOTrainer

    rows = CHAT if method == "dpo_chat" else PAIRS
    objective = preference.Objective(method.removesuffix("_chat"), BETA)
    loss, metrics, grads, ids = meshlm_side(bases, objective, rows, 48 if rows is CHAT else 16)
    policy, reference = hf_model(bases / "policy_hf"), hf_model(bases / "reference_hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bases / "policy_hf"))
    tokenizer.chat_template = BUILTIN_TEMPLATE
    # DPOConfig turns on bf16 by default (accelerate then wraps the forward in autocast): fp32 here, as meshlm.
    args = DPOConfig(output_dir=str(tmp_path), beta=BETA, loss_type=["ipo" if method == "ipo" else "sigmoid"],
                     report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=len(PAIRS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(model=policy, ref_model=reference, args=args,
                             train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS))])
    # The same tokens: TRL's rows (chosen first, then rejected) are meshlm's pairs' rows, up to padding.
    order = [2 * i for i in range(len(PAIRS))] + [2 * i + 1 for i in range(len(PAIRS))]
    for j, r in enumerate(order):
        real = batch["input_ids"][j][batch["attention_mask"][j].bool()]
        assert ids[r, :len(real)].tolist() == real.tolist()
    theirs = trainer._compute_loss(trainer.model, batch, False)
    theirs.backward()
    assert loss == pytest.approx(theirs.item(), rel=TOL)
    # A policy unlike the reference: the log-ratios are not zero.
    assert max(abs(metrics[k]) for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")) > 1e-3
    assert_metrics_equal(metrics, trainer._metrics["eval"])
    assert_grads_equal(grads, policy)


def test_simpo_equals_trl_cpo_trainer(bases, tmp_path):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    objective = preference.Objective("simpo", BETA, label_smoothing=0.1, gamma=0.7)
    loss, metrics, grads, _ids = meshlm_side(bases, objective)
    policy = hf_model(bases / "policy_hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bases / "policy_hf"))
    args = CPOConfig(output_dir=str(tmp_path), beta=BETA, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.7,
                     label_smoothing=0.1,
                     report_to=[], use_cpu=True, bf16=False, max_length=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = CPOTrainer(model=policy, args=args, train_dataset=datasets.Dataset.from_list(PAIRS),
                             processing_class=tokenizer)
    # CPO's labels: the ids with the prompt and padding at -100 (it shifts them itself); meshlm's targets are
    # already shifted (position j predicts token j + 1).
    tokens = get_tokenizer("gpt2")
    texts = [(p["prompt"], p["chosen"], p["rejected"]) for p in PAIRS]
    data = preference.encode_pairs(texts, ["x"] * len(texts), tokens, 16)
    batch = {}
    for k, name in enumerate(("chosen", "rejected")):
        ids_k = torch.from_numpy(data.ids[:, k])
        labels = torch.full_like(ids_k, -100)
        labels[:, 1:] = torch.from_numpy(data.targets[:, k, :-1])
        batch[f"{name}_input_ids"], batch[f"{name}_labels"] = ids_k, labels
        batch[f"{name}_attention_mask"] = torch.ones_like(ids_k)
    theirs, their_metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    theirs.backward()
    assert loss == pytest.approx(theirs.item(), rel=TOL)
    for key in preference.PART_NAMES:  # CPO averages the logits over every position: not compared
        assert metrics[key] == pytest.approx(their_metrics[key], rel=TOL, abs=TOL), key
    assert_grads_equal(grads, policy)
