"""meshlm's training step against a minimal plain-PyTorch step of the same shapes, measured in one run.

    python benchmarks/train_step.py [--steps 6] [--precisions fp32,bf16] [--models gpt-tiny,gpt-30m]

The reference is what a user would write by hand: a nanoGPT-style model (fused QKV, SDPA, tied head),
AdamW, cross-entropy, clip, step, on a batch of the same corpus. meshlm runs its real Trainer.train_step (data loader,
LR schedule, precision, accumulation, clipping), twice: as configured (the fused chunked head + loss of
models/loss.py, on by default) and with `train.fused_loss=false` (logits + cross-entropy, like the reference).
All three are timed alternately, after warm-up, and the table reports tokens/s, MFU against the peak measured
here, and the ratios to the reference (target ≥ 1.0): `ratio` for meshlm as configured, `unfused` for the
same arithmetic as the reference (parity, within this machine's noise).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.config import load_config
from meshlm.plan.flops import model_flops
from meshlm.train.metrics import measure_peak_tflops
from meshlm.train.trainer import Trainer

SHAPES = {  # name: overrides on gpt-tiny
    "gpt-tiny": [],
    "gpt-30m": ["--model.n_layers=6", "--model.hidden_size=384", "--model.n_heads=6",
                "--train.micro_batch_size=8", "--train.global_batch_size=8"],
}


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


def make_trainer(name: str, precision: str, out_dir: str, fused: bool) -> Trainer:
    cfg = load_config("gpt-tiny", SHAPES[name] + [f"--train.precision={precision}", f"--train.out_dir={out_dir}",
                                                  "--train.progress=false", "--train.resume=never",
                                                  f"--train.fused_loss={str(fused).lower()}"])
    return Trainer(cfg, progress=False)


def bench(name: str, precision: str, steps: int, out_dir: str) -> dict:
    trainer = make_trainer(name, precision, out_dir + "-fused", True)
    unfused = make_trainer(name, precision, out_dir + "-unfused", False)
    m, t = trainer.cfg.model, trainer.cfg.train
    ref = RefGPT(m.vocab_size, m.seq_len, m.hidden_size, m.n_heads, m.n_layers)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=True)
    # The same real text meshlm trains on (random ids would change the embedding backward's cost).
    batch = torch.stack([torch.as_tensor(trainer.train_set[i], dtype=torch.long) for i in range(t.micro_batch_size)])
    dtype = trainer.precision.dtype
    steppers = {"meshlm": trainer.train_step, "unfused": unfused.train_step,
                "reference": lambda: reference_step(ref, ref_opt, batch, dtype)}
    times = {who: [] for who in steppers}
    for i in range(steps + 2):  # alternate, so all see the same machine load; first two are warm-up
        for who, step in steppers.items():
            start = time.perf_counter()
            step()
            if i >= 2:
                times[who].append(time.perf_counter() - start)
    tokens = t.global_batch_size * m.seq_len
    flops = model_flops(m, t.global_batch_size)
    peak = measure_peak_tflops(torch.device("cpu"), torch.float32 if precision == "fp32" else dtype)
    row = {"model": name, "params_M": trainer.model.num_params() / 1e6, "precision": precision, "peak": peak}
    for who, ts in times.items():
        dt = sorted(ts)[len(ts) // 2]  # median
        row[f"{who}_tok_s"] = tokens / dt
        row[f"{who}_mfu"] = flops / dt / 1e12 / peak
    row["ratio"] = row["meshlm_tok_s"] / row["reference_tok_s"]
    row["unfused_ratio"] = row["unfused_tok_s"] / row["reference_tok_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--models", default="gpt-tiny,gpt-30m")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    print(f"{'model':<9} {'params':>7} {'prec':>5} {'peak TF/s':>9} {'meshlm tok/s':>12} {'MFU':>6} "
          f"{'unfused tok/s':>13} {'ref tok/s':>10} {'MFU':>6} {'ratio':>6} {'unfused':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            for precision in args.precisions.split(","):
                r = bench(name, precision, args.steps, f"{tmp}/{name}-{precision}")
                print(f"{r['model']:<9} {r['params_M']:>6.1f}M {r['precision']:>5} {r['peak']:>9.3f} "
                      f"{r['meshlm_tok_s']:>12,.0f} {100 * r['meshlm_mfu']:>5.1f}% {r['unfused_tok_s']:>13,.0f} "
                      f"{r['reference_tok_s']:>10,.0f} {100 * r['reference_mfu']:>5.1f}% {r['ratio']:>5.2f}x "
                      f"{r['unfused_ratio']:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
