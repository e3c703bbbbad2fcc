"""Context parallelism (meshlm/parallel/context.py) against one process, in float64.

Ring attention: in a world of 4, the ring over all 4 ranks (cp = 4) and over two rings of 2 (cp = 2); its
output and the gradients of q, k and v equal causal attention of the whole row (SDPA) to 1e-12, under
grouped-query attention and with packed documents (segment ids).

Training (dp_harness, float64, 2 clipped AdamW steps): cp2, cp4, cp2 × dp2 (ZeRO 0, 1, 2, 3), cp2 × tp2 + SP,
cp2 × pp2, cp2 with selective and with full recomputation, and ZeRO-3 (shards over dp × cp) also under
cp2 × tp2 + SP (dp = 1: shards over cp alone) and cp2 × pp2, on gpt- and llama-shaped models (llama: RoPE,
GQA; mqa: one KV head, replicated over tp), against one process: losses, gradient norms and the final weights
within dp_harness.TOL. Checkpoints reshard across cp (ZeRO-1 and ZeRO-3 ones saved under cp2 × dp2). Packed
documents through the model's `positions`/`segments` with partly ignored targets; `torchrun …
--parallel.cp=2` against one process; the refused layouts.
"""

from __future__ import annotations

import re

import dp_harness as H
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_world import run_world

from meshlm.families.registry import get_spec
from meshlm.parallel.context import chunk_bounds, local_positions, ring_attention, shard_sequence
from meshlm.parallel.mesh import ParallelDims

B, T, D = 2, 16, 8
GPT_SPEC = get_spec("gpt")  # every run here is of the gpt family (its pieces need the spec)

CASES = [(4, 2, False), (4, 2, True), (2, 2, False), (4, 1, True)]  # (query heads, KV heads, segments)


def _inputs(nh: int, nkv: int, segmented: bool):
    g = torch.Generator().manual_seed(nh * 10 + nkv + segmented)
    q = torch.randn(B, nh, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, nkv, T, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, nkv, T, D, generator=g, dtype=torch.float64)
    w = torch.randn(B, nh, T, D, generator=g, dtype=torch.float64)  # the loss is sum(out · w)
    # Documents of random lengths packed into each row (row 1 ends mid-document)
    seg = torch.cumsum(torch.rand(B, T, generator=g) < 0.25, dim=1) if segmented else None
    return q, k, v, w, seg


