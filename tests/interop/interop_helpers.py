"""Shared by the tests of meshlm/interop and `meshlm embed`: the CLI in this process, one-line errors."""

from __future__ import annotations

import contextlib
import io

import torch

from meshlm.cli import main
from meshlm.families.registry import get_spec

SENTENCES = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "Two men pushed carts through the woods.",
    "Héllo, naïve café — ümlauts and punctuation!",
    "The quick brown fox jumps over the lazy dog; the dog, unimpressed, goes back to sleep in the sun.",
    "",
]


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `meshlm.cli.main(argv)` in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def ok(argv: list[str]) -> str:
    code, out, err = run_main(argv)
    assert code == 0, err
    return out


def one_error_line(argv: list[str], *words: str) -> str:
    """Run `argv`, which must fail as the CLI promises: exit 2, one line `error: ...` naming `words`."""
    code, _, err = run_main(argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter moved by noise, so biases are non-zero and norms differ from one: a mapping that
    drops, swaps or mis-stacks a tensor shows in the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key


# ---- a checkpoint of a parallel layout ----------------------------------------------------------------------
SHARDED_SEED = 1234
SHARDED_MODELS = {
    "gpt": {"vocab_size": 50257, "n_layers": 2, "hidden_size": 32, "n_heads": 4, "seq_len": 16},
    "bert": {"family": "bert", "vocab_size": 30522, "n_layers": 2, "hidden_size": 32, "n_heads": 4, "seq_len": 16,
             "activation": "gelu_exact", "bert_head": "mlm", "norm_eps": 1e-12},
}


class IdTokenizer:
    """Token ids as text: all the engine needs of a tokenizer in these tests."""

    eod_id = None

    def decode(self, ids):
        return " ".join(map(str, ids))


def load_whole(model_class, path):
    """`model_class.from_pretrained(path)` in eval mode, asserting every tensor of the files was used and none
    was missing or of another shape."""
    model, info = model_class.from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()

def assert_generate_and_engine_equal_hf(hf, model, prompt: torch.Tensor, new: int = 12) -> None:
    """`models.generate` (KV cache) and the paged engine (default blocks, then blocks of 4 with prefill chunks of
    3; a prompt alone, then both rows, the second sharing its first tokens with the cached first one so decoding
    rows share blocks) continue the (2, T) `prompt` as the transformers model `hf`'s greedy generate does."""
    from meshlm.infer.engine import CacheOptions, Engine
    from meshlm.infer.sampling import SamplingParams
    from meshlm.models.generate import generate

    T = prompt.shape[1]
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    ours = generate(model, prompt, new, temperature=0)
    assert torch.equal(ours, theirs)
    assert len(set(ours[:, T:].flatten().tolist())) > 4  # a continuation, not one token repeated
    sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for options in (CacheOptions(), CacheOptions(block_size=4, max_batched_tokens=3)):
        engine = Engine(model, IdTokenizer(), max_seqs=2, options=options)
        assert engine.generate([prompt[0].tolist()], sp)[0].output_ids == theirs[0, T:].tolist()
        reqs = engine.generate([row.tolist() for row in prompt], sp)  # now sharing the cached prompt blocks
        assert [r.output_ids for r in reqs] == theirs[:, T:].tolist()


def assert_generate_and_serve_equal_hf(hf, tmp_path, eod: int = 50256, new: int = 8,
                                       prompts: tuple[str, ...] = ("ROMEO. But soft, what light", "Hello")) -> None:
    """`meshlm generate` (one sequence, the paged engine in process) and `meshlm serve` (the prompts batched) give the
    transformers model `hf`'s greedy tokens (gpt2 tokenizer; `eod` must be its end-of-sequence id, never reached)."""
    import json

    from meshlm.data.tokenizers import get_tokenizer
    from tests.infer.server_helpers import ServeProcess, http

    hf.save_pretrained(str(tmp_path / "hf"))
    ok(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    tok = get_tokenizer("gpt2")
    want = {}
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=eod)
        want[prompt] = out[0, ids.shape[1]:].tolist()
        assert eod not in want[prompt]
        text = ok(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", prompt, "--max-new-tokens",
                   str(new), "--temperature", "0"])
        assert text == tok.decode(tok.encode(prompt) + want[prompt]) + "\n"
    server = ServeProcess("--checkpoint", str(tmp_path / "run"), "--max-seqs", "4")
    try:
        body = {"model": "run", "prompt": list(prompts), "max_tokens": new, "temperature": 0}
        status, _, text = http("POST", server.url + "/v1/completions", body)
        assert status == 200, text
        choices = sorted(json.loads(text)["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in choices] == [tok.decode(want[p]) for p in prompts]
    finally:
        assert server.stop() == 0, "".join(server.stderr)[-3000:]

def sharded_config(family: str, tp: int = 2):
    from meshlm.core.config import build

    return build({"model": SHARDED_MODELS[family], "parallel": {"tp": tp, "timeout_s": 60},
                  "data": {"tokenizer": "bert" if family == "bert" else "gpt2"},
                  "train": {"micro_batch_size": 1, "global_batch_size": 1}})


def _save_sharded(rank: int, world: int, out_dir: str, family: str) -> None:
    """Rank `rank` of a tp = `world` layout saves its shards of the model built from SHARDED_SEED (equal to
    the slices of the whole model built from that seed in one process)."""
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    from meshlm.checkpoint import sharded
    from meshlm.parallel import build_model
    from meshlm.parallel.mesh import ParallelDims
    from meshlm.parallel.rng import TPRNGTracker
    from meshlm.train.optim import build_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        cfg = sharded_config(family, world)
        dims = ParallelDims.build(tp=world, pp=1, dp=1, timeout_s=60)
        torch.manual_seed(SHARDED_SEED)
        par = build_model(cfg, dims, rng=TPRNGTracker(SHARDED_SEED, dims.tp_rank), spec=get_spec(cfg.model.family))
        opt = build_optimizer(par.grad_sync, cfg.optim)
        layout = {"world_size": world, "tp": world, "pp": 1, "dp": 1, "sp": False, "zero": 0}
        sharded.save(Path(out_dir) / "run", 0, par.grad_sync, opt, {"step": 0, "layout": layout},
                     cfg.to_dict(), {}, spec=par.spec)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def save_sharded_checkpoint(family: str, out_dir, world: int = 2, deadline_s: float = 120) -> None:
    """OUT_DIR/run: a checkpoint of `family`'s small model saved by a spawned gloo world of tp = `world`."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(_save_sharded, args=(world, str(out_dir), family), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1.0):
            assert time.monotonic() < deadline, f"the tp={world} world did not finish in {deadline_s} s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
