"""Fine-tuning's parts that need no training: the metric math against hand-computed values (macro F1,
exact match, SQuAD F1, Pearson), metrics over padded micro-batches equal to those of the whole set, the
losses ignoring padding rows, the encoding of each task ([CLS]/[SEP], token types, first sub-token labels,
answer offsets, truncation), and the genre task built from the plays (split by play, balanced)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from meshlm.core.config import ConfigError
from meshlm.data.jsonl import Line
from meshlm.data.tokenizers import get_tokenizer
from meshlm.models.bert import (
    ClassifyLoss,
    SpanLoss,
    TokensLoss,
    best_spans,
    classify_loss,
    eval_metrics,
    macro_f1,
    span_scores,
)
from meshlm.train import finetune as ft
from tests.conftest import ROOT
from tests.train.finetune_helpers import save_base, write_jsonl


def logits_for(pred: list[int], num_labels: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(pred), num_labels).float() * 5


def parts_means(loss, batches) -> dict:
    """What the trainer hands `eval_metrics`: each part's mean over the micro-batches."""
    for output, targets in batches:
        loss(output, targets)
    total, n = loss.take()
    return dict(zip(loss.part_names, (total / n).tolist()))


# ---- metric math ----------------------------------------------------------------------------------------------
def test_macro_f1_and_accuracy_by_hand():
    gold = [0, 0, 1, 1, 2, 2]
    pred = [0, 1, 1, 1, 0, 2]
    # class 0: tp 1 fp 1 fn 1 → 1/2; class 1: tp 2 fp 1 fn 0 → 4/5; class 2: tp 1 fp 0 fn 1 → 2/3
    want_f1 = (1 / 2 + 4 / 5 + 2 / 3) / 3
    # num_labels 4: class 3 occurs nowhere and is left out of the mean (scikit-learn's macro average)
    loss = ClassifyLoss(4)
    ignored = [-100, -100]
    batches = [(logits_for(pred[:4], 4), torch.tensor(gold[:4])[:, None]),
               (logits_for(pred[4:] + [3, 3], 4), torch.tensor(gold[4:] + ignored)[:, None])]  # padded batch
    m = eval_metrics(parts_means(loss, batches), 0.0)
    assert m["val_accuracy"] == pytest.approx(4 / 6)
    assert m["val_f1"] == pytest.approx(want_f1)
    assert macro_f1([1, 2, 1, 0], [1, 1, 0, 0], [1, 0, 1, 0]) == pytest.approx(want_f1)
    assert macro_f1([0, 0], [0, 0], [0, 0]) == 0.0


def test_metrics_do_not_depend_on_how_the_set_is_cut():
    """Means over micro-batches of different real sizes (padding) give the whole set's ratios."""
    g = torch.Generator().manual_seed(0)
    gold = torch.randint(0, 3, (13,), generator=g)
    logits = torch.randn(13, 3, generator=g)
    whole = eval_metrics(parts_means(ClassifyLoss(3), [(logits, gold[:, None])]), 0.0)
    cut = []
    for s in range(0, 16, 4):
        lab = torch.full((4,), -100)
        out = torch.zeros(4, 3)
        real = gold[s:s + 4]
        lab[:len(real)], out[:len(real)] = real, logits[s:s + 4]
        cut.append((out, lab[:, None]))
    assert eval_metrics(parts_means(ClassifyLoss(3), cut), 0.0) == pytest.approx(whole)
    pred = logits.argmax(-1)
    assert whole["val_accuracy"] == pytest.approx((pred == gold).float().mean().item())


def test_losses_ignore_padding_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3, generator=g, requires_grad=True)
    labels = torch.tensor([[2], [0], [-100], [-100]])
    want = torch.nn.functional.cross_entropy(logits[:2], labels[:2, 0])
    assert ClassifyLoss(3)(logits, labels).item() == pytest.approx(want.item())
    all_ignored = classify_loss(logits, torch.full((4, 1), -100))
    assert all_ignored.item() == 0.0  # not NaN: a micro-batch of padding adds nothing
    all_ignored.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    out = torch.randn(2, 6, 2, generator=g)
    spans = torch.tensor([[1, 2, -100, -100], [-100, -100, -100, -100]])
    want = (torch.nn.functional.cross_entropy(out[:1, :, 0], spans[:1, 0])
            + torch.nn.functional.cross_entropy(out[:1, :, 1], spans[:1, 1])) / 2
    assert SpanLoss()(out, spans).item() == pytest.approx(want.item())