def _reference(q, k, v, w, seg):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    if seg is not None:
        allowed = allowed & (seg[:, :, None] == seg[:, None, :])[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _ring(q, k, v, w, seg, group, cp: int, rank: int):
    part = lambda t: shard_sequence(t, cp, rank, dim=2)
    q, k, v = (part(t).clone().requires_grad_() for t in (q, k, v))
    segments = None if seg is None else shard_sequence(seg, cp, rank, dim=1)
    out = ring_attention(q, k, v, group, segments=segments)
    (out * part(w)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _ring_world(rank: int, world: int, out_dir: str) -> dict:
    from meshlm.parallel import context

    sent = []  # elements this rank posts to the next one, per exchange
    exchange = context._Ring.exchange
    context._Ring.exchange = lambda ring, send, tag: (sent.append(send.numel()), exchange(ring, send, tag))[1]
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every rank creates both
    worst, traffic = {}, {}
    for cp, group in ((4, None), (2, halves[rank // 2])):
        cp_rank = rank if cp == 4 else rank % 2
        for nh, nkv, segmented in CASES:
            q, k, v, w, seg = _inputs(nh, nkv, segmented)
            want = [shard_sequence(t, cp, cp_rank, dim=2) for t in _reference(q, k, v, w, seg)]
            sent.clear()
            got = _ring(q, k, v, w, seg, group or dist.group.WORLD, cp, cp_rank)
            worst[(cp, nh, nkv, segmented)] = [float((a - b).abs().max()) for a, b in zip(got, want)]
            traffic[(cp, nh, nkv, segmented)] = sum(sent)
    return {"worst": worst, "sent": traffic}


def test_ring_attention_equals_full_causal_attention(tmp_path):
    """Output and gradients as full attention; each rank sends, per call, its keys and values (KV heads only)
    cp − 1 times forward and cp − 1 times backward, and their gradients cp times (the last hop home)."""
    for rank_result in run_world(_ring_world, 4, tmp_path):
        assert len(rank_result["worst"]) == 2 * len(CASES)
        for case, errors in rank_result["worst"].items():
            assert max(errors) < 1e-12, (case, errors)  # output, dq, dk, dv
        for (cp, nh, nkv, segmented), elements in rank_result["sent"].items():
            block = 2 * B * nkv * (T // cp) * D  # keys and values of one rank
            assert elements == (3 * cp - 2) * block, (cp, nh, nkv, elements)


def test_ring_of_one_is_causal_attention():
    for nh, nkv, segmented in CASES:
        q, k, v, w, seg = _inputs(nh, nkv, segmented)
        got = _ring(q, k, v, w, seg, None, 1, 0)
        for a, b in zip(got, _reference(q, k, v, w, seg)):
            assert float((a - b).abs().max()) < 1e-12


def test_load_balanced_chunks():
    assert chunk_bounds(16, 2, 0) == ((0, 4), (12, 16))
    assert chunk_bounds(16, 2, 1) == ((4, 8), (8, 12))
    assert local_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    every = torch.cat([local_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    x = torch.arange(16)[None]
    assert shard_sequence(x, 4, 3, dim=1).tolist() == [[6, 7, 8, 9]]


# ---- training under cp against one process (dp_harness, float64) --------------------------------------------
STEPS = 2
# llama-shaped with one KV head: at tp 2 both ranks hold a copy of it (as in test_zero3_tp.py)
H.MODELS.setdefault("mqa", {**H.MODELS["llama"], "n_kv_heads": 1})
# name: (model, tp, dp, cp, zero, extra parallel keys), by world size
LAYOUTS = {
    2: {"gpt_cp2": ("gpt", 1, 1, 2, 0, {}), "llama_cp2": ("llama", 1, 1, 2, 0, {}),
        "llama_cp2_selective": ("llama", 1, 1, 2, 0, {"train": {"recompute": "selective"}}),
        "gpt_cp2_full": ("gpt", 1, 1, 2, 0, {"train": {"recompute": "full"}})},
    4: {"llama_cp4": ("llama", 1, 1, 4, 0, {}), "gpt_cp2_dp2": ("gpt", 1, 2, 2, 0, {}),
        "llama_cp2_dp2_zero1": ("llama", 1, 2, 2, 1, {}), "gpt_cp2_dp2_zero2": ("gpt", 1, 2, 2, 2, {}), "llama_cp2_tp2_sp": ("llama", 2, 1, 2, 0, {"sp": True}),
        "gpt_cp2_tp2_sp": ("gpt", 2, 1, 2, 0, {"sp": True}), "gpt_cp2_pp2": ("gpt", 1, 1, 2, 0, {"pp": 2}),
        "llama_cp2_pp2": ("llama", 1, 1, 2, 0, {"pp": 2}),
        # ZeRO-3 shards over dp × cp (4; and 2 with dp = 1 under tp2, where the tp sums of the replicated KV
        # rows run on each cp rank's row shard)
        "gpt_cp2_dp2_zero3": ("gpt", 1, 2, 2, 3, {}), "mqa_cp2_tp2_sp_zero3": ("mqa", 2, 1, 2, 3, {"sp": True}),
        "gpt_cp2_pp2_zero3": ("gpt", 1, 1, 2, 3, {"pp": 2})},  # the tied embedding's shards on both stages
}


def _train_world(rank: int, world: int, out_dir: str) -> dict:
    out = {}
    with H.float64():
        for name, (model, tp, dp, cp, zero, extra) in LAYOUTS[world].items():
            extra = dict(extra)
            cfg = H.config(model, tp=tp, dp=dp, zero=zero, cp=cp, train=extra.pop("train", None), **extra)
            dims = ParallelDims.build(tp=tp, dp=dp, cp=cp, pp=extra.get("pp", 1), timeout_s=60)
            run = H.train(cfg, dims, STEPS)
            out[name] = H.compare(_REFS[model], _gathered(run) if zero == 3 else run)
    return out


def _gathered(run):
    """A ZeRO-3 run with its FSDP2 parameters (DTensors over dp × cp) replaced by their gathered tp-local
    tensors, which dp_harness then gathers over tp (as test_zero3_tp.py does). It cannot step after."""
    whole: dict[int, torch.nn.Parameter] = {}
    for module in run.model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and hasattr(p, "full_tensor"):
                if id(p) not in whole:  # a tied weight is gathered once and stays tied
                    whole[id(p)] = torch.nn.Parameter(p.full_tensor())
                module._parameters[name] = whole[id(p)]
    return run


_REFS: dict = {}
EOD = 7


def _rows(cfg, g: torch.Generator):
    """Two rows of packed documents (EOD ends each), targets partly ignored (unevenly over the chunks)."""
    T = cfg.model.seq_len
    ids = torch.randint(8, cfg.model.vocab_size, (2, T + 1), generator=g)
    ids[0, [3, 9]] = EOD
    ids[1, [12]] = EOD
    x, y = ids[:, :-1], ids[:, 1:].clone()
    y[0, :5] = -100  # all in rank 0's first chunk at cp2 (a prompt): the chunks count different targets
    return x, y


DOCUMENT_CASES = [("gpt", "none"), ("llama", "none"), ("llama", "full"), ("gpt", "selective")]  # recomputation
# replays the ring with the document ids it saved


def _documents_world(rank: int, world: int, out_dir: str) -> dict:
    from meshlm.data.documents import document_positions
    from meshlm.families.registry import get_spec
    from meshlm.parallel import build_model

    out = {}
    with H.float64():
        for model, recompute in DOCUMENT_CASES:
            cfg = H.config(model, cp=2, train={"recompute": recompute})
            spec = get_spec(cfg.model.family)
            torch.manual_seed(H.SEED)
            ref = spec.model_class(cfg.model)
            torch.manual_seed(H.SEED)
            par = build_model(cfg, ParallelDims.build(cp=2, timeout_s=60), spec=spec)
            x, y = _rows(cfg, torch.Generator().manual_seed(5))
            positions, segments = document_positions(x, EOD)
            want = F.cross_entropy(ref(x, positions=positions, segments=segments).flatten(0, 1), y.flatten())
            want.backward()
            got = par.loss_fn(par.model(x, positions=positions, segments=segments), y)
            got.backward()
            fused = par.model(x, targets=y, positions=positions, segments=segments)  # the fused head + loss
            mean = torch.stack([got.detach(), fused.detach()])  # the row's mean on every cp rank
            grads = {n: p.grad.clone() for n, p in par.model.named_parameters()}
            for g in grads.values():
                dist.all_reduce(g)
            out[(model, recompute)] = {"loss": float((mean - want).abs().max()) / float(want),
                          "grads": max(float((grads[n] / 2 - p.grad).abs().max()) for n, p in ref.named_parameters())}
    return out


def test_packed_documents_under_cp_match_one_process(tmp_path):
    """Whole rows with document positions and ids, partly ignored targets, with and without recomputation:
    the cp2 model's loss (logits + loss, and the fused head; on each cp rank) and its gradients (summed over
    the ring, /cp) equal one process's."""
    for rank_result in run_world(_documents_world, 2, tmp_path):
        assert sorted(rank_result) == sorted(DOCUMENT_CASES)
        for model, got in rank_result.items():
            assert got["loss"] < 1e-12 and got["grads"] < 1e-12, (model, got)


def test_training_under_cp_matches_one_process(tmp_path):
    with H.float64(), H.one_thread():
        _REFS.update({m: H.reference(m, STEPS) for m in ("gpt", "llama", "mqa")})  # inherited by the forked ranks
    seen = []
    for world in LAYOUTS:
        for rank_result in run_world(_train_world, world, tmp_path / f"world{world}"):
            seen += rank_result.items()
    assert sorted({name for name, _ in seen}) == sorted(n for layouts in LAYOUTS.values() for n in layouts)
    for name, got in seen:  # every rank: losses and norms relative, its own weights (gathered over tp)
        assert got["loss"] < H.TOL and got["grad_norm"] < H.TOL and got["weights"] < H.TOL, (name, got)


# ---- the trainer under torchrun, and what is refused --------------------------------------------------------
def test_torchrun_cp2_matches_single_process(tmp_path):
    """The README's `torchrun … meshlm train --parallel.cp=2 --data.document_mask=true` as typed (gloo, the
    bundled corpus, packed documents; a small shape, fp32): the same per-step and evaluation losses and the
    same final weights (read from its checkpoint) as one process with the same keys."""
    import json
    import shlex
    import subprocess
    import sys

    from meshlm.checkpoint.single import load_model_state, resolve_checkpoint
    from meshlm.core.config import load_config
    from meshlm.train.trainer import Trainer
    from tests.conftest import ROOT

    small = ["--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32", "--train.micro_batch_size=2",
             "--train.global_batch_size=4", "--train.eval_iters=1", "--train.eval_every=2", "--train.log_every=1",
             "--train.peak_tflops=1", "--train.sample_tokens=0", "--train.progress=false", "--train.max_steps=2",
             "--train.precision=fp32"]
    out, ref = tmp_path / "cp2", tmp_path / "one"
    readme = [line for line in (ROOT / "README.md").read_text().splitlines() if "--parallel.cp=2" in line]
    assert readme == [("torchrun --standalone --nproc_per_node=2 -m meshlm train --config gpt-tiny --parallel.cp=2 "
                       "--data.document_mask=true")]
    argv = shlex.split(readme[0])
    keys = [a for a in argv if a.startswith("--data.")]  # what the one-process reference shares with it
    cmd = [sys.executable, "-m", "torch.distributed.run", *argv[1:], *small, "--parallel.timeout_s=60",
           f"--train.out_dir={out}"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "× cp 2 (ring attention, 16 tokens per rank)" in proc.stdout
    Trainer(load_config("gpt-tiny", small + keys + [f"--train.out_dir={ref}"])).run()
    metrics = lambda d: [(r["kind"], r.get("loss", r.get("val_loss"))) for r in
                         map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if r["kind"] in ("train", "eval")]
    got, want = metrics(out), metrics(ref)
    assert [k for k, _ in got] == [k for k, _ in want] and len(got) == 3, (got, want)
    assert max(abs(a - b) / b for (_, a), (_, b) in zip(got, want)) < 1e-5, (got, want)
    full, plain = (load_model_state(resolve_checkpoint(d), spec=GPT_SPEC) for d in (out, ref))
    assert full.keys() == plain.keys()
    assert max(float((full[k] - v).abs().max()) for k, v in plain.items()) < 1e-5


REFUSED = {  # parallel/model keys → words the one-line error must hold
    "seq_len": ({"cp": 4}, {"seq_len": 20}, "model.seq_len=20 is not divisible by 8"),
    "sp_share": ({"cp": 2, "tp": 4, "sp": True}, {"seq_len": 20}, "multiple of 16"),
    "dropout": ({"cp": 2}, {"dropout": 0.1}, "model.dropout=0"),
    "cp0": ({"cp": 0}, {}, "parallel.cp=0 must be >= 1"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_cp_layouts_are_refused_with_one_line(case):
    from meshlm.core.config import build
    from meshlm.core.errors import ConfigError

    parallel, model, words = REFUSED[case]
    with pytest.raises(ConfigError, match=re.escape(words)) as err:
        build({"model": {**H.MODELS["gpt"], **model}, "parallel": parallel})
    assert "\n" not in str(err.value)


def test_world_mesh_and_encoder_rules():
    from meshlm.core.config import build
    from meshlm.core.errors import ConfigError
    from meshlm.core.layout import factor_world, plan_layout

    assert factor_world(8, tp=2, pp=1, cp=2) == (1, 2, 2)
    with pytest.raises(ConfigError, match="parallel.cp=4"):
        factor_world(6, tp=1, pp=1, cp=4)
    with pytest.raises(ConfigError, match="parallel.dp=4 or 0"):
        factor_world(8, tp=1, pp=1, dp=3, cp=2)
    # rank = ((pp·D + dp)·C + cp)·T + tp: tp innermost, cp next (Megatron's order)
    dims = ParallelDims(pp=2, dp=2, tp=2, rank=11, cp=2)  # 11 = ((1·2 + 0)·2 + 1)·2 + 1
    assert (dims.pp_rank, dims.dp_rank, dims.cp_rank, dims.tp_rank, dims.dpcp, dims.dpcp_rank) == (1, 0, 1, 1, 4, 1)
    bert = build({"model": H.MODELS["bert"]})
    with pytest.raises(ConfigError, match="model.family='bert'"):
        plan_layout(bert, 1, 1, 1, cp=2, decoder=False)


# ---- checkpoints reshard across cp -------------------------------------------------------------------------
HALF = 2
RESHARD = {"one_to_cp2_tp2": ("llama", None, (2, 1, 2, 0)), "cp2_tp2_to_one": ("llama", (2, 1, 2, 0), None),
           "cp2_dp2_zero1_to_one": ("llama", (1, 2, 2, 1), None), "cp2_dp2_zero3_to_one": ("llama", (1, 2, 2, 3), None)}
TO_ONE = [name for name, (_, _, second) in RESHARD.items() if second is None]  # resumed in one process


def _layout_run(model: str, layout, consumed: int = 0, path=None):
    """(tp, dp, cp, zero) → this rank's run of it (None: one process), fresh or resumed from `path`."""
    if layout is None:
        cfg, dims = H.config(model), None
    else:
        tp, dp, cp, zero = layout
        cfg = H.config(model, tp=tp, dp=dp, zero=zero, cp=cp, sp=tp > 1)
        dims = ParallelDims.build(tp=tp, dp=dp, cp=cp, timeout_s=60)
    return H.resume(cfg, dims, path) if path is not None else H.build_run(cfg, dims)


def _reshard_world(rank: int, world: int, out_dir: str) -> dict:
    """Under a cp layout: save after HALF steps (cp first), or resume a one-process checkpoint for HALF more."""
    from meshlm.checkpoint.single import resolve_checkpoint

    out = {}
    with H.float64():
        for name, (model, first, second) in RESHARD.items():
            root = f"{out_dir}/../{name}"
            if first is not None:
                run = _layout_run(model, first)
                for _ in range(HALF):
                    H.step(run)
                H.save(run, root, {})
            else:
                run = _layout_run(model, second, path=resolve_checkpoint(root))
                for _ in range(HALF):
                    H.step(run)
                out[name] = H.compare(_REFS[f"{model}4"], run)
    return out


def test_checkpoints_reshard_across_cp(tmp_path):
    """A one-process checkpoint resumes under cp2 × tp2 + SP, and cp2 × tp2 + SP, cp2 × dp2 ZeRO-1 and ZeRO-3 ones
    (pieces of rows sharded over dp × cp) in one process: the 4 losses and the final weights as 4 uninterrupted steps of
    one process."""
    from meshlm.checkpoint.single import resolve_checkpoint

    with H.float64(), H.one_thread():
        _REFS["llama4"] = H.reference("llama", 2 * HALF)
        first = _layout_run("llama", None)  # the one-process first half, saved
        for _ in range(HALF):
            H.step(first)
        H.save(first, tmp_path / "one_to_cp2_tp2", {})
    results = run_world(_reshard_world, 4, tmp_path / "world")
    with H.float64(), H.one_thread():
        for name in TO_ONE:
            run = _layout_run(RESHARD[name][0], None, path=resolve_checkpoint(tmp_path / name))
            for _ in range(HALF):
                H.step(run)
            results.append({name: H.compare(_REFS["llama4"], run)})
    names = [name for r in results for name in r]
    assert sorted(set(names)) == sorted(RESHARD) and len(names) == 4 + len(TO_ONE)
    for r in results:
        for name, got in r.items():
            assert len(got["losses"]) == 2 * HALF, name
            assert got["loss"] < H.TOL and got["weights"] < H.TOL, (name, got)


def test_cli_refuses_a_sequence_the_ring_cannot_cut():
    from tests.conftest import run_cli

    proc = run_cli("train", "--config", "gpt-tiny", "--parallel.cp=3")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "parallel.cp=3" in proc.stderr and "model.seq_len=128 is not divisible by 6" in proc.stderr
