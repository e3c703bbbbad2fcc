"""meshlm's own CPU kernels: C++ sources in `models/kernels/`, compiled on first use and loaded (ctypes, or the
dispatcher for the operators registered from C++).

Decoding rows attend over the paged pool in place (`kernels/paged_decode.cpp`): each row's keys and values are
read through its block table where they lie, instead of being gathered into a copy first (models/paged.py). The
source is plain C++ with no PyTorch headers, so it builds in about a second with the compiler PyTorch's Inductor
uses (`CXX`, else `c++`/`g++`/`clang++` on the PATH), for this CPU (`-march=native`) and with OpenMP. The
shared library goes to `$MESHLM_KERNEL_CACHE` (default `~/.cache/meshlm/kernels`), named by a digest of the
source, the flags, the compiler and this CPU's feature flags, so another CPU or a changed source builds its own;
it is written under a temporary name and renamed, so processes that build it at once never load half a file.
Its OpenMP calls go to the runtime PyTorch has already loaded (`libgomp.so.1` is matched by name), so the
kernel's parallel regions run on the engine thread's one pool (`infer/openmp.py`).

Where no compiler is found or the build fails, `paged_decode()` is None, the reason is in `unavailable()`, and
attention takes the gathering path it always had; `MESHLM_PAGED_KERNEL=0` chooses that path on purpose. A
compiled one-token step calls the same kernel as the operator `meshlm::row_decode` (models/paged.py), whose CPU
kernel `row_ops()` registers from C++ (`kernels/paged_ops.cpp`, built with a second copy of the kernel against
PyTorch's headers; where that fails the operator keeps its Python kernel, which calls `decode`).

Matrix products of a few rows with int8/int4 weights (`kernels/quant_rows.cpp`, for CPUs with AVX2 and FMA) are
the operators `meshlm::int8_rows` and `meshlm::int4_rows`, whose schemas this module defines and whose CPU kernels
are registered from C++ (`kernels/quant_ops.cpp`, built with the kernel against the installed PyTorch's headers
and libraries, about 12 s the first time, and loaded with `torch.ops.load_library`): a compiled step calls them
without any Python in between (a call costs about 4 µs instead of 11 through a Python function and ctypes).
`quant_rows()` loads them (None, and `unavailable("quant_rows")` the reason, where they cannot be built;
`MESHLM_QUANT_KERNEL=0` turns them off); `infer/quantize.py` decides where they run.

Matrix products of a few bf16 rows with a bf16 weight (`kernels/bf16_rows.cpp`, for CPUs with AVX512-BF16: 32
inputs' pair products a `vdpbf16ps`) are the operator `meshlm::bf16_rows`, registered from C++ the same way
(`kernels/bf16_ops.cpp`); `bf16_rows()` loads it (`MESHLM_BF16_KERNEL=0` turns it off) and `infer/rows.py` decides
where it runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "kernels" / "paged_decode.cpp"
QUANT_SOURCE = SOURCE.parent / "quant_rows.cpp"
QUANT_OPS_SOURCE = SOURCE.parent / "quant_ops.cpp"  # its operators, registered from C++
BF16_SOURCE = SOURCE.parent / "bf16_rows.cpp"
BF16_OPS_SOURCE = SOURCE.parent / "bf16_ops.cpp"  # its operator, registered from C++
PAGED_OPS_SOURCE = SOURCE.parent / "paged_ops.cpp"  # SOURCE's operator `row_decode`, registered from C++
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++17", "-shared",
         "-fPIC"]
# positions one work item reads before a row is split across work items (split-K: `kernels/paged_decode.cpp`);
# 128 keeps a 1-16 row step's work spread over the threads, 64 rows x a few KV heads fill them anyway
CHUNK = 128
DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_state: dict = {}


def enabled() -> bool:
    """Whether in-place decoding attention may be used (`MESHLM_PAGED_KERNEL=0` turns it off)."""
    return os.environ.get("MESHLM_PAGED_KERNEL", "1") != "0"


def cache_dir() -> Path:
    return Path(os.environ.get("MESHLM_KERNEL_CACHE") or Path.home() / ".cache" / "meshlm" / "kernels")


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _build(cxx: str, source: Path | None = None, extra: tuple[Path, ...] = (), link: tuple[str, ...] = ()) -> Path:
    """The shared library of `source` (None: SOURCE) and the sources `extra`, compiled with FLAGS and the flags
    `link` (after the sources), in the cache: built once per digest of their texts, the flags, the compiler and this
    CPU's feature flags."""
    source = source or SOURCE  # read at call time: a benchmark may point SOURCE at another version
    sources = [source, *extra]
    version = subprocess.run([cxx, "--version"], check=False, capture_output=True, text=True).stdout
    digest = hashlib.sha256("\0".join([*(s.read_text() for s in sources), " ".join(FLAGS), " ".join(link), version,
                                       _cpu_flags()]).encode())
    target = cache_dir() / f"{sources[-1].stem}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, *map(str, sources), *link, "-o", tmp], check=False, capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed on {' and '.join(s.name for s in sources)}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _open(switch: str, source: Path | None = None, extra: tuple[Path, ...] = (), link: tuple[str, ...] = ()):
    """(the library `_build` makes of `source` (None: SOURCE), `extra` and `link`, loaded with ctypes, '') or (None,
    why not): off when the environment variable `switch` is 0, no compiler, or a failed build or load."""
    if os.environ.get(switch, "1") == "0":
        return None, f"{switch}=0"
    cxx = compiler()
    if cxx is None:
        return None, "no C++ compiler on the PATH (set CXX)"
    try:
        return ctypes.CDLL(str(_build(cxx, source, extra, link))), ""
    except (OSError, RuntimeError) as err:
        return None, str(err)


