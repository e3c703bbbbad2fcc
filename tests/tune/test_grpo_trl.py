"""meshlm's GRPO losses (meshlm/tune/grpo_loss.py) equal TRL's on fixed inputs: random per-token log-probs
of the policy, the sampling policy and the reference, ragged completion masks and group rewards.

TRL computes the loss inside `GRPOTrainer._compute_loss` / `RLOOTrainer._compute_loss`; the test drives those
very methods on a bare trainer object whose per-token log-probs are a leaf tensor (no model), so TRL's own
code gives the loss, the clip fractions, the KL and (by autograd) the gradient w.r.t. the policy's
log-probs, for every loss type TRL's GRPOTrainer has among meshlm's (grpo, bnpo, dr_grpo, dapo) and for
RLOO. Then the same through real models: a tiny meshlm GPT and its `meshlm convert --to-hf` export, TRL's own
per-token log-probs (`add_fused_lm_head`, `_get_per_token_logps_and_entropies`, temperature 0.7) on its
prompt + completion layout against meshlm's `grpo.token_logps` on its rows: the loss and the gradients of the
model's parameters. TRL computes the advantages inline in its generation step, not as a function: they are checked
against TRL's `nanstd` and the formulas of that code, written out here from its definitions."""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from meshlm.tune import grpo
from meshlm.tune import grpo_loss as gl
from tests.checkpoint_helpers import load_run
from tests.tune.tune_helpers import GPT2, run, save_base

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.rloo_trainer import RLOOTrainer
from trl.trainer.utils import add_fused_lm_head, nanstd

TOL = 1e-5
G, PROMPTS, T, MAX_LEN = 4, 3, 7, 9


class _Accelerator:
    """One process: gather and reduce are the identity."""

    num_processes = 1
    is_main_process = True

    def autocast(self):
        return contextlib.nullcontext()

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    gather_for_metrics = gather


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    B = G * PROMPTS
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios well outside [0.8, 1.28]
    ref = logps + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rewards = torch.randint(0, 3, (B,), generator=g).double()
    rewards[:G] = 1.0  # one group with zero variance
    return logps, old, ref, mask, rewards


def bare_trainer(cls, settings: gl.LossSettings, logps: torch.Tensor):
    """A `cls` object with just what `_compute_loss` reads, its log-probs `logps` (a leaf)."""
    t = cls.__new__(cls)
    t.__dict__.update(loss_type=settings.loss_type, beta=settings.beta, epsilon_low=settings.epsilon,
                      epsilon_high=settings.high, importance_sampling_level="token", off_policy_mask_threshold=None,
                      top_entropy_quantile=1.0, use_vllm=False, vllm_importance_sampling_correction=False,
                      current_gradient_accumulation_steps=1, max_completion_length=settings.max_completion_length,
                      _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
                      accelerator=_Accelerator(), model=SimpleNamespace(training=True),
                      state=SimpleNamespace(global_step=0),
                      args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1,
                                           report_to=[]))
    if logps is not None:  # else TRL's own, from the model it is given
        t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    return t


def trl_batch(mask, old, ref, advantages):
    B = mask.shape[0]
    return {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
            "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
            "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
            "num_items_in_batch": mask.sum(), "old_logps": (old * mask).sum(1)}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta,eps_high", [(0.0, None), (0.04, 0.28)])