def test_span_exact_match_and_squad_f1_by_hand():
    ps, pe = torch.tensor([3, 2, 3, 3, 3, 0]), torch.tensor([5, 4, 3, 5, 3, 0])
    gold_s = torch.tensor([[2, -100], [2, -100], [1, -100], [2, 3], [2, -100], [0, -100]])
    gold_e = torch.tensor([[4, -100], [4, -100], [1, -100], [4, 5], [5, -100], [0, -100]])
    exact, f1 = span_scores(ps, pe, gold_s, gold_e)
    assert exact.tolist() == [False, True, False, True, False, True]
    # (3,5) vs (2,4): 2 shared of 3 and 3 → 2/3; (3,3) vs (2,5): P 1, R 1/4 → 0.4; no-answer [CLS] = [CLS]
    assert f1.tolist() == pytest.approx([2 / 3, 1.0, 0.0, 1.0, 0.4, 1.0])
    m = eval_metrics({"examples": 6, "exact_match": 3, "f1_sum": 2 / 3 + 1 + 1 + 0.4 + 1}, 0.0)
    assert m == pytest.approx({"val_exact_match": 0.5, "val_f1": (2 / 3 + 3.4) / 6})


def test_best_span_keeps_end_after_start():
    start = torch.tensor([[0.0, 4, 0, 0, 0, 5, 0, 0]])
    end = torch.tensor([[0.0, 0, 6, 0, 0, 0, 0, 1]])
    # the separate argmaxes (5, 2) are no span; the best pair with end >= start is (1, 2): 4 + 6
    s, e = best_spans(start, end)
    assert (s.item(), e.item()) == (1, 2)
    out = torch.stack([start, end], -1)
    loss = SpanLoss()
    loss(out, torch.tensor([[1, 2, -100, -100]]))
    assert eval_metrics(dict(zip(loss.part_names, loss.take()[0].tolist())), 0.0)["val_exact_match"] == 1.0


def test_tokens_metrics_skip_ignored_positions():
    out = logits_for([0, 1, 1, 2, 2, 0], 3).reshape(1, 6, 3)
    labels = torch.tensor([[-100, 1, 2, 2, -100, 0]])
    m = eval_metrics(parts_means(TokensLoss(3), [(out, labels)]), 0.0)
    # kept: (1→1) (1 vs 2) (2→2) (0→0): 3 of 4; F1: class0 1, class1 2/3, class2 2/3
    assert m["val_accuracy"] == pytest.approx(3 / 4)
    assert m["val_f1"] == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)


def test_regression_mse_and_pearson():
    pred = torch.tensor([1.0, 2.0, 2.5, 4.0, 0.0])
    gold = torch.tensor([1.5, 1.0, 3.0, 4.5, float("nan")])  # NaN: a padding row
    loss = ClassifyLoss(1)
    value = loss(pred[:, None], gold[:, None])
    assert value.item() == pytest.approx(float(((pred[:4] - gold[:4]) ** 2).mean()))
    m = eval_metrics(dict(zip(loss.part_names, loss.take()[0].tolist())), value.item())
    assert m["val_mse"] == pytest.approx(value.item())
    assert m["val_pearson"] == pytest.approx(np.corrcoef(pred[:4].numpy(), gold[:4].numpy())[0, 1], abs=1e-6)


# ---- encoding -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("bert")


def _lines(rows):
    return [Line(f"f.jsonl:{i + 1}", r) for i, r in enumerate(rows)]


def test_classify_pair_layout(tok):
    enc = ft.Encoder(tok, 16, truncate=False)
    labels = ft.Labels(2)
    data = ft.encode_classify(_lines([{"text": "hello world", "text_pair": "good day", "label": 1}]), labels,
                              enc, "--train")
    inputs, targets = ft.FinetuneDataset(data).collate(np.stack([ft.FinetuneDataset(data)[0]]))
    sp = tok.special_ids
    a, b = tok.encode("hello world"), tok.encode("good day")
    ids = [sp["cls"], *a, sp["sep"], *b, sp["sep"]]
    n = len(ids)
    assert inputs.shape == (1, 3, 16) and inputs.dtype == torch.int64
    assert inputs[0, 0].tolist() == ids + [sp["pad"]] * (16 - n)
    assert inputs[0, 1].tolist() == [0] * (len(a) + 2) + [1] * (len(b) + 1) + [0] * (16 - n)
    assert inputs[0, 2].tolist() == [1] * n + [0] * (16 - n)
    assert targets.tolist() == [[1]]


def test_too_long_is_refused_or_truncated(tok):
    long = {"text": "word " * 30, "label": 0}
    with pytest.raises(ConfigError, match=r"f.jsonl:1: the example is 32 tokens .* model.seq_len=16"):
        ft.encode_classify(_lines([long]), ft.Labels(2), ft.Encoder(tok, 16, False), "--train")
    data = ft.encode_classify(_lines([{**long, "text_pair": "a b c"}]), ft.Labels(2), ft.Encoder(tok, 16, True),
                              "--train")
    assert data.lens.tolist() == [[12, 16]]  # longest first: [CLS] 10 words [SEP] "a b c" [SEP]