def _load():
    lib, why = _open("MESHLM_PAGED_KERNEL")  # `enabled()`'s switch
    if lib is None:
        return None, why
    fn = lib.meshlm_paged_decode
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                   i64, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    limits = (lib.meshlm_paged_decode_limits(0), lib.meshlm_paged_decode_limits(1))
    writer = lib.meshlm_paged_write
    writer.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    writer.restype = ctypes.c_int
    return (fn, limits, writer), ""


def paged_decode():
    """(the kernel's ctypes function, (most query heads per KV head, widest head), the slot writer's ctypes
    function), built and loaded once per process; None where it cannot be (`unavailable()` says why)."""
    if "kernel" not in _state:
        with _lock:
            if "kernel" not in _state:
                _state["kernel"], _state["why"] = _load()
    return _state["kernel"]


def unavailable(kernel: str = "paged_decode") -> str:
    """Why `paged_decode()` (or `quant_rows()`, kernel="quant_rows"; `row_ops()`, kernel="row_ops"; `bf16_rows()`,
    kernel="bf16_rows") is None ('' when it is not)."""
    if kernel == "quant_rows":
        quant_rows()
        return _state["quant_why"]
    if kernel == "row_ops":
        row_ops()
        return _state["row_ops_why"]
    if kernel == "bf16_rows":
        bf16_rows()
        return _state["bf16_why"]
    paged_decode()
    return _state["why"]


def torch_build_flags() -> tuple[str, ...]:
    """What a source that includes PyTorch's headers needs after the sources: the installed torch's include
    folder, its C++ ABI, and its libraries (found again at load time, where torch has already loaded them); its
    version as a define too, so that another torch builds a library of its own (`_build`'s digest)."""
    root = Path(torch.__file__).resolve().parent
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return (f"-I{root / 'include'}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DMESHLM_TORCH={torch.__version__}",
            f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}", "-lc10", "-ltorch_cpu")


def _into_dispatcher(lib, why: str):
    """(the path of `lib`, a library of operators' CPU kernels opened by `_open`, once loaded into PyTorch's
    dispatcher, '') or (None, why not)."""
    if lib is None:
        return None, why
    try:
        torch.ops.load_library(lib._name)  # registers the operators' CPU kernels
    except (OSError, RuntimeError) as err:
        return None, str(err)
    return lib._name, ""