def test_grpo_loss_ratios_kl_and_grads_equal_trl(loss_type, beta, eps_high):
    logps, old, ref, mask, rewards = inputs(1)
    s = gl.LossSettings(loss_type, beta=beta, epsilon=0.2, epsilon_high=eps_high, max_completion_length=MAX_LEN)
    advantages, _, _ = gl.group_advantages(rewards, G)

    theirs = logps.clone().requires_grad_()
    trainer = bare_trainer(GRPOTrainer, s, theirs)
    ref_loss = trainer._compute_loss(None, trl_batch(mask, old, ref, advantages))
    ref_loss.backward()
    ours = logps.clone().requires_grad_()
    loss, parts = gl.grpo_loss(ours, old, ref, mask, advantages, s)
    loss.backward()

    assert abs(loss.item() - ref_loss.item()) < TOL
    assert torch.allclose(ours.grad, theirs.grad, atol=TOL, rtol=0)
    assert ours.grad.abs().sum() > 0
    assert torch.allclose(parts.ratio, torch.exp(logps - old), atol=TOL, rtol=0)  # ρ = exp(π − π_old)
    got = trainer._metrics["train"]
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert abs(parts.metrics[name] - got[name][0]) < TOL, name
    assert parts.metrics["clip_ratio/region_mean"] > 0  # the inputs do exercise the clipping
    if beta:
        assert abs(parts.metrics["kl"] - got["kl"][0]) < TOL
        d = ref - logps  # k3 by hand
        assert torch.allclose(parts.kl, torch.exp(d) - d - 1, atol=TOL, rtol=0)


