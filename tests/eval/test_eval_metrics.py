"""Each metric on cases computed by hand (stub models whose logits are known by construction) and by brute
force (the model run on exactly each token's context): sliding-window and non-overlapping perplexity, the
two cloze accuracies, length-normalised choice accuracy, macro F1; batch size 1 equals batch size N."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meshlm.data.items import DataError
from meshlm.eval import tasks
from meshlm.eval.scorer import Scorer, plain_forward, windows
from tests.eval.eval_helpers import (
    ALPHABET,
    BigramModel,
    CharTokenizer,
    ContextModel,
    UnigramModel,
    close,
    last_logprob,
)

TOK = CharTokenizer()
V = TOK.vocab_size
# p(a) = .5, p(b) = .2, p(' ') = .15, p(c) = .1, p('\n') = .04, p(eod) = .01
PROBS = [0.5, 0.2, 0.15, 0.1, 0.04, 0.01]
P = dict(zip(ALPHABET, PROBS))


def scorer(model, seq_len: int = 8, batch_size: int = 4) -> Scorer:
    return Scorer(plain_forward(model, V), seq_len, TOK, batch_size)


# ---- windows and perplexity -------------------------------------------------------------------------------
@pytest.mark.parametrize("n,seq_len,stride", [(1, 4, 4), (10, 4, 1), (10, 4, 3), (10, 4, 4), (23, 8, 5), (3, 8, 2)])
def test_windows_score_every_token_once_with_its_window_context(n, seq_len, stride):
    tokens = list(range(100, 100 + n))
    stream = [7, *tokens]
    seen = []
    for inputs, targets in windows(tokens, 7, seq_len, stride):
        assert len(inputs) == len(targets) <= seq_len
        for k, t in enumerate(targets):
            if t >= 0:
                # target t follows inputs[: k + 1] in the stream: the inputs are the stream just before it
                j = stream.index(t)
                assert stream[j - k - 1:j] == inputs[: k + 1]
                seen.append(t)
    assert seen == tokens


def brute_force_nll(model, tokens: list[int], seq_len: int, context_start) -> float:
    """Σ −log p(token i | stream[context_start(i) : i]) over the stream [eod] + tokens, one forward per token."""
    stream = [TOK.eod_id, *tokens]
    return -sum(last_logprob(model, stream[context_start(i):i], stream[i]) for i in range(1, len(stream)))


def test_sliding_window_equals_brute_force_per_token():
    model = ContextModel(V, seed=3)
    text = "ab c\nabba cab\nc a bc abc\n" * 2
    tokens = TOK.encode(text)
    L = 8
    s = scorer(model, L)
    # stride 1: every token gets the longest context that fits, the L tokens before it
    got = -s.score_windows([windows(tokens, TOK.eod_id, L, 1)])[0].sum()
    assert close(got, brute_force_nll(model, tokens, L, lambda i: max(0, i - L)))
    # stride L: blocks of L tokens, each token's context starts at its block's start
    got = -s.score_windows([windows(tokens, TOK.eod_id, L, L)])[0].sum()
    last = len(tokens)
    ends = [min(L * k, last) for k in range(1, last // L + 2)]

    def block_start(i):
        end = next(e for e in ends if e >= i)
        return max(0, end - L)

    assert close(got, brute_force_nll(model, tokens, L, block_start))
    # the two differ: context matters to this model, so the test can tell the windows apart
    assert not close(brute_force_nll(model, tokens, L, lambda i: max(0, i - L)),
                     brute_force_nll(model, tokens, L, block_start), 1e-6)


def test_perplexity_metrics_by_hand():
    text = "ab a\nc"  # 6 tokens, 3 words, 6 bytes
    lp = sum(math.log(P[c]) for c in text)
    out = tasks.run_perplexity(scorer(UnigramModel(PROBS)), [text], stride=2)
    assert (out["tokens"], out["words"], out["bytes"]) == (6, 3, 6)
    assert close(out["perplexity"], math.exp(-lp / 6))
    assert close(out["word_perplexity"], math.exp(-lp / 3))
    assert close(out["bits_per_byte"], -lp / math.log(2) / 6)
    assert close(out["perplexity_nonoverlapping"], out["perplexity"])  # a unigram model ignores context
    assert out["stride"] == 2 and out["seq_len"] == 8


def test_perplexity_sliding_and_nonoverlapping_differ_with_context():
    model = ContextModel(V, seed=1)
    text = "abc ab\nca b" * 3
    out = tasks.run_perplexity(scorer(model, 8), [text], stride=2)
    tokens = TOK.encode(text)
    assert close(math.log(out["perplexity"]) * len(tokens),
                 brute_force_nll(model, tokens, 8, lambda i: _stride_start(i, len(tokens), 8, 2)))
    assert not close(out["perplexity"], out["perplexity_nonoverlapping"], 1e-6)


def _stride_start(i: int, last: int, L: int, S: int) -> int:
    """The context start of stream token i under windows ending at L, L+S, ... (the last at the stream's end)."""
    end = min(L, last)
    while end < i:
        end = min(end + S, last)
    return max(0, end - L)


def test_stride_is_checked():
    with pytest.raises(Exception, match="--stride 9 must be in 1..8"):
        tasks.run_perplexity(scorer(UnigramModel(PROBS)), ["ab"], stride=9)


# ---- cloze ----------------------------------------------------------------------------------------------------
def test_cloze_two_accuracies_and_perplexity_by_hand(tmp_path):
    # BigramModel's greedy next tokens: a→b, b→' ', ' '→a, c→' '.
    # "c a": ' ' after c right, a after ' ' right: a whole-word hit and a last-token hit.
    # "a ab": ' ' after a wrong (b), a right, b after a right: a whole-word miss, a last-token hit.
    # "c aa": ' ' right, a right, a after a wrong (b): a miss in both.
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "c a"}\n{"text": "a ab"}\n{"text": "c aa"}\n')
    model = BigramModel()
    out = tasks.run_cloze(scorer(model), tasks.read_cloze(str(path)))
    assert out["examples"] == 3
    assert close(out["accuracy_whole_word"], 1 / 3) and out["accuracy"] == out["accuracy_whole_word"]
    assert close(out["accuracy_last_token"], 2 / 3)
    p = model.prob
    lls = [math.log(p("c", " ") * p(" ", "a")), math.log(p("a", " ") * p(" ", "a") * p("a", "b")),
           math.log(p("c", " ") * p(" ", "a") * p("a", "a"))]
    assert close(out["perplexity"], math.exp(-sum(lls) / 3))