def _load_ops(switch: str, source: Path, ops: Path, missing: str, lacks: str):
    """A kernel `source` and its operators `ops` as one library, loaded into PyTorch's dispatcher (`_into_dispatcher`);
    (None, `lacks`) where the build for this CPU defines the symbol `missing` instead of the kernel."""
    lib, why = _open(switch, source, (ops,), torch_build_flags())
    if lib is not None and hasattr(lib, missing):
        return None, lacks
    return _into_dispatcher(lib, why)


def _load_quant():
    """quant_rows.cpp and its operators (quant_ops.cpp)."""
    return _load_ops("MESHLM_QUANT_KERNEL", QUANT_SOURCE, QUANT_OPS_SOURCE, "meshlm_quant_rows_missing",
                     "this CPU lacks AVX2 and FMA")


def quant_rows():
    """The library of the operators `meshlm::int8_rows` and `meshlm::int4_rows` (its path), built and loaded once
    per process; None where it cannot be (`unavailable("quant_rows")` says why): then nothing may call them."""
    if "quant" not in _state:
        with _lock:
            if "quant" not in _state:
                _state["quant"], _state["quant_why"] = _load_quant()
    return _state["quant"]


def bf16_rows():
    """The library of the operator `meshlm::bf16_rows` (its path), built and loaded once per process; None where it
    cannot be (`unavailable("bf16_rows")` says why: no AVX512-BF16, no compiler, `MESHLM_BF16_KERNEL=0`): then
    nothing may call it."""
    if "bf16" not in _state:
        with _lock:
            if "bf16" not in _state:
                _state["bf16"], _state["bf16_why"] = _load_ops("MESHLM_BF16_KERNEL", BF16_SOURCE, BF16_OPS_SOURCE,
                                                               "meshlm_bf16_rows_missing", "this CPU lacks AVX512-BF16")
    return _state["bf16"]


def row_ops():
    """The library whose CPU kernel of `meshlm::row_decode` (models/paged.py) is paged_decode.cpp's, called from C++
    (paged_ops.cpp; its path), built and loaded once per process; None where it cannot be (`unavailable("row_ops")`
    says why): then the operator keeps its Python kernel, which calls `decode`. A compiled one-token step's 30
    attention calls (SmolLM2) skip Python and ctypes with it. The plain kernel (`paged_decode()`) stays a library of
    its own, free of PyTorch's headers (a second to build, not 12)."""
    if "row_ops" not in _state:
        with _lock:
            if "row_ops" not in _state:
                lib, why = _open("MESHLM_PAGED_KERNEL", SOURCE, (PAGED_OPS_SOURCE,),
                                 (*torch_build_flags(), f"-DMESHLM_CHUNK={CHUNK}"))
                _state["row_ops"], _state["row_ops_why"] = _into_dispatcher(lib, why)
    return _state["row_ops"]


# The operators' schemas and shapes (their CPU kernels come with `quant_rows()`): what a compiled step traces.
# int8_rows: x (R, K) fp32 times the int8 weight q (N, K) scaled per channel by s (N,) in fp32 or bf16, transposed:
# (R, N) fp32, x (q·s)ᵀ. int4_rows: x (R, K) fp32 times W = (q - 8)·s + z, transposed: (R, N) fp32; `packed` (N,
# K/2) uint8 holds the codes q in `kernels/quant_rows.cpp`'s layout, `scales_and_zeros` (N, K/group, 2) the groups'
# (s, z) in fp32 or bf16. Call them only where `quant_rows()` is not None.
LIBRARY = torch.library.Library("meshlm", "FRAGMENT")
LIBRARY.define("int8_rows(Tensor x, Tensor q, Tensor s) -> Tensor")
LIBRARY.define("int4_rows(Tensor x, Tensor packed, Tensor scales_and_zeros, int group) -> Tensor")
# bf16_rows: x (R, K) bf16 times the bf16 weight w (N, K), transposed: (R, N) bf16, the sums in fp32 rounded once.
# Call it only where `bf16_rows()` is not None.
LIBRARY.define("bf16_rows(Tensor x, Tensor w) -> Tensor")


@torch.library.register_fake("meshlm::int8_rows", lib=LIBRARY)
def _int8_rows_shape(x, q, s):
    return x.new_empty(x.shape[0], q.shape[0])


