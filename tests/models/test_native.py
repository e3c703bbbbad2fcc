"""meshlm's in-place decoding attention (`models/native.py`, `models/kernels/paged_decode.cpp`) against PyTorch's
kernel in float64 over the same keys gathered: the paged engine's decoding rows take it wherever it builds.

Tolerances: fp32 within 2e-6 (fp32 sums in another order over at most 700 keys of unit-scale scores), bf16
within one bf16 rounding of the output (2^-8 relative, the kernel computes in fp32 and rounds once at the end).
A wrong slot, a missed position or a head read from the wrong KV head moves an output by order 0.1."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from meshlm.models import native


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert native.paged_decode() is not None, native.unavailable()


def pool_and_rows(R, nh, nkv, hd, lens, dtype, bs=16, blocks=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(nkv, blocks * bs, hd, generator=g).to(dtype)
    v = torch.randn(nkv, blocks * bs, hd, generator=g).to(dtype)
    nb = -(-max(lens) // bs)
    table = torch.randperm(blocks, generator=g)[:R * nb].view(R, nb)  # scattered, each row its own blocks
    q = torch.randn(R, 1, nh, hd, generator=g).to(dtype).transpose(1, 2)  # (R, nh, 1, hd), strided as the model's
    return q, k, v, table, torch.tensor(lens)


def reference(q, k, v, table, lens, bs, scale):
    R, nb = table.shape
    slots = (table[:, :, None] * bs + torch.arange(bs)).reshape(R, -1)
    keys, values = k[:, slots].transpose(0, 1).double(), v[:, slots].transpose(0, 1).double()
    mask = (torch.arange(nb * bs)[None, :] < lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.double(), keys, values, attn_mask=mask, enable_gqa=True, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nh, nkv, hd", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (6, 3, 32), (4, 2, 24)],
                         ids=["mha-64", "gqa3-64", "gqa4-128", "gqa2-32", "odd-24"])
@pytest.mark.parametrize("lens", [[700], [1, 16, 17, 250, 5], [130] * 3], ids=["one-long", "mixed", "split"])
def test_decode_equals_sdpa_over_the_gathered_keys(dtype, nh, nkv, hd, lens):
    """Every head layout the kernel has a path for (AVX-512 at head widths 32/64/128, the portable loop at 24),
    rows of 1 to 700 positions (past `native.CHUNK`: a row split across work items and merged), in fp32 and bf16."""
    q, k, v, table, lt = pool_and_rows(len(lens), nh, nkv, hd, lens, dtype)
    scale = 0.7 * hd ** -0.5
    out = native.decode(q, k, v, table, lt, 16, scale)
    assert out.shape == (len(lens), nh, 1, hd) and out.dtype == dtype
    ref = reference(q, k, v, table, lt, 16, scale)
    if dtype == torch.float32:
        assert (out.double() - ref).abs().max() <= 2e-6
    else:
        assert ((out.double() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-3).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_many_rows_of_long_positions_are_read_whole(threads):
    """With at least 8 (row, KV head) pairs a thread the kernel no longer splits rows into chunks: each work item
    reads its row's every position, past `native.CHUNK` (rows of 1 to 700 positions; the same rows split at 8
    threads give the same output)."""
    lens = [700, 1, 129, 128, 300, 17, 640, 256]
    q, k, v, table, lt = pool_and_rows(len(lens), 8, 4, 64, lens, torch.float32, blocks=400)  # 32 pairs: split from 5 threads
    ref = reference(q, k, v, table, lt, 16, 0.125)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        whole, lse = native.decode(q, k, v, table, lt, 16, 0.125, lse=True)
        torch.set_num_threads(8)
        split, lse_split = native.decode(q, k, v, table, lt, 16, 0.125, lse=True)
    finally:
        torch.set_num_threads(before)
    assert (whole.double() - ref).abs().max() <= 2e-6 and (split.double() - ref).abs().max() <= 2e-6
    assert (lse - lse_split).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_puts_each_tokens_keys_and_values_in_its_slots(dtype):
    """`native.write` does what `index_copy_` along the pool's slot dimension does, from the strided views a
    fused projection hands over (each head's values contiguous), for every KV head; a pool of keys only (a latent
    layer's) takes `v` None; a slot outside the pool is refused before anything is written."""
    g = torch.Generator().manual_seed(3)
    nkv, hd, total = 3, 64, 160
    kpool, vpool = torch.randn(nkv, total, hd, generator=g).to(dtype), torch.randn(nkv, total, hd, generator=g).to(dtype)
    fused = torch.randn(5, 2 * nkv + 1, 1, hd, generator=g).to(dtype)  # (N, heads of k, v and one more, 1, hd)
    k, v = fused[:, :nkv], fused[:, nkv:2 * nkv]
    slots = torch.tensor([7, 0, 159, 64, 33])
    assert native.writes(k, kpool) and native.writes(v, vpool) and not k.is_contiguous()
    want_k, want_v = kpool.clone(), vpool.clone()
    want_k.index_copy_(1, slots, k[:, :, 0].transpose(0, 1))
    want_v.index_copy_(1, slots, v[:, :, 0].transpose(0, 1))
    native.write(k, v, kpool, vpool, slots)
    assert torch.equal(kpool, want_k) and torch.equal(vpool, want_v)
    latent = torch.zeros(1, total, hd, dtype=dtype)
    native.write(k[:, :1], None, latent, None, slots)
    assert torch.equal(latent[0, slots], k[:, 0, 0]) and latent.abs().sum(-1).count_nonzero() == 5
    with pytest.raises(IndexError, match="outside the pool"):
        native.write(k[:2], v[:2], kpool, vpool, torch.tensor([1, total]))
    assert torch.equal(kpool, want_k) and torch.equal(vpool, want_v)  # slot 1, before the bad one: untouched
    assert not native.writes(k.float() if dtype != torch.float32 else k.double(), kpool)  # dtypes differ
    assert not native.writes(k.transpose(-1, -2), kpool)  # a head's values not contiguous


@pytest.mark.parametrize("lens", [[700, 40], [40, 129]], ids=["split", "whole"])
def test_the_log_sum_exp_merges_with_attention_over_other_keys(lens):
    """With `lse` the kernel also returns each head's log-sum-exp of its scaled scores: the float64 one, and what
    a cascade needs to merge this part with attention over other keys (here: two halves of one row's blocks,
    merged, equal the whole)."""
    q, k, v, table, lt = pool_and_rows(2, 6, 2, 64, lens, torch.float32)
    out, lse = native.decode(q, k, v, table, lt, 16, 0.125, lse=True)
    slots = (table[:, :, None] * 16 + torch.arange(16)).reshape(2, -1)
    for r, n in enumerate(lens):
        keys = k[:, slots[r, :n]].double().repeat_interleave(3, dim=0)  # (nh, n, hd)
        scores = torch.einsum("hd,hnd->hn", q[r, :, 0].double(), keys) * 0.125
        assert (lse[r].double() - scores.logsumexp(-1)).abs().max() <= 1e-5
    first = torch.tensor([16 * (n // 32) for n in lens])  # each row's first half of whole blocks
    o1, l1 = native.decode(q, k, v, table, first, 16, 0.125, lse=True)
    rest = table.clone()
    rest[:, :-1] = table[:, 1:]  # the rest: from block first / 16 on
    for r, f in enumerate(first.tolist()):
        rest[r, :table.shape[1] - f // 16] = table[r, f // 16:]
    o2, l2 = native.decode(q, k, v, rest, lt - first, 16, 0.125, lse=True)
    m = torch.maximum(l1, l2)
    a, b = (l1 - m).exp()[..., None, None], (l2 - m).exp()[..., None, None]
    assert ((o1 * a + o2 * b) / (a + b) - out).abs().max() <= 2e-6


def test_a_row_reads_its_own_positions_only():
    """Values beyond a row's length, and in blocks it does not hold, never reach its output: poisoned with NaN."""
    q, k, v, table, lt = pool_and_rows(3, 4, 2, 64, [20, 33, 7], torch.float32)
    used = torch.zeros(k.shape[1], dtype=torch.bool)
    for r, n in enumerate(lt.tolist()):
        for p in range(n):
            used[table[r, p // 16] * 16 + p % 16] = True
    k2, v2 = k.clone(), v.clone()
    k2[:, ~used], v2[:, ~used] = float("nan"), float("nan")
    out = native.decode(q, k2, v2, table, lt, 16, 0.125)
    assert torch.isfinite(out).all()
    assert (out.double() - reference(q, k, v, table, lt, 16, 0.125)).abs().max() <= 2e-6


@pytest.mark.parametrize("longest", [5, 300], ids=["whole", "split"])
def test_a_row_of_no_positions_is_zeros(longest):
    """A row that sees nothing (length 0) gets zeros and a log-sum-exp of -inf, whether or not the step's rows
    are split into chunks: a merge with other keys then takes those alone."""
    q, k, v, table, lt = pool_and_rows(2, 4, 2, 64, [longest, 1], torch.float32)
    lt[1] = 0
    out, lse = native.decode(q, k, v, table, lt, 16, 0.125, lse=True)
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(lse[0]).all()


def test_supports_names_what_the_kernel_takes():
    q, k, _, _, _ = pool_and_rows(2, 4, 2, 64, [3, 4], torch.float32)
    assert native.supports(q, k)
    assert not native.supports(q.to(torch.bfloat16), k)  # dtypes differ
    assert not native.supports(q.half(), k.half())  # fp16: not a kernel dtype
    assert not native.supports(q[..., :32], k)  # head widths differ
    q17, k17, *_ = pool_and_rows(1, 17, 1, 8, [3], torch.float32)
    assert not native.supports(q17, k17)  # 17 query heads over one KV head: past its group limit


def test_no_compiler_leaves_the_gathering_path(tmp_path):
    """With no compiler to build it, the kernel is None, the reason is given, and attention gathers as before
    (a fresh interpreter: the kernel is loaded once per process)."""
    code = ("import torch\nfrom meshlm.models import native\n"
            "q = torch.zeros(1, 2, 1, 8); k = torch.zeros(2, 16, 8)\n"
            "assert native.paged_decode() is None and not native.supports(q, k)\n"
            "print(native.unavailable())\n")
    env = {"PATH": str(tmp_path), "CXX": "", "MESHLM_KERNEL_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "no C++ compiler" in done.stdout
    env["MESHLM_PAGED_KERNEL"] = "0"
    done = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "MESHLM_PAGED_KERNEL=0" in done.stdout, done.stderr


def test_the_library_is_built_once_into_its_cache(tmp_path, monkeypatch):
    """The build goes to `MESHLM_KERNEL_CACHE` under a name made of what it was built from, and a second load
    finds it there instead of compiling again."""
    monkeypatch.setenv("MESHLM_KERNEL_CACHE", str(tmp_path))
    cxx = native.compiler()
    first = native._build(cxx)
    assert first.parent == tmp_path and first.exists() and list(tmp_path.iterdir()) == [first]
    stamp = first.stat().st_mtime_ns
    assert native._build(cxx) == first and first.stat().st_mtime_ns == stamp


def test_the_int8_int4_kernel_builds_on_every_cpu_with_avx2_and_fma(tmp_path, monkeypatch):
    """`kernels/quant_rows.cpp` and its operators (`quant_ops.cpp`, PyTorch's headers) build beside the attention
    kernel as one library under its own name, and load into the dispatcher wherever the CPU has AVX2 and FMA (the
    quantized layers' default on CPUs without native bf16 hangs on it: a failed build would silently leave them on
    PyTorch's slower kernels). Each operator then runs in C++: its CPU kernel is not a Python function."""
    monkeypatch.setenv("MESHLM_KERNEL_CACHE", str(tmp_path))
    built = native._build(native.compiler(), native.QUANT_SOURCE, (native.QUANT_OPS_SOURCE,), native.torch_build_flags())
    assert built.name.startswith("quant_ops-") and built.parent == tmp_path
    flags = native._cpu_flags().split()
    if "avx2" in flags and "fma" in flags:
        assert native.quant_rows() is not None, native.unavailable("quant_rows")
        for op in ("int8_rows", "int4_rows"):
            cpu = [line for line in torch._C._dispatch_dump(f"meshlm::{op}").splitlines() if line.startswith("CPU:")]
            assert len(cpu) == 1 and "quant_ops.cpp" in cpu[0], cpu


@pytest.mark.skipif(native.quant_rows() is None, reason=f"meshlm's int8/int4 kernel: {native.unavailable('quant_rows')}")
def test_the_int8_int4_operators_refuse_bad_arguments_by_name():
    """Arguments the kernel cannot take are refused in C++ before it runs, each error naming the operator and what
    it needs: an input width not a multiple of 32, a weight of another width, a bf16 input, scales of another
    dtype or count, and int4 groups that do not divide the width."""
    x = torch.randn(2, 64)
    q, s = torch.zeros(8, 64, dtype=torch.int8), torch.ones(8)
    packed, pairs = torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 2, 2)
    assert torch.ops.meshlm.int8_rows.default(x, q, s).shape == (2, 8)  # the good call, for contrast
    assert torch.ops.meshlm.int4_rows.default(x, packed, pairs, 32).shape == (2, 8)
    bad = [(lambda: torch.ops.meshlm.int8_rows.default(torch.randn(2, 48), q[:, :48].contiguous(), s),
            "meshlm::int8_rows: x must be a non-empty (rows, K) float32 CPU tensor with K a multiple of 32"),
           (lambda: torch.ops.meshlm.int8_rows.default(x, torch.zeros(8, 32, dtype=torch.int8), s),
            "meshlm::int8_rows: q must be contiguous (N, 64) int8"),
           (lambda: torch.ops.meshlm.int8_rows.default(x.bfloat16(), q, s), "float32 CPU tensor"),
           (lambda: torch.ops.meshlm.int8_rows.default(x, q, s.half()), "scales must be float32 or bfloat16"),
           (lambda: torch.ops.meshlm.int8_rows.default(x, q, torch.ones(7)), "s must hold 8 contiguous scales"),
           (lambda: torch.ops.meshlm.int4_rows.default(x, packed, pairs, 48), "group 48 must be a multiple of 32"),
           (lambda: torch.ops.meshlm.int4_rows.default(x, packed, torch.ones(8, 1, 2), 32),
            "scales_and_zeros must be contiguous (8, 2, 2)")]
    for call, message in bad:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            call()


def test_row_decode_runs_in_cpp_and_equals_the_kernel_called_from_python():
    """`native.row_ops()` builds `kernels/paged_ops.cpp` with the kernel against PyTorch's headers and loads it:
    the operator `meshlm::row_decode` (the compiled one-token step's attention, models/paged.py) then has a CPU
    kernel registered from C++ in place of its Python one, which gives the same output bit for bit as
    `native.decode` (the same kernel, the same chunks and threads) in fp32 and bf16; arguments it cannot take are
    refused in C++, each error naming the operator and what it needs."""
    from meshlm.models import paged  # noqa: F401  (defines the operator's schema)

    assert native.row_ops() is not None, native.unavailable("row_ops")
    cpu = [line for line in torch._C._dispatch_dump("meshlm::row_decode").splitlines() if line.startswith("CPU:")]
    assert len(cpu) == 1 and "paged_ops.cpp" in cpu[0], cpu
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, table, lens = pool_and_rows(3, 9, 3, 64, [1, 130, 300], dtype)
        out = torch.ops.meshlm.row_decode.default(q, k, v, table, lens, 16, 0.11)
        assert out.dtype == dtype and torch.equal(out, native.decode(q, k, v, table, lens, 16, 0.11))
    q, k, v, table, lens = pool_and_rows(2, 4, 2, 32, [5, 40], torch.float32)
    bad = [((q.half(), k, v, table, lens, 16), "q must be float32 or bfloat16"),
           ((torch.randn(2, 4, 1, 64)[..., ::2], k, v, table, lens, 16), "q must be (rows, heads, 1, head_dim) with each head's values"),
           ((q, k.transpose(0, 1).contiguous().transpose(0, 1), v, table, lens, 16),
            "k and v must be contiguous (kv_heads, slots, 32)"),
           ((q, k, v[:1].contiguous(), table, lens, 16), "pools of one shape"),
           ((q, k, v, table.int(), lens, 16), "table must be (2, blocks) int64"),
           ((q, k, v, table, lens[:1], 16), "lens must hold 2 int64 lengths"),
           ((q, k, v, table, lens, 0), "block_size must be positive"),
           ((torch.randn(2, 5, 1, 32), k, v, table, lens, 16), "5 query heads over 2 KV heads")]
    for args, message in bad:
        with pytest.raises(RuntimeError, match="meshlm::row_decode: .*" + re.escape(message)):
            torch.ops.meshlm.row_decode.default(*args, 0.1)