def test_cloze_needs_two_words(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "c a"}\n{"text": "  lonely "}\n')
    with pytest.raises(DataError, match=r"c.jsonl:2: 'text' .* has fewer than two words"):
        tasks.read_cloze(str(path))


# ---- multiple choice ------------------------------------------------------------------------------------------
def test_choice_accuracy_and_length_normalised_by_hand(tmp_path):
    # choice " aaa" (ll = log .15·.5³ = −4.89, −1.22/char of "aaa" ... ) vs " b" (log .15·.2 = −3.51):
    # " b" has the higher log-likelihood; per character of the choice "aaa" wins (−4.89/3 > −3.51/1).
    path = tmp_path / "m.jsonl"
    rows = ['{"context": "c", "choices": ["aaa", "b"], "label": 0}',
            '{"context": "c", "choices": ["aaa", "b"], "label": 1}',
            '{"context": "c\\n", "choices": ["c", "a"], "label": 1}']
    path.write_text("\n".join(rows) + "\n")
    ll_aaa, ll_b = math.log(P[" "] * P["a"] ** 3), math.log(P[" "] * P["b"])
    assert ll_b > ll_aaa and ll_aaa / 3 > ll_b / 1  # the case is what the comment says
    out = tasks.run_choice(scorer(UnigramModel(PROBS)), tasks.read_choice(str(path)))
    # item 1: acc miss (b wins), norm hit; item 2: acc hit, norm miss; item 3 (no space after "\n"): a wins both
    assert out["examples"] == 3
    assert close(out["accuracy"], 2 / 3)
    assert close(out["accuracy_norm"], 2 / 3)
    one = tasks.run_choice(scorer(UnigramModel(PROBS)), tasks.read_choice(str(path))[:1])
    assert (one["accuracy"], one["accuracy_norm"]) == (0.0, 1.0)


