"""The fourth reliability round (issue 48, item 4; docs/reliability.md, "Round 4"): a checkpoint that disagrees
with itself (its weights with its config.json, its step across its name, manifest and state.pt) is invalid like
a torn or NaN one, a checkpoint of another shape is one line, and bad inputs are refused early in one line.
The serving cases are in test_rel_round4_serving.py.
"""

from __future__ import annotations

import io
import os
import shutil

import pytest
import torch

from meshlm.checkpoint.single import resolve_checkpoint
from meshlm.core.config import ConfigError, ModelConfig
from meshlm.core.errors import CheckpointError
from meshlm.families.registry import get_spec
from meshlm.models.gpt import GPT
from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config
from tests.interop.interop_helpers import one_error_line
from tests.reliability.test_rel_manifest import STEP1, STEP2, edit_manifest, replace, resumed_step
from tests.reliability.threads import _one_thread  # noqa: F401 (autouse: one intra-op thread)
from tests.reliability.trained_run import small
from tests.tune.test_align import align_args, assert_one_error, data  # noqa: F401 (`data`: the fixture)
from tests.tune.test_chat_sft import chat, chat_rows  # noqa: F401 (`chat`: the fixture)
from tests.tune.tune_helpers import run, write_jsonl


def torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def other_model_weights(step_dir) -> None:
    """Step `step_dir`'s model.pt replaced by a model of another width (hidden 16, not 32), its manifest
    recomputed: every file matches its entry, only the weights disagree with config.json."""
    torch.manual_seed(0)
    other = GPT(ModelConfig(n_layers=2, hidden_size=16, n_heads=4, seq_len=32, vocab_size=50257))
    replace(step_dir / "model.pt", torch_bytes(other.state_dict()))
    edit_manifest(step_dir, recompute=["model.pt"])


# ---- a step whose weights disagree with its own config.json -----------------------------------------------
def test_a_step_whose_weights_disagree_with_its_config_falls_back_and_is_named(copy, capsys):
    """Resume, generate and convert pass over it like a NaN step (issue 48: no fallback, a 60-line
    `size mismatch` traceback, and `convert --to-single` wrote such weights without a word)."""
    step2 = copy / "checkpoints" / STEP2
    other_model_weights(step2)
    step, out = resumed_step(copy, capsys)
    assert step == 1, "the previous valid step, as for NaN weights"
    assert f"names {STEP2}, which disagrees with its config.json (tensor 'tok_emb.weight' is [50257, 16] in its " \
           "weights but its config.json implies [50257, 32]" in out, out
    with pytest.raises(CheckpointError, match=r"disagrees with its config.json \(tensor 'tok_emb.weight'"):
        resolve_checkpoint(step2, spec_of=get_spec)
    line = one_error_line(["convert", "--checkpoint", str(step2), "--to-single", str(copy / "single")],
                          "tok_emb.weight", "[50257, 16]", "[50257, 32]")
    assert "disagrees with its config.json" in line and not (copy / "single").exists()
    one_error_line(["generate", "--checkpoint", str(step2), "--prompt", "a", "--max-new-tokens", "2"],
                   "tok_emb.weight", "[50257, 16]", "[50257, 32]")


