"""The GRPO task's data (benchmarks/grpo_task_data.py: held-out problems unseen by source, answers right) and a
GRPO run's --out: the same directory again resumes exactly; a finished run, other flags or a directory of
something else are refused in one line, nothing written."""

from __future__ import annotations

import re
import sys

import pytest

from tests.conftest import ROOT
from tests.tune.tune_helpers import GPT2, run, save_base, write_jsonl

sys.path.insert(0, str(ROOT / "benchmarks"))
import grpo_task_data as task  # benchmarks/ is not a package


def _sentence_shape(text: str) -> str:
    """The problem's template: numbers and names blanked."""
    names = "|".join(task.TRAIN_NAMES + task.TEST_NAMES)
    return re.sub(rf"\b({names})\b", "N", re.sub(r"\d+", "#", text))


def test_held_out_problems_come_from_other_templates_and_names():
    train, test = task.rows("train", 200, 0, "addsub"), task.rows("test", 100, 0, "addsub")
    user = [r["prompt"][-1]["content"] for r in train], [r["prompt"][-1]["content"] for r in test]
    assert not {_sentence_shape(t) for t in user[0]} & {_sentence_shape(t) for t in user[1]}
    train_names = {w for t in user[0] for w in re.findall(r"[A-Z][a-z]+", t)}
    assert not train_names & set(task.TEST_NAMES)
    assert task.rows("test", 5, 0) == task.rows("test", 5, 0) and task.rows("test", 5, 0) != task.rows("test", 5, 1)


@pytest.mark.parametrize("ops", ["add", "addsub", "two"])
def test_answers_are_the_arithmetic_of_the_sentence(ops):
    for r in task.rows("train", 50, 3, ops) + task.rows("test", 50, 3, ops):
        text = r["prompt"][-1]["content"]
        numbers = [int(x) for x in re.findall(r"\d+", text)]
        minus = re.search(r"\b(lost|ate|spends|gives|burns)\b", text) is not None
        assert (not minus) or ops != "add"
        want = numbers[0] - numbers[1] if minus else numbers[0] + numbers[1]
        if ops == "two":
            want += numbers[2]
        assert r["answer"] == want, text


def _grpo(base, prompts, out, *extra):
    return run("align", "--method", "grpo", "--checkpoint", str(base), "--train", str(prompts), "--out", str(out),
               "--reward", "tests.tune.grpo_rewards:spaces", "--prompts-per-step", "2", "--num-generations", "2",
               "--max-completion-length", "6", "--top-k", "4", "--lr", "3e-3", *extra)


def _files(out):
    return {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}


@pytest.fixture()
def tiny(tmp_path):
    save_base(tmp_path / "base", {**GPT2, "seq_len": 32})
    words = ["red", "blue", "green"]
    return tmp_path / "base", write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"say {w}:"} for w in words])


@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_resume_is_exact(tiny, tmp_path, adapter):
    """4 steps at once, and 2 steps then the same --out again with --steps 4 (a stray step-3 row in its
    metrics.jsonl, as a run killed after logging it would leave): the same rollouts, losses and weights."""
    import json

    import torch

    from tests.checkpoint_helpers import load_run

    base, prompts = tiny
    extra = ["--adapter", adapter, "--beta", "0.04", "--save-every", "2"]
    code, _, err = _grpo(base, prompts, tmp_path / "whole", "--steps", "4", *extra)
    assert code == 0, err
    code, _, err = _grpo(base, prompts, tmp_path / "parts", "--steps", "2", *extra)
    assert code == 0, err
    with open(tmp_path / "parts" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "train", "step": 3, "loss": 123.0}) + "\n")
    code, stdout, err = _grpo(base, prompts, tmp_path / "parts", "--steps", "4", *extra)
    assert code == 0, err
    assert "resuming after step 2" in stdout

    def rows(out):
        return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "loss", "reward", "grad_norm", "kl", "completion_tokens", "tokens", "logprob_mismatch_max")
    whole, parts = rows(tmp_path / "whole"), rows(tmp_path / "parts")
    assert [r["step"] for r in parts] == [1, 2, 3, 4]
    assert [{k: r[k] for k in keys} for r in parts] == [{k: r[k] for k in keys} for r in whole]
    a, b = load_run(str(tmp_path / "whole"))[0].state_dict(), load_run(str(tmp_path / "parts"))[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base_state = load_run(str(base))[0].state_dict()
    assert any(not torch.equal(a[k], base_state[k]) for k in base_state)  # it trained


def _one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_a_finished_run_another_runs_or_other_flags_are_refused(tiny, tmp_path):
    base, prompts = tiny
    out = tmp_path / "run"
    code, _, err = _grpo(base, prompts, out, "--steps", "1")
    assert code == 0, err
    before = _files(out)
    cases = [(["--steps", "1"], "already run 1 steps"), (["--steps", "2", "--lr", "1e-3"], "other settings (lr)")]
    for extra, message in cases:
        code, _, err = _grpo(base, prompts, out, *extra)
        assert code == 2 and message in _one_line(err) and "--out" in err, err
        assert _files(out) == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    code, _, err = _grpo(base, prompts, other, "--steps", "1")
    assert code == 2 and "holds no GRPO run to resume" in _one_line(err), err
    assert _files(other) == {other / "notes.txt": b"mine"}


def test_engine_and_trainer_logprobs_agree_when_the_forward_is_fp64(tmp_path):
    """The engine/trainer log-prob mismatch is the rounding of fp32 forwards (different summation orders), not
    a difference of the two computations: with the model in float64 both paths' logits agree far below fp32's
    resolution, so the sampled tokens' log-probs (computed from fp32 logits on both sides) are equal, and in
    fp32 the two differ by no more than the trainer differs from itself between a padded batch and single rows."""
    import torch

    from meshlm.commands.align import engine_sampler
    from meshlm.tune.grpo import Prompt, Rollout, batch_rows, mismatch, token_logps
    from tests.checkpoint_helpers import load_run

    save_base(tmp_path / "base", {**GPT2, "seq_len": 32, "n_layers": 4})
    model, tok, _ = load_run(str(tmp_path / "base"))
    prompts = [tok.encode(t) for t in ("say red:", "a longer prompt than that one:", "x")]
    for dtype in (torch.float64, torch.float32):
        model = model.to(dtype)
        out = engine_sampler(model, tok, 3, 32)(prompts, 12, 1.0, 0, [7, 8, 9])
        ro = Rollout([Prompt("p", "", p, {}) for p in prompts], [o for o, _ in out], [""] * 3, [lp for _, lp in out],
                     0.0)
        ids, where, mask, tokens = batch_rows(ro, tok.eod_id)
        with torch.no_grad():
            batched = token_logps(model, ids, where, tokens)
            single = [token_logps(model, ids[b:b + 1, :len(p) + len(c)], where[b:b + 1], tokens[b:b + 1])
                      for b, (p, c) in enumerate(zip(prompts, ro.ids))]
        worst, _, _ = mismatch(ro.engine_logps, batched, mask)
        if dtype == torch.float64:
            assert worst == 0.0
        else:
            self_diff = max(float(((s - batched[b:b + 1]).abs() * mask[b:b + 1]).max()) for b, s in enumerate(single))
            assert worst < 1e-5 and self_diff < 1e-5, (worst, self_diff)