def test_choice_continuation_is_scored_after_the_context():
    model = ContextModel(V, seed=2)
    ctx, cont = TOK.encode("ab c"), TOK.encode(" ba")
    (ll, _, lp, _), = scorer(model, 16).continuation([(ctx, cont)])
    stream = ctx + cont
    want = [last_logprob(model, stream[:i], stream[i]) for i in range(len(ctx), len(stream))]
    assert np.allclose(lp, want, rtol=0, atol=1e-12) and close(ll, sum(want))
    # a context longer than the model's: cut from the left to seq_len + 1 tokens with the continuation
    long_ctx = TOK.encode("abc a b c\nab")
    (ll, _, lp, _), = scorer(model, 8).continuation([(long_ctx, cont)])
    stream = (long_ctx + cont)[-9:]
    want = [last_logprob(model, stream[:i], stream[i]) for i in range(9 - len(cont), 9)]
    assert np.allclose(lp, want, rtol=0, atol=1e-12)


# ---- classification -------------------------------------------------------------------------------------------
def test_classify_metrics_by_hand():
    gold = np.array([0, 0, 1, 1, 2, 2])
    pred = np.array([0, 1, 1, 1, 0, 2])
    out = tasks.classify_metrics(pred, gold, 4)  # class 3 occurs nowhere: left out of the macro mean
    # class 0: tp 1 fp 1 fn 1 → 2/4; class 1: tp 2 fp 1 fn 0 → 4/5; class 2: tp 1 fp 0 fn 1 → 2/3
    assert close(out["accuracy"], 4 / 6)
    assert close(out["f1"], (0.5 + 0.8 + 2 / 3) / 3)


# ---- batching -------------------------------------------------------------------------------------------------
def test_batch_size_one_equals_batch_size_n(tmp_path):
    model = ContextModel(V, seed=5)
    path = tmp_path / "m.jsonl"
    rows = ['{"context": "ab", "choices": ["aaa c", "b", "cc a b"], "label": 2}',
            '{"context": "c c c a", "choices": ["a", "bb"], "label": 0}',
            '{"context": "", "choices": ["ab", "ba", "c"], "label": 1}']
    path.write_text("\n".join(rows) + "\n")
    items = tasks.read_choice(str(path))
    text = ["abc ab\nca b" * 4, "cab a"]
    results = []
    for b in (1, 3, 16):
        s = scorer(model, 8, batch_size=b)
        pairs = [tasks.encode_pair(TOK, c, tasks.joined(c, x)) for _, c, xs, _ in items for x in xs]
        results.append(([r[0] for r in s.continuation(pairs)], tasks.run_perplexity(s, text, 3)["perplexity"]))
    for lls, ppl in results[1:]:
        assert np.allclose(lls, results[0][0], rtol=0, atol=1e-12)
        assert close(ppl, results[0][1], 1e-12)


def test_greedy_is_the_argmax():
    model = ContextModel(V, seed=7)
    s = scorer(model, 8)
    inputs = TOK.encode("abc a b")
    (scored,) = s.score([(inputs, [-1] * len(inputs))])
    with torch.no_grad():
        want = model(torch.tensor([inputs]))[0].argmax(-1).numpy()
    assert (scored.greedy == want).all()
    assert (scored.logprobs == 0).all()  # targets −1 are not scored