def test_generate_on_the_run_directory_falls_back_past_it(copy, capsys):
    from meshlm.cli import main

    other_model_weights(copy / "checkpoints" / STEP2)
    assert main(["generate", "--checkpoint", str(copy), "--prompt", "a", "--max-new-tokens", "2",
                 "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert f"{STEP2}, which disagrees with its config.json" in err and f"using {copy / 'checkpoints' / STEP1}" in err


def test_resuming_with_another_model_shape_is_one_line_naming_both_shapes(copy):
    """The checkpoints are fine; the run asks for hidden 64: one line with the tensor, both shapes and the fix
    (it was load_state_dict's traceback)."""
    cfg = tiny_config(copy, model={"hidden_size": 64}, train={"max_steps": 3, "save_every": 1, "sample_tokens": 0})
    with pytest.raises(CheckpointError) as err:
        Trainer(cfg)
    text = str(err.value)
    assert "\n" not in text and "tensor 'tok_emb.weight' is [50257, 32] there and [50257, 64] in this run's" in text
    assert "model.* settings of its config.json" in text and "train.out_dir" in text


# ---- the step: directory name, manifest, state.pt ------------------------------------------------------------
def set_manifest_step(step_dir, step: int) -> None:
    import json

    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["step"] = step
    replace(step_dir / "manifest.json", json.dumps(manifest).encode())


def test_an_edited_manifest_step_is_invalid_without_rename_advice_and_pruned_once_renamed(copy, capsys):
    """Issue 48: a manifest's step edited to 99 was called "misnamed, rename it step_0000099"; renamed, resume
    went back to step 2 in a loop and keep_last never deleted it."""
    root = copy / "checkpoints"
    set_manifest_step(root / STEP2, 99)
    step, out = resumed_step(copy, capsys)
    assert step == 1 and f"{STEP2}, which disagrees about its step (its name says 2, manifest.json says 99, state.pt " \
                          "says 2: manifest.json was edited" in out, out
    assert "rename it" not in out
    os.rename(root / STEP2, root / "step_0000099")  # what the old advice said
    trainer = Trainer(small(copy, max_steps=3, keep_last=2))
    out = capsys.readouterr().out
    assert trainer.step == 1 and "step_0000099 disagrees about its step" in out and "state.pt says 2" in out, out
    trainer.run()
    assert sorted(p.name for p in root.glob("step_*")) == [STEP2, "step_0000003"]  # 99 pruned by keep_last
    assert Trainer(small(copy, max_steps=4)).step == 3


def test_an_edited_state_step_is_invalid(copy, capsys):
    """`state.pt`'s step edited (manifest recomputed): the schedule would have replayed silently."""
    step2 = copy / "checkpoints" / STEP2
    state = torch.load(step2 / "state.pt", weights_only=False)
    state["step"] = 7
    replace(step2 / "state.pt", torch_bytes(state))
    edit_manifest(step2, recompute=["state.pt"])
    step, out = resumed_step(copy, capsys)
    assert step == 1 and "state.pt says 7: state.pt was edited" in out and "rename it" not in out, out


def test_a_renamed_copy_still_gets_the_rename_advice(copy, capsys):
    root = copy / "checkpoints"
    shutil.copytree(root / STEP1, root / "step_0000999", copy_function=os.link)
    step, out = resumed_step(copy, capsys)
    assert step == 2 and "step_0000999 is misnamed (its manifest.json is of step 1, not 999 (its state.pt too)" \
                         ": the directory was renamed; rename it step_0000001" in out, out


# ---- bad inputs: one line, exit 2, nothing written, early -----------------------------------------------------
def test_convert_from_hf_with_a_word_for_a_number_is_one_line(tmp_path):
    import json

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                "num_hidden_layers": "two", "hidden_size": 64}))
    one_error_line(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")], "num_hidden_layers='two'",
                   "whole number")
    assert not (tmp_path / "run").exists()


def test_eval_out_that_cannot_be_written_is_refused_before_the_evaluation(copy, monkeypatch):
    from meshlm.eval import evaluate

    def never(*args, **kwargs):
        raise AssertionError("the evaluation ran before --out was checked")

    monkeypatch.setattr(evaluate, "evaluate", never)
    text = copy / "valid.txt"
    text.write_text("to be or not to be, that is the question\n" * 4)
    one_error_line(["eval", "--checkpoint", str(copy), "--task", "perplexity", "--data", str(text),
                    "--out", "/proc/x.json"], "--out '/proc/x.json' cannot be written")


@pytest.mark.parametrize("flag", ["--gpu-hbm-gbps", "--gpu-tflops", "--gpu-intra-latency-us"])
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_plan_refuses_non_finite_numbers(flag, value):
    one_error_line(["plan", "--config", "gpt-tiny", "--gpu", "a100-80gb", flag, value], flag, "finite")


def test_save_hf_true_names_the_choices(tmp_path):
    from meshlm.core.config import ConfigError

    with pytest.raises(ConfigError, match="one of '' \\(off\\), end .*every"):
        tiny_config(tmp_path, train={"save_hf": True})


# align: SimPO's gamma and the roles of conversational pairs (the fixtures of tests/tune/test_align.py)


@pytest.mark.parametrize("gamma", ["nan", "inf"])
def test_align_refuses_a_non_finite_simpo_gamma(data, tmp_path, gamma):  # noqa: F811 (the fixture)
    code, _, err = run(*align_args(data, "simpo", tmp_path / "out", "--simpo-gamma", gamma))
    assert_one_error(code, err, "--simpo-gamma")
    assert not (tmp_path / "out").exists()


def test_align_refuses_a_bogus_role_as_tune_does(data, tmp_path):  # noqa: F811 (the fixture)
    row = {"prompt": [{"role": "bogus", "content": "say red:"}], "chosen": [{"role": "assistant", "content": "red"}],
           "rejected": [{"role": "assistant", "content": "blue"}]}
    bad = write_jsonl(tmp_path / "bad.jsonl", [row])
    code, _, err = run(*align_args(data, "dpo", tmp_path / "out", train=bad))
    assert_one_error(code, err, "bad.jsonl:1", "prompt[0]", '"bogus"', "system, user, assistant")
    assert not (tmp_path / "out").exists()


