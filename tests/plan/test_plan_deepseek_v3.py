"""The planner knows DeepSeek-V3 (issue 46): the bundled shape is transformers' DeepseekV3Config, meshlm's formulas
count its 671B parameters and 37B active ones, and `meshlm plan` on the report's 2,048 H800 with its layout (PP 16
with DualPipe, EP 64 over 8 nodes, ZeRO-1 data parallel, no TP, FP8 GEMMs) predicts the published cost, 2.664M
H800 GPU hours for 14.8T tokens (about 180K per trillion), within 25%, and a fit in 80 GB. The runtime's pieces
(FP8 GEMMs, DualPipe's bubble, overlap and two stages per rank, the node-limited all-to-all) are each held to their
formula (plan/overlap.py, docs/formulas.md "DeepSeek-V3")."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshlm.cli import main
from meshlm.core.config import ConfigError, load_config
from meshlm.core.memory import active_parameter_count, mtp_parameters, parameter_count
from meshlm.plan.catalog import get_gpu
from meshlm.plan.cost import RUNTIMES, Candidate, Cluster, Options
from meshlm.plan.overlap import node_limited_time, nodes_per_token
from meshlm.plan.search import evaluate

PUBLISHED_GPU_HOURS_PER_T = 2.664e6 / 14.8  # the report's Table 1: pre-training, 2,664K H800 hours, 14.8T tokens
GLOBAL_BATCH = 15360  # sequences of 4096 (the report: the batch ramps to 15,360 and stays there)


@pytest.fixture(scope="module")
def ds():
    return load_config("deepseek-v3")


def test_the_bundled_shape_is_transformers_deepseek_v3(ds):
    transformers = pytest.importorskip("transformers")
    from meshlm.interop.hf_deepseek import model_config_from_deepseek_v3

    hf = transformers.DeepseekV3Config()
    theirs = model_config_from_deepseek_v3(hf.to_dict())
    assert ds.model.mtp_depth == hf.num_nextn_predict_layers == 1
    plain = {"mtp_depth": 0, "mtp_loss_weight": 0.3}
    assert dataclasses.replace(ds.model, **plain) == dataclasses.replace(theirs, **plain)


def _hand_count(m) -> tuple[int, int, int]:
    """(main model, active, MTP module) parameters written out from the published shape."""
    h, n, rq, r, dn, dr, dv = 7168, 128, 1536, 512, 128, 64, 128
    mla = h * rq + rq + rq * n * (dn + dr) + h * (r + dr) + r + r * n * (dn + dv) + n * dv * h
    dense, expert, E = 3 * h * 18432, 3 * h * 2048, 256
    moe = E * h + (E + 1) * expert  # the router, 256 routed experts, one shared expert
    total = 61 * (mla + 2 * h) + 3 * dense + 58 * moe + 2 * 129280 * h + h  # norms; embedding, head, final norm
    active = total - 58 * (E - 8) * expert - 129280 * h  # 8 routed experts a token; the embedding is a lookup
    mtp = mla + 2 * h + moe + 2 * h * h + 3 * h  # one MoE block, the 2h → h merge, three norms
    return total, active, mtp


def test_671b_parameters_37b_active(ds):
    m = ds.model
    total, active, mtp = _hand_count(m)
    main_model = dataclasses.replace(m, mtp_depth=0)
    assert parameter_count(main_model) == total and round(total / 1e9) == 671
    assert active_parameter_count(m) == active and abs(active / 37e9 - 1) < 0.02  # 36.6B; the report: 37B
    # 11.6B; with its own copies of the embedding and the head (2 × 0.93B) the 13.5B the release calls "14B"
    assert mtp_parameters(m) == mtp


def test_mtp_parameters_count_the_models_own_modules():
    torch = pytest.importorskip("torch")
    from meshlm.models.gpt import GPT

    for depth, extra in ((1, {}), (2, {"--model.moe_experts": "4", "--model.moe_top_k": "2"})):
        overrides = ["--model.n_layers=2", "--model.hidden_size=32", "--model.n_heads=4", "--model.q_lora_rank=16",
                     "--model.kv_lora_rank=8", "--model.qk_nope_head_dim=8", "--model.qk_rope_head_dim=4",
                     "--model.v_head_dim=8", "--model.moe_experts=8", "--model.moe_groups=2",
                     "--model.moe_topk_groups=1", "--model.moe_top_k=2", "--model.moe_first_dense=1",
                     "--model.moe_expert_hidden=16", "--model.ffn_hidden_size=48", "--model.vocab_size=64",
                     "--model.seq_len=16", f"--model.mtp_depth={depth}", *[f"{k}={v}" for k, v in extra.items()]]
        m = load_config("deepseek-v3", overrides).model
        torch.manual_seed(0)
        model = GPT(m)
        mine = sum(p.numel() for name, p in model.named_parameters() if name.startswith("mtp."))
        assert mine == mtp_parameters(m) > 0, depth


def test_h800_is_the_h100s_compute_with_its_cut_nvlink():
    h800, h100 = get_gpu("h800"), get_gpu("h100-80gb")
    assert (h800.tflops, h800.fp8_tflops, h800.memory_gib) == (h100.tflops, h100.fp8_tflops, 80.0) == (989.0, 1979.0,
                                                                                                           80.0)
    assert h800.intra_gbps == 400 / 2 and h800.inter_gbps == 8 * 400 / 8 / 8  # 400 GB/s both ways; 8 × 400 Gb/s a node


def _plan(capsys, *extra: str) -> dict:
    rc = main(["plan", "--config", "deepseek-v3", "--gpu", "h800", "--gpus", "2048", "--gpus-per-node", "8",
               "--runtime", "deepseek-v3", "--global-batch-size", str(GLOBAL_BATCH), "--layout",
               "tp=1,pp=16,ep=64,zero=1", "--json", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    (answer,) = json.loads(out)
    return answer


def test_the_reports_layout_predicts_the_published_gpu_hours_and_fits_in_80_gb(capsys):
    """`meshlm plan --layout tp=1,pp=16,ep=64,zero=1` on 2,048 H800 (dp = 128 follows); the search completes the
    micro-batch size and recomputation with the fastest that fits. GPU hours per trillion tokens = 2,048 × the step
    time / 3,600 × 10^12 / (15,360 × 4,096 tokens a step)."""
    answer = _plan(capsys)
    assert (answer["tp"], answer["pp"], answer["dp"], answer["ep"], answer["zero"]) == (1, 16, 128, 64, 1)
    assert answer["fits"] and answer["memory_gb"] <= 80
    tokens = GLOBAL_BATCH * 4096
    assert answer["tokens_per_s"] == pytest.approx(tokens / answer["step_time_s"])
    gpu_hours_per_t = 2048 * answer["step_time_s"] / 3600 * 1e12 / tokens
    print(f"DeepSeek-V3 on 2,048 H800: {gpu_hours_per_t:,.0f} GPU hours per trillion tokens predicted, "
          f"{PUBLISHED_GPU_HOURS_PER_T:,.0f} published; {answer['memory_gb']:.1f} GiB per GPU; {answer['overrides']}")
    assert gpu_hours_per_t == pytest.approx(PUBLISHED_GPU_HOURS_PER_T, rel=0.25)


def _estimate(ds, opts: Options, cand: Candidate | None = None, gpu: str = "h800"):
    cand = cand or Candidate(1, 16, 128, micro_batch_size=1, recompute="full", zero=1, ep=64)
    return evaluate(ds, cand, Cluster(get_gpu(gpu), 2048, 8), GLOBAL_BATCH, opts)


def test_fp8_runs_the_linear_gemms_at_the_fp8_peak(ds):
    """FP8 runs the GEMMs of everything but the router (kept in BF16) at the FP8 peak, 1979 of the BF16 989
    TFLOP/s, and leaves attention alone."""
    base = dataclasses.replace(RUNTIMES["deepseek-v3"], comm_sm_share=0.0, dualpipe=False)
    fp8, bf16 = _estimate(ds, base), _estimate(ds, dataclasses.replace(base, precision="bf16"))
    m = ds.model
    router = 6 * 256 * 7168 * 58 / 61  # per token of the mean layer
    from meshlm.core.flops import layer_flops_per_token

    share = 1 - router / layer_flops_per_token(m)
    assert fp8.time["GEMMs (layers)"] == pytest.approx(bf16.time["GEMMs (layers)"] * (share * 989 / 1979 + 1 - share))
    assert fp8.time["attention"] == pytest.approx(bf16.time["attention"])
    with pytest.raises(ConfigError, match="no FP8 peak"):
        _estimate(ds, base, gpu="a100-80gb")


MICRO_BATCH_TERMS = ("GEMMs (layers)", "attention", "elementwise (memory-bound)", "recompute (extra forward)",
                     "EP all-to-all", "PP point-to-point", "LM head + loss")


def test_dualpipe_overlaps_the_all_to_all_halves_the_bubble_and_holds_two_stages(ds):
    plain = dataclasses.replace(RUNTIMES["deepseek-v3"], dualpipe=False)
    dual, one_f_one_b = _estimate(ds, RUNTIMES["deepseek-v3"]), _estimate(ds, plain)
    # 1F1B waits for every all-to-all; DualPipe only for what exceeds the rank's computation
    assert one_f_one_b.time["EP all-to-all"] > 0.5 and dual.time["EP all-to-all"] < one_f_one_b.time["EP all-to-all"]
    # two copies of the weights and states on each rank (stage k and stage 15 − k; the 1F1B rank 0 holds the
    # embedding and 4 layers, DualPipe's rank 0 also the last stage's one layer, the MTP module and the head)
    assert dual.memory["weights"] > 1.6 * one_f_one_b.memory["weights"]
    # with 4 stages of equal layers (the head and the MTP module left out) the bubble is (p/2 − 1) micro-batches
    # where 1F1B's is (p − 1)
    small = load_config("deepseek-v3", ["--model.n_layers=8", "--model.vocab_size=64", "--model.mtp_depth=0"])
    cand = Candidate(1, 4, 512, micro_batch_size=1, recompute="full", zero=1, ep=64)
    d4, p4 = _estimate(small, RUNTIMES["deepseek-v3"], cand), _estimate(small, plain, cand)
    per_mb = {k: sum(v for name, v in e.time.items() if name in MICRO_BATCH_TERMS) / 30 for k, e in (("d", d4),
                                                                                                    ("p", p4))}
    assert d4.time["pipeline bubble"] == pytest.approx(1 * per_mb["d"], rel=0.02)
    assert p4.time["pipeline bubble"] == pytest.approx(3 * per_mb["p"], rel=0.02)


def test_node_limited_all_to_all_crosses_the_network_once_per_node():
    """DeepSeek-V3's dispatch of one micro-batch (4,096 tokens) in FP8 over EP 64 on 8 nodes: a token reaches at
    most 4 nodes (4 of the 8 node-sized routing groups), 3.5 of them remote on average, over 50 GB/s InfiniBand at
    75%; NVLink (200 GB/s at 75%) forwards its 8 copies, 7/8 of them to another GPU; the slower link sets the time."""
    m = load_config("deepseek-v3").model
    assert nodes_per_token(m, 8) == 4 and nodes_per_token(m, 16) == 8 and nodes_per_token(m, 2) == 2
    ib = 4096 * 4 * 7 / 8 * 7168 / (50e9 * 0.75) + 7 * 10e-6
    nv = 4096 * 8 * 7168 * 7 / 8 / (200e9 * 0.75) + 7 * 5e-6
    got = node_limited_time(4096, m, 1.0, 64, 8, (200.0, 5.0), (50.0, 10.0), 0.75)
    assert got == pytest.approx(max(ib, nv)) and ib > nv
    assert node_limited_time(4096, m, 1.0, 8, 8, (200.0, 5.0), (50.0, 10.0), 0.75) == pytest.approx(nv)


def test_dualpipe_needs_an_even_pipeline_of_one_chunk_per_rank(ds):
    opts = RUNTIMES["deepseek-v3"]
    with pytest.raises(ConfigError, match="even parallel.pp and parallel.vpp=1"):
        evaluate(ds, Candidate(1, 16, 128, vpp=2, micro_batch_size=1, recompute="full", zero=1, ep=64),
                 Cluster(get_gpu("h800"), 2048, 8), 16384, opts)  # 128 micro-batches: interleaving's rule holds
    with pytest.raises(ConfigError, match="got pp=3"):
        evaluate(ds, Candidate(1, 3, 64, micro_batch_size=1, recompute="full", zero=1, ep=64),
                 Cluster(get_gpu("h800"), 192, 8), GLOBAL_BATCH, opts)
