"""The planner and the memory model know context parallelism (issue 30, item 5): activations per rank count
s/cp tokens, weights and states do not shrink with cp (ZeRO shards over dp × cp), the ring's traffic and
buffers are priced, `meshlm plan` searches cp for long sequences and takes `--layout cp=N`."""

from __future__ import annotations

import json

import pytest

from meshlm.cli import main
from meshlm.core.config import load_config
from meshlm.core.memory import (
    activation_bytes_per_rank,
    activation_dtypes,
    activation_terms,
    ring_buffer_bytes,
    ring_send_bytes,
)
from meshlm.plan.catalog import get_gpu
from meshlm.plan.cost import Candidate, Cluster, Options, ring_exposed_time
from meshlm.plan.search import cp_sizes, evaluate
from tests.conftest import run_cli

BF16_CUDA = activation_dtypes("bf16", "cuda")
# A Llama-style model (RoPE, RMSNorm, SwiGLU, GQA 16 query / 4 KV heads), 8,192 tokens
MID = ["--model.n_layers=8", "--model.hidden_size=1024", "--model.n_heads=16", "--model.n_kv_heads=4",
       "--model.seq_len=8192"]
# Llama 3 70B's shape
LLAMA_70B = ["--config", "llama-tiny", "--model.n_layers=80", "--model.hidden_size=8192", "--model.n_heads=64",
             "--model.n_kv_heads=8", "--model.ffn_hidden_size=28672", "--model.vocab_size=128256"]


def _mid(**train):
    return load_config("llama-tiny", MID + ["--train.micro_batch_size=1"] + [f"--train.{k}={v}" for k, v in train.items()])


@pytest.mark.parametrize("tp, sp", [(1, False), (2, True)])
def test_activations_per_rank_count_s_over_cp_and_keep_no_scores(tp, sp):
    m = _mid().model
    one = activation_bytes_per_rank(m, 2, 8, tp, sp, "none", BF16_CUDA, "flash", cp=1)
    assert set(one) == {"layers", "total"}  # no ring at cp = 1
    for cp in (2, 4):
        got = activation_bytes_per_rank(m, 2, 8, tp, sp, "none", BF16_CUDA, "flash", cp=cp)
        # every saved term is proportional to the rank's tokens: exactly 1/cp of cp = 1
        assert got["layers"] == pytest.approx(one["layers"] / cp, rel=1e-12)
        assert got["total"] == got["layers"] + sum(ring_buffer_bytes(m, 2, tp, cp, BF16_CUDA, "flash").values())
        # selective recomputation and full recomputation's region input scale the same way
        for mode in ("selective", "full"):
            assert sum(activation_terms(m, 2, tp, sp, mode, BF16_CUDA, "flash", cp=cp).values()) == pytest.approx(
                sum(activation_terms(m, 2, tp, sp, mode, BF16_CUDA, "flash").values()) / cp, rel=1e-12)
    # the math kernel keeps b·a·s² scores at cp = 1; the ring saves none (each block is recomputed in
    # backward), so under cp it saves what flash saves at s/cp
    math1 = activation_terms(m, 2, tp, sp, "none", BF16_CUDA, "math")
    math2 = activation_terms(m, 2, tp, sp, "none", BF16_CUDA, "math", cp=2)
    assert "softmax output" in math1 and "softmax output" not in math2
    assert sum(math2.values()) == pytest.approx(one["layers"] / 8 / 2, rel=1e-12)