# ---- train.time_budget_s that the set-up has spent, or that a short run would overrun ----------------------
def budget_run(out, budget: float, spent: float = 0.0, **train):
    """A tiny run with `train.time_budget_s=budget` whose command started `spent` seconds before the trainer
    (torch's import and the data's preparation take that long on a slow host)."""
    import time

    cfg = tiny_config(out, train={"time_budget_s": budget, "max_steps": 30, **train}, optim={"decay": "constant"})
    return Trainer(cfg, started=time.monotonic() - spent)


@pytest.mark.parametrize(("budget", "spent"), [(1e-9, 0.0), (3.0, 2.9)])
def test_a_budget_already_spent_is_refused_at_the_first_step_leaving_nothing(tmp_path, budget, spent):
    """Refused after the first (untimed) step, before any timed one, with the least budget that fits; no
    directory left (issue 48: refused only after 21 timed steps, metrics and TensorBoard files left behind)."""
    out = tmp_path / "new" / "run"
    trainer = budget_run(out, budget, spent)
    with pytest.raises(ConfigError, match=rf"^train.time_budget_s={budget:g} is too short: set-up and 1 step"
                                             r"\(s\) took .*give at least \d+ \(20 steps\)") as err:
        trainer.run()
    assert "\n" not in str(err.value) and trainer.step == 1
    assert not (tmp_path / "new").exists(), list(tmp_path.rglob("*"))


def test_a_refused_budget_keeps_what_the_directory_held(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    trainer = budget_run(tmp_path, 1e-9)
    with pytest.raises(ConfigError, match="too short"):
        trainer.run()
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_short_run_plans_its_budget_at_its_first_timed_step(tmp_path, capsys):
    """train.max_steps below the 21 planning steps: the plan is made and said after the first timed step (it was
    never made, and such a run overran its budget by 76 s without a word)."""
    result = budget_run(tmp_path, 600, max_steps=5).run()
    out = capsys.readouterr().out
    assert "time budget 10 min: 5 steps (train.max_steps caps it; ~" in out, out
    assert result["step"] == 5 and "done after" in out.splitlines()[-1]


def test_a_short_run_over_its_budget_is_cut_at_its_plan_and_an_overrun_said():
    """Budget 20 s, 10 s spent at set-up, 2 s a step, max_steps 8: planned at step 2 to fewer steps (unplanned,
    the 8 steps ran to 26 s and more); a run that still ends late says by how much."""
    from meshlm.train.budget import TimeBudget

    cfg = tiny_config("unused", train={"time_budget_s": 20, "max_steps": 8}, optim={"decay": "constant"})
    clock = FakeClock(10.0)
    budget = TimeBudget(20, started=0.0, clock=clock)
    budget.start(0)
    for step in (1, 2):
        clock.now += 2.0
        budget.observe(step, 2.0)
    assert not budget.due(1, cfg) and budget.due(2, cfg)
    line = budget.plan(cfg, 2, n_params=1000, accum=1, device=None, world_size=1)
    assert 2 <= budget.steps < 8 and f"{budget.steps} steps at 2.00 s/step" in line, line
    clock.now = 27.0
    assert budget.summary(budget.steps).endswith("done after 27 s of 20 s, 7 s over it")


class FakeClock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- a config error found after train.out_dir was created --------------------------------------------------
def test_a_config_error_at_set_up_leaves_no_directory(tmp_path):
    """data.document_mask=true on BERT is found by the trainer, after train.out_dir was made: one line, exit 2,
    and no directory (issue 48: an empty one was left); a directory that existed keeps what it held."""
    out = tmp_path / "a" / "run"
    one_error_line(["train", "--config", "bert-tiny", "--data.document_mask=true", f"--train.out_dir={out}"],
                   "data.document_mask=true", "bert")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept.txt").write_text("mine")
    one_error_line(["train", "--config", "bert-tiny", "--data.document_mask=true", f"--train.out_dir={tmp_path}"],
                   "data.document_mask=true")
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]


# ---- tune: conversations whose contents are all empty -------------------------------------------------------
def test_tune_refuses_a_conversation_whose_contents_are_all_empty(chat, tmp_path):  # noqa: F811 (the fixture)
    """One line naming the file and line, nothing trained or written (it trained silently on them)."""
    rows = [chat_rows(1, 3)[0], {"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": ""}]}]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    code, _, err = run("tune", "--checkpoint", str(chat["base"]), "--method", "lora", "--train", str(bad),
                       "--valid", str(chat["valid"]), "--out", str(tmp_path / "out"))
    assert_one_error(code, err, "bad.jsonl:2", "every message of the conversation is empty")
    assert not (tmp_path / "out").exists()
