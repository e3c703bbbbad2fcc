"""`meshlm align --method grpo|rloo` end to end on a tiny GPT (random weights, the GPT-2 tokenizer): the reward
rises, the engine samples from the very weights being trained (its log-probs of the sampled tokens equal the
trainer's recomputed ones after every update), the metrics are logged, and bad input is one line, exit 2,
nothing written."""

from __future__ import annotations

import json

import pytest
import torch

from tests.checkpoint_helpers import load_run
from tests.tune.tune_helpers import GPT2, run, save_base, write_jsonl

SPACES = "tests.tune.grpo_rewards:spaces"
SMALL = ["--max-completion-length", "8", "--prompts-per-step", "2", "--num-generations", "4", "--top-k", "4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    save_base(root / "base", {**GPT2, "seq_len": 48})
    write_jsonl(root / "p.jsonl", [{"prompt": f"say {w}:"} for w in ("red", "blue", "green", "gold")])
    return root


def grpo(data, out, *extra: str, method: str = "grpo", train=None):
    return run("align", "--method", method, "--checkpoint", str(data / "base"), "--train", str(train or
               data / "p.jsonl"), "--out", str(out), *extra)


def rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_raises_the_reward_with_the_engine_on_the_trained_weights(data, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = grpo(data, out, "--reward", SPACES, "--steps", "8", "--lr", "3e-3", *SMALL)
    assert code == 0, err
    got = rows(out)
    assert [r["step"] for r in got] == list(range(1, 9))
    first, last = sum(r["reward"] for r in got[:2]) / 2, sum(r["reward"] for r in got[-2:]) / 2
    assert last > first + 0.05, (first, last)
    # after each update the engine's log-probs are still the trainer's: it runs the updated module itself
    assert all(r["logprob_mismatch_max"] < 1e-5 for r in got), [r["logprob_mismatch_max"] for r in got]
    for key in ("loss", "advantage_std", "clip_ratio/region_mean", "completion_length",
                "frac_reward_zero_std", "rollout_tokens_per_s", "train_tokens_per_s", "generation_s", "training_s",
                f"rewards/{SPACES}/mean", f"rewards/{SPACES}/std"):
        assert key in got[0], key
    assert got[0]["completion_length"] <= 8
    assert json.loads((out / "grpo.json").read_text())["method"] == "grpo" and (out / "tensorboard").is_dir()
    assert got[-1]["tokens"] == sum(r["completion_tokens"] for r in got)
    assert "step 8: reward" in stdout
    trained, base = load_run(str(out))[0], load_run(str(data / "base"))[0]  # DIR's checkpoint: the trained model
    moved = [n for n, p in trained.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert "tok_emb.weight" in moved and len(moved) == len(list(base.parameters()))


@pytest.mark.parametrize("method,extra", [("grpo", ["--loss-type", "dapo", "--epsilon-high", "0.28", "--beta", "0.04",
                                                    "--num-iterations", "2", "--scale-rewards", "none"]),
                                          ("rloo", ["--beta", "0.05"])])
def test_variants_run_with_kl_and_several_passes(data, tmp_path, method, extra):
    out = tmp_path / method
    code, _, err = grpo(data, out, "--reward", SPACES, "--steps", "2", "--lr", "1e-3", *SMALL, *extra, method=method)
    assert code == 0, err
    got = rows(out)
    assert len(got) == 2 and all(r["logprob_mismatch_max"] < 1e-5 for r in got)
    if method == "grpo":
        assert got[0]["kl"] >= 0 and got[1]["kl"] > 0  # k3 KL to the frozen copy, positive once the weights moved


def test_a_failing_reward_fails_its_rows_not_the_run(data, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = grpo(data, out, "--reward", SPACES, "--reward", "tests.tune.grpo_rewards:boom",
                             "--reward-weights", "1", "0.5", "--steps", "1", *SMALL)
    assert code == 0, err
    assert "reward tests.tune.grpo_rewards:boom raised KeyError: 'answer' on " in stdout
    assert f"{data / 'p.jsonl'}:1 (completion 1)" in stdout
    assert rows(out)[0]["reward_failures"] == 8


NO_GENERATION_PROMPT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
BAD = {
    "module": (["--reward", "no_such_module_xyz:f"], "module 'no_such_module_xyz' does not import"),
    "text": (["--reward", "tests.tune.grpo_rewards:text"], "returned str 'high'"),
    "one_generation": (["--reward", SPACES, "--num-generations", "1"], "--num-generations 1"),
    "empty_prompt": (["--reward", SPACES], "p_bad.jsonl:2: 'prompt' is"),
    "no_generation_prompt": (["--reward", SPACES, "--chat-template", NO_GENERATION_PROMPT], "adds no generation prompt"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_exit_2_nothing_written(data, tmp_path, case):
    extra, message = BAD[case]
    train = None
    if case == "empty_prompt":
        train = write_jsonl(tmp_path / "p_bad.jsonl", [{"prompt": "ok"}, {"prompt": ""}])
    if case == "no_generation_prompt":
        train = write_jsonl(tmp_path / "p_chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    out = tmp_path / "out"
    code, stdout, err = grpo(data, out, *SMALL, *extra, train=train)
    assert code == 2, (stdout, err)
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_builtin_rewards_read_the_answer_after_the_marker():
    from meshlm.tune import rewards as r

    row = {"answer": "1,234"}
    assert r.exact_number("", "so 12 then #### 1234.0 done", row) == 1.0
    assert r.exact_number("", "#### 12 #### 1234", row) == 1.0  # the last marker counts
    assert r.exact_number("", "1234 without a marker", row) == 0.0
    assert r.exact_number("", "#### 1235", row) == 0.0
    assert r.exact_number("", "ANSWER: -3.5", {"answer": -3.5, "marker": "ANSWER:"}) == 1.0
    assert r.exact_string("", "thinking\n####  Paris \n", {"answer": "Paris"}) == 1.0
    assert r.exact_string("", "#### paris", {"answer": "Paris"}) == 0.0
    assert r.format_regex("", "because 2 + 2\n#### 4", {}) == 1.0
    assert r.format_regex("", "#### 4", {}) == 0.0  # no reasoning line before the answer
    assert r.format_regex("", "<a>x</a>", {"format": r"<a>.*</a>"}) == 1.0


def test_lora_reference_is_the_base_with_the_adapter_off(data, tmp_path):
    """--adapter lora: the adapter starts at zero, so step 1's KL to the reference (the model with its adapter
    off) is exactly 0 and later ones are not; only the adapted rows of q and v move, merged into DIR's model."""
    out = tmp_path / "lora"
    code, _, err = grpo(data, out, "--reward", SPACES, "--steps", "2", "--lr", "1e-2", "--adapter", "lora",
                        "--beta", "0.04", "--tune.lora_rank=4", *SMALL)
    assert code == 0, err
    got = rows(out)
    assert got[0]["kl"] == 0.0 and got[1]["kl"] > 0
    assert all(r["logprob_mismatch_max"] < 1e-5 for r in got)
    trained, base = load_run(str(out))[0], load_run(str(data / "base"))[0]
    moved = {n for n, p in trained.named_parameters() if not torch.equal(p, base.get_parameter(n))}
    assert moved == {"layers.0.attn.qkv.weight", "layers.1.attn.qkv.weight"}
    h = GPT2["hidden_size"]
    for n in moved:  # the key rows (the middle third of the fused [q; k; v]) are untouched
        assert torch.equal(trained.get_parameter(n)[h:2 * h], base.get_parameter(n)[h:2 * h])
        assert not torch.equal(trained.get_parameter(n)[:h], base.get_parameter(n)[:h])