def test_ring_buffers_and_traffic_match_a_hand_computation():
    m = _mid().model  # k = 64, 4 KV heads
    b, tp, cp, s, c = 2, 2, 4, 8192, 2
    g_t, k = 4 // tp, 64
    block = 2 * (s // cp) * b * g_t * k * c  # K and V of the rank's s/cp tokens: 2 MiB
    assert block == 2 * 2 ** 20
    sent = ring_send_bytes(m, b, tp, cp, BF16_CUDA)
    # backward: the 3 K/V blocks again and 4 hops of dK/dV (the last brings each rank its own), in fp32
    assert sent == {"block": block, "grad_block": 2 * block, "forward": 3 * block, "backward": 3 * block + 8 * block}
    assert ring_send_bytes(m, b, tp, 1, BF16_CUDA)["forward"] == 0
    # two K/V blocks in flight, dK/dV beside them in backward
    assert ring_buffer_bytes(m, b, tp, cp, BF16_CUDA, "flash") == {"ring KV blocks in flight (K, V, dK, dV)": 4 * block}
    # the math kernel computes one (s/cp) × (s/cp) block of scores at a time: b · a_t · (s/cp)² elements
    scores = ring_buffer_bytes(m, b, tp, cp, BF16_CUDA, "math")["ring score block in flight"]
    assert scores == b * (16 // tp) * (s // cp) ** 2 * 2
    # overlap: each of the cp − 1 steps costs max(compute, transfer) + α; 10 GB/s at efficiency 1, α 5 µs
    attn = 0.012  # s: forward 4 ms (1 ms a step), backward 8 ms (2 ms a step)
    # backward: each step moves the K/V block and the fp32 dK/dV (grad_block = 2 blocks in bf16); the last
    # dK/dV hop home has no compute to hide behind
    fwd, bwd = ring_exposed_time(block, cp, attn, 10.0, 5.0, 1.0, 2 * block)
    transfer = block / 10e9  # 0.21 ms: hidden behind the 1 ms step
    assert 3 * transfer < 2 * attn / 3 / cp
    assert (fwd, bwd) == pytest.approx((3 * 5e-6, 3 * 5e-6 + 2 * transfer + 5e-6))
    slow_fwd, slow_bwd = ring_exposed_time(block, cp, attn, 0.5, 5.0, 1.0, 2 * block)  # 4.2 ms a block
    assert slow_fwd == pytest.approx(3 * (block / 0.5e9 - 0.001 + 5e-6))
    assert slow_bwd == pytest.approx(3 * (3 * block / 0.5e9 - 0.002 + 5e-6) + 2 * block / 0.5e9 + 5e-6)


def _estimate(cand: Candidate, gpus: int, gpu="a100-80gb", gbs: int = 16):
    return evaluate(_mid(global_batch_size=gbs), cand, Cluster(get_gpu(gpu), gpus, 8), gbs, Options())


def test_the_planner_prices_cp_layouts_term_by_term():
    one = _estimate(Candidate(2, 1, 4), 8)
    two = _estimate(Candidate(2, 1, 2, cp=2), 8)
    # weights and gradients are replicated over cp: unchanged per rank; activations and logits halve
    assert two.memory["weights"] == one.memory["weights"] and two.memory["gradients"] == one.memory["gradients"]
    assert two.memory["activations"] == pytest.approx(one.memory["activations"] / 2, rel=1e-12)
    assert two.memory["logits (last stage)"] == pytest.approx(one.memory["logits (last stage)"] / 2, rel=1e-12)
    assert two.memory["CP ring buffers (transient)"] > 0 and "CP ring buffers (transient)" not in one.memory
    # ZeRO shards the optimizer states over dp × cp: dp 2 × cp 2 as dp 4
    z_one = _estimate(Candidate(2, 1, 4, zero=1), 8)
    z_two = _estimate(Candidate(2, 1, 2, zero=1, cp=2), 8)
    assert z_two.memory["optimizer states"] == pytest.approx(z_one.memory["optimizer states"], rel=1e-12)
    # each rank does half the layers' GEMMs and attention of twice the micro-batches (dp 2: 8 per step, not 4)
    assert two.time["GEMMs (layers)"] == pytest.approx(one.time["GEMMs (layers)"], rel=1e-12)
    assert two.time["attention"] == pytest.approx(one.time["attention"], rel=1e-12)
    # the ring's term: layers × micro-batches × (forward + backward) of `ring_exposed_time`, over NVLink
    # (tp · cp = 4 ranks in a node)
    gpu, layers, mb = get_gpu("a100-80gb"), 8, 8
    t_attn = two.time["attention"] / (layers * mb)
    sent = ring_send_bytes(_mid().model, 1, 2, 2, BF16_CUDA)
    want = sum(ring_exposed_time(sent["block"], 2, t_attn, gpu.intra_gbps, gpu.intra_latency_us, 0.75,
                                 sent["grad_block"]))
    assert two.time["CP ring (exposed)"] == pytest.approx(layers * mb * want, rel=1e-9)
    assert one.time["CP ring (exposed)"] == 0
    # a ring that leaves the node (tp 8 × cp 2 on 8 GPUs per node) costs more than one inside it
    inside = _estimate(Candidate(4, 1, 1, cp=2), 8, gbs=8)
    across = _estimate(Candidate(8, 1, 1, cp=2), 16, gbs=8)
    assert across.time["CP ring (exposed)"] > inside.time["CP ring (exposed)"] > 0
    assert two.candidate.world == 8 and "--parallel.cp=2" in two.candidate.overrides()


def test_the_search_tries_cp_only_for_long_sequences():
    assert cp_sizes(256, 8, 131072) == [1, 2, 4, 8, 16, 32]
    assert cp_sizes(256, 8, 8192) == [1, 2]  # 4,096 tokens a rank at least
    assert cp_sizes(256, 8, 4096) == [1]
    assert cp_sizes(12, 1, 20000) == [1, 2, 4]  # 2·cp must divide the sequence: not 3 (nor 6, 12)


def _plan(capsys, *args):
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("seq, long", [(131072, True), (8192, False)])
def test_a_70b_llama_on_256_gpus_takes_cp_for_long_sequences_only(capsys, seq, long):
    """The same model and cluster: at 131,072 tokens a layout without cp needs full recomputation to fit
    and cp wins; at 8,192 cp = 2 is searched and loses (a few seconds: the search over 256 GPUs)."""
    rc, out, err = _plan(capsys, *LLAMA_70B, "--seq-len", str(seq), "--gpus", "256", "--gpus-per-node", "8",
                         "--gpu", "h200", "--global-batch-size", "64", "--json", "--top", "3")
    assert rc == 0, err
    best = json.loads(out)[0]
    assert best["tp"] * best["cp"] * best["pp"] * best["dp"] == 256
    assert (best["cp"] > 1) == long, best
    assert f"--parallel.cp={best['cp']}" in best["overrides"]


def test_layout_cp_through_the_cli():
    proc = run_cli("plan", "--config", "llama-tiny", "--gpus", "8", "--gpus-per-node", "8", "--gpu", "a100-80gb",
                   "--layout", "cp=2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    head = [c.strip() for c in lines[0].split("|")]
    row = [c.strip() for c in lines[2].split("|")]
    assert row[head.index("cp")] == "2"
    assert int(row[head.index("tp")]) * 2 * int(row[head.index("pp")]) * int(row[head.index("dp")]) == 8
    assert "--parallel.cp=2" in proc.stdout and "completed by the search: tp, pp, vpp, dp," in proc.stdout


@pytest.mark.parametrize("args, needle", [
    (["--gpus", "8", "--layout", "cp=3"], "cp=3 does not divide the 8 GPUs"),
    (["--gpus", "6", "--gpus-per-node", "6", "--layout", "cp=3"],
     "parallel.cp=3 cuts each row into 2·cp = 6 equal chunks, but model.seq_len=128 is not divisible by 6"),
    (["--gpus", "8", "--layout", "tp=1,pp=1,cp=3"], "parallel.cp=3 = 3; launch a multiple of 3"),
    (["--gpus", "8", "--layout", "cp=x"], "--layout cp='x' must be a whole number >= 1"),
])
def test_a_cp_that_does_not_divide_is_refused_in_one_line(capsys, args, needle):
    rc, out, err = _plan(capsys, "--config", "llama-tiny", "--gpu", "a100-80gb", *args)
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
