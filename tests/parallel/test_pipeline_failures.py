"""A pipeline rank that dies or hangs mid-step makes every other rank exit with a clear error, in time.

Each test spawns its own gloo world (not `run_world`, which kills the survivors as soon as one process
fails: here the survivors' own exit is what is tested) under a deadline, and checks that every process
ended, that the survivors failed with `PipelinePeerError` naming `parallel.timeout_s`, and how long they took.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshlm.core.config import build
from meshlm.families.registry import get_spec
from meshlm.models.gpt import GPT
from meshlm.models.loss import cross_entropy
from meshlm.parallel.mesh import ParallelDims
from meshlm.parallel.pipeline import apply_pipeline

DEADLINE_S = 90  # the test's own: far above what the checks allow


def _entry(rank: int, world: int, out_dir: str, victim: int, how: str, timeout_s: float) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    cfg = build({"model": {"n_layers": world, "hidden_size": 32, "n_heads": 4, "seq_len": 16, "vocab_size": 101},
                 "train": {"micro_batch_size": 1, "global_batch_size": 4},
                 "parallel": {"pp": world, "timeout_s": timeout_s}})
    dims = ParallelDims.build(pp=world, timeout_s=timeout_s)
    torch.manual_seed(0)
    pipe = apply_pipeline(GPT(cfg.model), dims, cfg, cross_entropy, spec=get_spec(cfg.model.family))
    forwards = [0]

    def fail(module, args):
        forwards[0] += 1
        if rank == victim and forwards[0] == 6:  # the second micro-batch of the second step
            (Path(out_dir) / "failed_at").write_text(str(time.time()))
            if how == "dies":
                os._exit(3)
            time.sleep(3600)  # hangs (the test kills it)

    pipe.modules[0].register_forward_pre_hook(fail)
    x = torch.randint(0, 101, (4, 17), generator=torch.Generator().manual_seed(0))
    try:
        for _ in range(3):
            pipe.train_step(x[:, :-1], x[:, 1:])
        (Path(out_dir) / f"finished_{rank}").write_text("")
    except BaseException:
        (Path(out_dir) / f"error_{rank}.txt").write_text(f"{time.time()}\n{traceback.format_exc()}")
        raise  # the process exits with code 1


def _run(tmp_path: Path, world: int, victim: int, how: str, timeout_s: float) -> dict:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, world, str(tmp_path), victim, how, timeout_s)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    survivors = [p for r, p in enumerate(procs) if r != victim]
    try:
        while any(p.is_alive() for p in survivors) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [r for r, p in enumerate(procs) if r != victim and p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    failed_at = float((tmp_path / "failed_at").read_text())
    errors = {}
    for r in range(world):
        path = tmp_path / f"error_{r}.txt"
        if path.exists():
            stamp, text = path.read_text().split("\n", 1)
            errors[r] = (float(stamp) - failed_at, text)
    return {"alive": alive, "codes": [p.exitcode for p in procs], "errors": errors}


def _check(result: dict, world: int, victim: int, within_s: float) -> None:
    assert not result["alive"], f"ranks {result['alive']} still running at the test deadline"
    for r in range(world):
        if r == victim:
            continue
        assert result["codes"][r] == 1, f"rank {r} exited with {result['codes'][r]}"
        took, text = result["errors"][r]
        assert "PipelinePeerError" in text and "parallel.timeout_s" in text, text[-2000:]
        assert "neighbouring pipeline rank stopped or did not answer" in text
        assert took <= within_s, f"rank {r} needed {took:.1f}s to fail"


def test_a_dead_rank_stops_the_whole_pipeline_with_a_clear_error(tmp_path):
    timeout_s = 20.0
    result = _run(tmp_path, 3, victim=1, how="dies", timeout_s=timeout_s)  # the middle stage of three
    assert result["codes"][1] == 3
    _check(result, 3, victim=1, within_s=timeout_s)  # a closed connection is noticed at once, in practice


def test_a_hung_rank_times_out_after_parallel_timeout_s(tmp_path):
    timeout_s = 4.0
    result = _run(tmp_path, 2, victim=1, how="hangs", timeout_s=timeout_s)
    _check(result, 2, victim=1, within_s=timeout_s + 5.0)  # the timeout plus scheduling slack on 2 cores
    took = result["errors"][0][0]
    assert took >= timeout_s - 0.5, f"rank 0 gave up after {took:.1f}s, before parallel.timeout_s={timeout_s}"