def test_tokens_label_the_first_piece(tok):
    words = ["unbelievably", "cat", "xylophonist"]
    data = ft.encode_tokens(_lines([{"tokens": words, "labels": [1, 2, 3]}]), ft.Labels(4),
                            ft.Encoder(tok, 24, False), "--train")
    pieces = [tok.encode(w) for w in words]
    assert len(pieces[0]) > 1 and len(pieces[2]) > 1  # the test needs words split into several pieces
    want = [-100]
    for label, p in zip([1, 2, 3], pieces):
        want += [label] + [-100] * (len(p) - 1)
    want += [-100] * (24 - len(want))
    assert data.targets[0].tolist() == want


def test_span_answer_offsets_and_truncation(tok):
    context = "The old cat sat quietly on the red mat near the door."
    start = context.index("red mat")
    row = {"question": "where did it sit?", "context": context,
           "answers": {"text": ["red mat", "mat"], "answer_start": [start, start + 4]}}
    data = ft.encode_span(_lines([row]), ft.Encoder(tok, 32, False))
    s, e = data.targets[0, :2]
    assert tok.decode(data.ids[0, s:e + 1].tolist()) == "red mat"
    assert tok.decode(data.ids[0, data.targets[0, 2]:data.targets[0, 3] + 1].tolist()) == "mat"
    assert data.targets[0, 4:].tolist() == [-100, -100]  # no third answer
    none = {**row, "answers": {"text": [], "answer_start": []}}
    assert ft.encode_span(_lines([none]), ft.Encoder(tok, 32, False)).targets[0, :2].tolist() == [0, 0]
    # 12 positions: [CLS] question (5) [SEP] leaves 4 context tokens and a [SEP]; the answer is cut off
    with pytest.raises(ConfigError, match="f.jsonl:1: the example is"):
        ft.encode_span(_lines([row]), ft.Encoder(tok, 12, False))
    early = {**row, "answers": {"text": ["old cat"], "answer_start": [4]}}
    data = ft.encode_span(_lines([row, early]), ft.Encoder(tok, 12, True))
    assert data.dropped == 1 and len(data.ids) == 1
    bad = {**row, "answers": {"text": ["red mat"], "answer_start": [3]}}
    with pytest.raises(ConfigError, match="f.jsonl:1: answer \"red mat\" is not at character 3"):
        ft.encode_span(_lines([bad]), ft.Encoder(tok, 32, False))


def test_valid_set_is_padded_to_whole_micro_batches(tok):
    enc = ft.Encoder(tok, 8, False)
    data = ft.encode_classify(_lines([{"text": "a", "label": i % 2} for i in range(5)]), ft.Labels(2), enc,
                              "--train")
    padded = ft.FinetuneDataset(data).padded(4, enc)
    assert len(padded) == 8
    inputs, targets = padded.collate(np.stack([padded[i] for i in range(8)]))
    assert targets[:, 0].tolist() == [0, 1, 0, 1, 0, -100, -100, -100]
    assert inputs[5:, 2].sum(-1).tolist() == [2, 2, 2]  # [CLS] [SEP]: attention never sees an empty row


def test_string_labels_are_mapped_and_regression_labels_travel_as_floats(tmp_path, tok):
    labels = ft.resolve_labels([("t:1", "pos"), ("t:2", "neg")], [("v:1", "neg")], None, "--train")
    assert labels.names == ["neg", "pos"] and labels.num_labels == 2
    with pytest.raises(ConfigError, match="v:1: label \"meh\" does not occur in --train"):
        labels.to_id("meh", "v:1", "--train")
    reg = ft.resolve_labels([("t:1", 0.5), ("t:2", 3)], [("v:1", 1.25)], 1, "--train")
    data = ft.encode_classify(_lines([{"text": "a", "label": 0.5}, {"text": "b", "label": 3}]), reg,
                              ft.Encoder(tok, 8, False), "--train")
    ds = ft.FinetuneDataset(data)
    _, targets = ds.collate(np.stack([ds[0], ds[1]]))
    assert targets.dtype == torch.float32 and targets[:, 0].tolist() == [0.5, 3.0]


