"""meshlm's training step against a minimal plain-PyTorch step, over a grid of shapes, measured in one run.

    python benchmarks/train_step.py [--steps 8] [--precisions fp32,auto] [--grid h128s128,h384s256,...]
    python benchmarks/train_step.py --smoke    # h = 32, s = 32, fp32, one timed step

The reference is what a user would write by hand: a nanoGPT-style model (fused QKV, SDPA, tanh GELU, tied
head), `F.cross_entropy` on the logits, `torch.optim.AdamW`, clip, step, on a batch of the same corpus. meshlm
runs its real Trainer.train_step (data loader, LR schedule, precision, accumulation, clipping) as configured
(`train.fused_loss=auto`: the fused chunked head + loss of models/loss.py where it wins), and, with
`--unfused`, also with `train.fused_loss=false` (logits + cross-entropy, like the reference). They are
timed alternately, step by step in one process (so all see the same machine load), after two warm-up
steps; the table reports the median tokens/s and the ratio to the reference (target ≥ 1.0), and the run
ends with the worst ratio.

The grid: h ∈ {128, 384, 768, 1024} × s ∈ {128, 256, 1024}, GPT-2's vocabulary (50,257). Layers and
micro-batch shrink as h grows (4, 2, 1, 1 layers; 1024, 512, 256, 256 tokens a step, or one row of s
when longer) so that the whole grid runs in about 20 minutes on a loaded 2-core CPU (the 50k-vocabulary
head dominates at these widths): see `grid_shape`. `--precisions` takes fp32, bf16, fp16 and auto
(`train.precision=auto`, resolved as meshlm resolves it on this host); the reference runs under the
same autocast dtype.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script
from torch import nn

from meshlm.core.config import load_config
from meshlm.train.trainer import Trainer

WIDTHS = (128, 384, 768, 1024)
LENGTHS = (128, 256, 1024)
# width: (layers, heads, tokens per step, at least one row of s). The head (6·V·h FLOPs a token, 2.4e8 at
# h = 768) dominates at these widths, so tokens and layers shrink as h grows.
PER_WIDTH = {128: (4, 4, 1024), 384: (2, 6, 512), 768: (1, 12, 256), 1024: (1, 16, 256)}


def grid_shape(h: int, s: int) -> list[str]:
    """Overrides on gpt-tiny for width h and sequence length s."""
    layers, heads, tokens = PER_WIDTH.get(h, (2, max(1, h // 64), 1024))
    batch = max(1, tokens // s)
    return [f"--model.n_layers={layers}", f"--model.hidden_size={h}", f"--model.n_heads={heads}",
            f"--model.seq_len={s}", f"--train.micro_batch_size={batch}", f"--train.global_batch_size={batch}"]


def parse_grid(text: str) -> list[tuple[int, int]]:
    """"all" or "h128s128,h384s256,…" → [(h, s), …]."""
    if text == "all":
        return [(h, s) for h in WIDTHS for s in LENGTHS]
    out = []
    for item in text.split(","):
        h, _, s = item.strip().lstrip("h").partition("s")
        out.append((int(h), int(s)))
    return out


class RefBlock(nn.Module):
    def __init__(self, h: int, nh: int):
        super().__init__()
        self.nh = nh
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class RefGPT(nn.Module):
    def __init__(self, V: int, s: int, h: int, nh: int, L: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, h), nn.Embedding(s, h)
        self.blocks = nn.ModuleList(RefBlock(h, nh) for _ in range(L))
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, V, bias=False)
        self.head.weight = self.wte.weight
        # GPT-2 init, as any hand-written GPT does. PyTorch's default N(0, 1) embedding, tied to the head, gives
        # huge logits and denormal gradients that slowed this reference's CPU step up to 12× (measured).
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def reference_step(model, opt, batch, dtype):
    ctx = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else torch.autocast("cpu", enabled=False)
    with ctx:
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def make_trainer(shape: tuple[int, int], precision: str, out_dir: str, fused: str) -> Trainer:
    cfg = load_config("gpt-tiny", grid_shape(*shape) + [
        f"--train.precision={precision}", f"--train.out_dir={out_dir}", "--train.progress=false",
        "--train.resume=never", f"--train.fused_loss={fused}", "--train.max_steps=100000"])
    return Trainer(cfg, progress=False)


def bench(shape: tuple[int, int], precisions: list[str], steps: int, out_dir: str, unfused: bool) -> list[dict]:
    """One row per precision; every stepper of every precision alternates in one loop."""
    steppers, rows = {}, []
    for precision in precisions:
        trainer = make_trainer(shape, precision, f"{out_dir}-{precision}", "auto")
        m, t = trainer.cfg.model, trainer.cfg.train
        name = trainer.precision.name  # auto's resolution
        if any(r["precision"] == name for r in rows):
            continue  # auto resolved to a precision already measured
        ref = RefGPT(m.vocab_size, m.seq_len, m.hidden_size, m.n_heads, m.n_layers)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=True)
        # The same real text meshlm trains on (random ids would change the embedding backward's cost).
        batch = torch.stack([torch.as_tensor(trainer.train_set[i], dtype=torch.long)
                             for i in range(t.micro_batch_size)])
        steppers[f"meshlm {name}"] = trainer.train_step
        steppers[f"reference {name}"] = functools.partial(reference_step, ref, ref_opt, batch, trainer.precision.dtype)
        if unfused:
            steppers[f"unfused {name}"] = make_trainer(shape, name, f"{out_dir}-{name}-unfused", "false").train_step
        rows.append({"h": m.hidden_size, "s": m.seq_len, "layers": m.n_layers, "batch": t.global_batch_size,
                     "params_M": trainer.model.num_params() / 1e6, "precision": name, "asked": precision,
                     "fused": trainer.fused_loss, "tokens": t.global_batch_size * m.seq_len})
    times = {who: [] for who in steppers}
    for i in range(steps + 2):  # alternate, so all see the same machine load; the first two are warm-up
        for who, step in steppers.items():
            start = time.perf_counter()
            step()
            if i >= 2:
                times[who].append(time.perf_counter() - start)
    for r in rows:
        for who in ("meshlm", "reference", "unfused"):
            if f"{who} {r['precision']}" in times:
                r[f"{who}_tok_s"] = r["tokens"] / statistics.median(times[f"{who} {r['precision']}"])
        r["ratio"] = r["meshlm_tok_s"] / r["reference_tok_s"]
        r["vs_first"] = r["meshlm_tok_s"] / rows[0]["meshlm_tok_s"]  # against the first precision (fp32)
        if unfused:
            r["unfused_ratio"] = r["unfused_tok_s"] / r["reference_tok_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per shape (median), after 2 warm-up")
    parser.add_argument("--precisions", default="fp32,auto", help="the first is the one the others are compared to")
    parser.add_argument("--grid", default="all", help='"all" or h128s128,h384s256,…')
    parser.add_argument("--unfused", action="store_true", help="also time meshlm with train.fused_loss=false")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.precisions, args.grid = 1, "fp32", "h32s32"
    torch.manual_seed(0)
    precisions = args.precisions.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; load average {os.getloadavg()[0]:.2f} at start", flush=True)
    print(f"{'h':>5} {'s':>5} {'L':>2} {'B':>3} {'params':>7} {'prec':>5} {'fused':>5} {'meshlm tok/s':>12} "
          f"{'ref tok/s':>10} {'ratio':>6} {'vs ' + precisions[0]:>8}" + (f" {'unfused':>7}" if args.unfused else "")
          + f" {'load':>5}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in parse_grid(args.grid):
            for r in bench(shape, precisions, args.steps, f"{tmp}/h{shape[0]}s{shape[1]}", args.unfused):
                rows.append(r)
                print(f"{r['h']:>5} {r['s']:>5} {r['layers']:>2} {r['batch']:>3} {r['params_M']:>6.1f}M "
                      f"{r['precision']:>5} {str(r['fused']).lower():>5} {r['meshlm_tok_s']:>12,.0f} "
                      f"{r['reference_tok_s']:>10,.0f} {r['ratio']:>5.2f}x {r['vs_first']:>7.2f}x"
                      + (f" {r['unfused_ratio']:>6.2f}x" if args.unfused else "")
                      + f" {os.getloadavg()[0]:>5.2f}", flush=True)
    for precision in dict.fromkeys(r["precision"] for r in rows):
        worst = min((r for r in rows if r["precision"] == precision), key=lambda r: r["ratio"])
        print(f"worst ratio to the reference, {precision}: {worst['ratio']:.2f}x at h={worst['h']} s={worst['s']}")
    others = [r for r in rows if r["precision"] != precisions[0]]
    if others:
        worst = min(others, key=lambda r: r["vs_first"])
        print(f"worst tokens/s of another precision against {precisions[0]}: {worst['vs_first']:.2f}x "
              f"({worst['precision']}) at h={worst['h']} s={worst['s']}")


if __name__ == "__main__":
    main()
