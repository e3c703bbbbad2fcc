"""One OpenMP thread pool per process: the engine's.

PyTorch's CPU kernels, and the C++ kernels Inductor compiles, run their parallel regions on OpenMP. GNU
OpenMP (the runtime the Linux wheels ship) keeps a pool of worker threads for each thread that has started a
parallel region. When a process holds more of its workers than it has CPUs, every worker stops spinning
between regions and sleeps at once, so each region pays a wake-up. A server loads and compiles its model on
the main thread (one pool) and then runs the engine on a thread of its own (a second pool). On a 2-core host
that made a decode step 1.6× slower in the engine's thread than on the main thread: a compiled SmolLM2 bf16
step streamed 36 tokens/s there against 57 (benchmarks/RESULTS.md, "One OpenMP pool").
`release_pool()`, called by the thread that owns a pool once its parallel work is done, hands the workers
back (OpenMP 5.0's `omp_pause_resource_all`), and the engine's pool is then the only one.
"""

from __future__ import annotations

import ctypes

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release the threads, keep what can be rebuilt


def release_pool() -> bool:
    """Release the calling thread's OpenMP worker threads (a later parallel region on this thread starts a new
    pool). True when the runtime did; False where no OpenMP runtime with `omp_pause_resource_all` is loaded
    (nothing to release, nothing changed)."""
    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError, TypeError):  # no such symbol in the process; no global namespace (Windows)
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0