def test_config_follows_the_data_and_the_user(tmp_path):
    base = save_base(tmp_path / "base")
    train = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b", "label": i % 3} for i in range(100)])
    valid = write_jsonl(tmp_path / "v.jsonl", [{"text": "a b", "label": i % 3} for i in range(21)])
    args = ft.FinetuneOptions(checkpoint=str(base), task="classify", train=str(train), valid=str(valid),
                              out=str(tmp_path / "out"), epochs=2, truncate=False)
    cfg, _, train_set, valid_set, info = ft.prepare(args, ["--train.micro_batch_size=8"])
    m, t, o = cfg.model, cfg.train, cfg.optim
    assert (m.bert_head, m.num_labels, m.hidden_size) == ("classify", 3, 32)
    assert t.init_from == str(base) and t.out_dir == str(tmp_path / "out")
    assert (t.global_batch_size, t.micro_batch_size) == (32, 8)
    assert t.max_steps == 2 * math.ceil(100 / 32) and t.eval_every == 4 and o.warmup_steps == 1
    assert len(train_set) == 100 and len(valid_set) == 24 and t.eval_iters == 3  # 21 examples in 3 micro-batches of 8, each seen once
    assert (o.lr, o.decay) == (1e-4, "linear")
    cfg2 = ft.prepare(args, ["--train.max_steps=5", "--train.eval_iters=1", "--optim.lr=3e-4"])[0]
    assert (cfg2.train.max_steps, cfg2.train.eval_iters, cfg2.optim.lr) == (5, 1, 3e-4)
    assert not (tmp_path / "out").exists()  # preparing writes nothing
    assert info["num_labels"] == 3 and json.dumps(info)


# ---- the genre task -----------------------------------------------------------------------------------------
def _genre_module():
    spec = importlib.util.spec_from_file_location("make_genre_task", ROOT / "scripts" / "make_genre_task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_genre_task_splits_by_play_and_balances_classes(tmp_path):
    mg = _genre_module()
    folio = [p for plays in mg.FOLIO.values() for p in plays]
    assert len(folio) == len(set(folio)) == 36
    assert "troilus_and_cressida" in mg.FOLIO["tragedy"] and "cymbeline" in mg.FOLIO["tragedy"]
    assert "pericles" not in folio and set(mg.play_files()) == set(folio)
    summary = mg.make_task(tmp_path / "a", train_per_class=30, valid_per_class=12, seed=3)
    rows = {s: [json.loads(x) for x in (tmp_path / "a" / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "valid")}
    train_plays = {r["play"] for r in rows["train"]}
    valid_plays = {r["play"] for r in rows["valid"]}
    assert not train_plays & valid_plays  # held-out plays only in validation
    assert valid_plays == {p for ps in summary["valid_plays"].values() for p in ps} and len(valid_plays) == 9
    for split, n in (("train", 30), ("valid", 12)):
        counts = {g: sum(r["label"] == g for r in rows[split]) for g in mg.GENRES}
        assert counts == dict.fromkeys(mg.GENRES, n)
    genre_of = {p: g for g, plays in mg.FOLIO.items() for p in plays}
    assert all(genre_of[r["play"]] == r["label"] for s in rows.values() for r in s)
    for r in rows["valid"]:
        assert r["text"].count("\n") == 3 and "[" not in r["text"] and not any(
            line.isupper() and line.endswith(".") for line in r["text"].splitlines())
    mg.make_task(tmp_path / "b", train_per_class=30, valid_per_class=12, seed=3)
    assert (tmp_path / "a" / "train.jsonl").read_bytes() == (tmp_path / "b" / "train.jsonl").read_bytes()


def test_genre_passages_drop_speakers_and_directions():
    mg = _genre_module()
    text = ("TITLE\n\nACT I.\n\nSCENE I. A room.\n\n[Enter HAMLET and\nHORATIO.]\n\nHAMLET.\nTo be, or not to be,\n"
            "[Aside.] that is the question.\n\nHor.\nMy lord?\n\nPAGE. My lord, 'tis begun.\n\nSCENE II. Hall.\n\n"
            "PUCK\nI go, I go.\n")
    assert mg.scenes(text) == [["To be, or not to be,", "that is the question.", "My lord?", "My lord, 'tis begun."],
                               ["I go, I go."]]


def test_max_length_pads_shorter_than_the_model(tmp_path):
    base = save_base(tmp_path / "base")  # model.seq_len 16
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c", "label": i % 2} for i in range(4)])
    args = ft.FinetuneOptions(checkpoint=str(base), task="classify", train=str(data), valid=str(data),
                              out=str(tmp_path / "out"), epochs=1, truncate=False, max_length=8)
    cfg, _, train_set, _, info = ft.prepare(args, [])
    inputs, _ = train_set.collate(np.stack([train_set[0]]))
    assert inputs.shape == (1, 3, 8) and cfg.model.seq_len == 16 and info["max_length"] == 8
    for bad in (17, 1):
        with pytest.raises(ConfigError, match=f"--max-length {bad} must be in 2..16"):
            ft.prepare(dataclasses.replace(args, max_length=bad), [])