@torch.library.register_fake("meshlm::bf16_rows", lib=LIBRARY)
def _bf16_rows_shape(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.register_fake("meshlm::int4_rows", lib=LIBRARY)
def _int4_rows_shape(x, packed, scales_and_zeros, group):
    return x.new_empty(x.shape[0], packed.shape[0])


def takes_pool(pool: torch.Tensor, n_heads: int) -> bool:
    """Whether the kernel takes a pool tensor `pool` (nkv, slots, hd) read by `n_heads` query heads of its dtype:
    on a CPU, fp32 or bf16, and the heads within the kernel's limits."""
    if pool.device.type != "cpu" or pool.dtype not in DTYPES or (kernel := paged_decode()) is None:
        return False
    max_group, max_hd = kernel[1]
    nkv, hd = pool.shape[0], pool.shape[2]
    return n_heads % nkv == 0 and n_heads // nkv <= max_group and hd <= max_hd


def supports(q: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether the kernel takes queries `q` (R, nh, 1, hd) over pool tensor `pool`: the pool's dtype and head
    width, each head's values contiguous, and `takes_pool`."""
    return (q.dtype == pool.dtype and q.shape[-1] == pool.shape[2] and q.stride(-1) == 1
            and takes_pool(pool, q.shape[1]))


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
           block_size: int, scale: float, lse: bool = False):
    """softmax(q kᵀ · scale) v for R decoding rows read in place: q (R, nh, 1, hd), the pool's k and v (nkv, slots,
    hd) contiguous, table (R, nb) int64 block ids, lens (R,) int64 positions row r sees (its first lens[r], at
    least 1) → (R, nh, 1, hd) in q's dtype; with `lse`, (that, each head's log-sum-exp of its scaled scores (R,
    nh) in fp32), to merge with attention over other keys. Call only where `supports(q, k)`."""
    fn = paged_decode()[0]
    R, nh, _, hd = q.shape
    nkv, slots, _ = k.shape
    table, lens = table.contiguous(), lens.contiguous()
    out = torch.empty((R, nh, 1, hd), dtype=q.dtype)
    sums = torch.empty((R, nh), dtype=torch.float32) if lse else None
    status = fn(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), table.data_ptr(), table.shape[1],
                lens.data_ptr(), out.data_ptr(), None if sums is None else sums.data_ptr(), R, nh, nkv, hd, slots,
                block_size, scale, CHUNK, DTYPES[q.dtype], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"meshlm_paged_decode refused its arguments (status {status})")
    return out if sums is None else (out, sums)


def writes(new: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether `write` takes new rows `new` (N, nkv, 1, hd) into pool tensor `pool` (nkv, slots, hd): on a CPU, the
    pool contiguous and of the rows' dtype, each row's head values contiguous, and the kernel built."""
    return (new.device.type == "cpu" and new.dtype == pool.dtype and new.stride(-1) == 1 and pool.is_contiguous()
            and new.shape[-1] == pool.shape[2] and new.shape[1] == pool.shape[0] and paged_decode() is not None)


def write(k: torch.Tensor, v: torch.Tensor | None, kpool: torch.Tensor, vpool: torch.Tensor | None,
          slots: torch.Tensor) -> None:
    """Token t's keys k[t] (nkv, 1, hd) into slot slots[t] of every head of `kpool` (nkv, slots, hd), its values
    likewise into `vpool` (None: a pool of keys only): `kpool.index_copy_(1, slots, k[:, :, 0].transpose(0, 1))`
    without the strided copy's set-up. Call only where `writes(k, kpool)` (and `writes(v, vpool)`)."""
    fn = paged_decode()[2]
    slots = slots.to(torch.long).contiguous()
    nkv, total, hd = kpool.shape
    status = fn(k.data_ptr(), k.stride(0), k.stride(1), None if v is None else v.data_ptr(),
                0 if v is None else v.stride(0), 0 if v is None else v.stride(1), kpool.data_ptr(),
                None if vpool is None else vpool.data_ptr(), slots.data_ptr(), slots.shape[0], nkv, hd, total,
                kpool.element_size())
    if status != 0:  # nothing was written
        raise IndexError(f"meshlm_paged_write: a slot outside the pool's {total}; nothing written")