def test_dapo_micro_batches_add_up_to_the_whole_batch():
    """dapo's denominator is the generation batch's token count: two halves' gradients sum to the whole's."""
    logps, old, ref, mask, rewards = inputs(2)
    s = gl.LossSettings("dapo", beta=0.04, epsilon_high=0.28)
    adv, _, _ = gl.group_advantages(rewards, G)
    whole = logps.clone().requires_grad_()
    gl.grpo_loss(whole, old, ref, mask, adv, s)[0].backward()
    half = logps.clone().requires_grad_()
    n, k = int(mask.sum()), G * PROMPTS // 2
    for part in (slice(0, k), slice(k, None)):
        gl.grpo_loss(half[part], old[part], ref[part], mask[part], adv[part], s, num_tokens=n)[0].backward()
    assert torch.allclose(whole.grad, half.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("beta,normalize", [(0.0, False), (0.05, True)])
def test_rloo_loss_and_grads_equal_trl(beta, normalize):
    logps, old, ref, mask, rewards = inputs(3)
    s = gl.LossSettings("rloo", beta=beta, epsilon=0.2, epsilon_high=0.3)
    rewards_kl = gl.rloo_kl_rewards(rewards, old, ref, mask, beta)
    advantages = gl.rloo_advantages(rewards_kl, G, normalize)
    # TRL's RLOO advantages, written out from rloo_trainer.py's definitions
    grouped = rewards_kl.view(-1, G)
    expected = rewards_kl - ((grouped.sum(1, keepdim=True) - grouped) / (G - 1)).view(-1)
    if normalize:
        expected = (expected - expected.mean()) / (nanstd(expected) + 1e-4)
    assert torch.allclose(advantages, expected, atol=TOL, rtol=0)

    theirs = logps.clone().requires_grad_()
    trainer = bare_trainer(RLOOTrainer, s, theirs)
    ref_loss = trainer._compute_loss(None, trl_batch(mask, old, ref, advantages))
    ref_loss.backward()
    ours = logps.clone().requires_grad_()
    loss, parts = gl.grpo_loss(ours, old, ref, mask, advantages, s)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < TOL
    assert torch.allclose(ours.grad, theirs.grad, atol=TOL, rtol=0)
    got = trainer._metrics["train"]
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert abs(parts.metrics[name] - got[name][0]) < TOL, name


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("unscored", [False, True])
def test_group_advantages_follow_trl(scale, unscored):
    """TRL's sum_then_normalize advantages (grpo_trainer.py), from its `nanstd`: r − group mean, over std + 1e-4;
    an unscored completion (NaN) is left out of its group's statistics and gets advantage 0."""
    *_, rewards = inputs(4)
    if unscored:
        rewards[G + 1] = float("nan")
    advantages, zero_std, _ = gl.group_advantages(rewards, G, scale)
    grouped = rewards.view(-1, G)
    centred = rewards - torch.nanmean(grouped, 1).repeat_interleave(G)
    std = nanstd(rewards).expand_as(rewards) if scale == "batch" else nanstd(grouped, dim=1).repeat_interleave(G)
    expected = torch.nan_to_num(centred if scale == "none" else centred / (std + 1e-4), nan=0.0)
    assert torch.allclose(advantages, expected, atol=TOL, rtol=0)
    assert advantages[G + 1] != 0 or unscored
    if scale != "batch":
        assert zero_std[:G].all() and not zero_std[G:].all()  # the first group's rewards are all 1
        assert (advantages[:G] == 0).all()


# meshlm name → (Hugging Face GPT-2 name, transposed: GPT-2's Conv1D stores (in, out))
GRADS = {"tok_emb.weight": ("transformer.wte.weight", False), "pos_emb.weight": ("transformer.wpe.weight", False),
         "layers.0.norm1.weight": ("transformer.h.0.ln_1.weight", False),
         "layers.1.attn.qkv.weight": ("transformer.h.1.attn.c_attn.weight", True),
         "layers.1.mlp.fc.weight": ("transformer.h.1.mlp.c_fc.weight", True)}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_trl")
    save_base(root / "policy", {**GPT2, "seq_len": 32}, seed=1)
    assert run("convert", "--checkpoint", str(root / "policy"), "--to-hf", str(root / "hf"))[0] == 0
    return root


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_model_gradients_equal_trl_through_its_own_logprobs(policy, loss_type):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 50000, (5,), generator=g).tolist() for _ in range(2)]  # equal lengths: no left pad
    lengths = [3, 6, 1, 4, 6, 2]
    completions = [torch.randint(0, 50000, (n,), generator=g).tolist() for n in lengths]
    rows = [grpo.Prompt(f"p:{i // 3 + 1}", "", prompts[i // 3], {}) for i in range(6)]
    ro = grpo.Rollout(rows, completions, [""] * 6, [], 0.0)
    ids, where, mask, tokens = grpo.batch_rows(ro, pad_id=50256)
    s = gl.LossSettings(loss_type, beta=0.04, epsilon=0.2, epsilon_high=0.28, max_completion_length=8)
    temperature = 0.7
    model, _, _ = load_run(str(policy / "policy"))
    with torch.no_grad():
        base = grpo.token_logps(model, ids, where, tokens, temperature)
    old = base + 0.3 * torch.randn(base.shape, generator=g)
    ref = base + 0.5 * torch.randn(base.shape, generator=g)
    adv, _, _ = gl.group_advantages(torch.tensor([1.0, 0.0, 2.0, 0.5, 0.5, 3.0]), 3)

    logps = grpo.token_logps(model, ids, where, tokens, temperature)
    loss, _ = gl.grpo_loss(logps, old, ref, mask, adv, s)
    loss.backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(policy / "hf")).float().eval()
    add_fused_lm_head(hf, temperature=temperature, outputs=("log_probs", "entropy"))
    trainer = bare_trainer(GRPOTrainer, s, None)
    L = tokens.shape[1]
    batch = trl_batch(mask.long(), old, ref, adv)
    batch.update(prompt_ids=torch.tensor(prompts).repeat_interleave(3, 0), prompt_mask=torch.ones(6, 5, dtype=torch.long),
                 completion_ids=tokens)
    assert batch["completion_ids"].shape[1] == L
    ref_loss = trainer._compute_loss(hf, batch)
    ref_loss.backward()

    assert abs(loss.item() - ref_loss.item()) < TOL, (loss.item(), ref_loss.item())
    params = dict(hf.named_parameters())
    for ours_name, (theirs_name, transposed) in GRADS.items():
        ours = model.get_parameter(ours_name).grad
        theirs = params[theirs_name].grad
        theirs = theirs.t() if transposed else theirs
        assert ours.abs().max() > 0, ours_name
        assert torch.allclose(ours, theirs, atol=TOL, rtol=1e-4), (ours_name, (ours - theirs).abs().max())
