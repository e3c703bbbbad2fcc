#!/usr/bin/env python3
"""Post-training measured end to end on a real task: SFT on conversations, then DPO on preference pairs,
each judged on plays no stage trained on (`scripts/make_chat_task.py`: answer in a character's voice with the
play's true next line).

    .venv/bin/python benchmarks/chat_task.py --base runs/demo [--work runs/chat-task]
        [--sft-steps 40] [--dpo-steps 20] [--dpo-batch 8] [--method dpo] [--stages sft,dpo] [--reuse]
        [--sft-lr 1e-3] [--dpo-lr 1e-4] [--beta 0.1] [--sft-extra="..."] [--dpo-extra="..."] [--samples 3]
    .venv/bin/python benchmarks/chat_task.py --smoke     # a tiny random base, a few conversations and pairs, one
                                                         # step of SFT and of DPO, no samples

Every stage is its command, run as a subprocess and printed: `scripts/make_chat_task.py` (the data),
`meshlm tune --method full` on the conversations (SFT, from --base), `meshlm align --method dpo` on the
preference pairs (from the SFT checkpoint, which is also DPO's frozen reference), and `meshlm generate`
(greedy) for the samples. `--stages ""` evaluates the base alone; `--stages sft` stops after SFT. Each
model's results go to WORK/results.json as soon as it is measured; `--reuse` keeps them (and a trained
WORK/sft or WORK/dpo) instead of measuring (training) again. DPO reads the first `--dpo-pairs` training
pairs: the reference model scores every pair given before training starts.

Measured for each model (base, SFT, SFT+DPO) on the held-out test plays, in this script, from the model alone:

* preference accuracy: the share of test pairs whose chosen line has the higher log-probability after the
  prompt (summed over the answer's tokens; also per token, and split by the decoy's kind: another speaker
  of the same play, a line of another play);
* DPO's implicit reward accuracy (SFT+DPO only, where a reference is defined): the share with
  (log π(chosen) − log π_ref(chosen)) > (log π(rejected) − log π_ref(rejected)), π_ref the SFT model;
* the assistant-turn loss: the mean cross-entropy over every assistant token of the test conversations,
  rendered with the base's chat template as `meshlm tune` renders them (its val_loss averages micro-batch
  means instead: on the validation play after SFT, 3.917 against 3.906 token-weighted here);
* three greedy samples for the same held-out prompts.

A preference prompt is the pair's user message rendered with the chat template and its generation prompt;
its completion is the answer and the template's end of turn, so the pairs are scored (and the DPO run sees
them, `WORK/data/align_*.jsonl`) exactly as the assistant turns of the conversations. Prints a markdown table
and the commands; writes WORK/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checkpoints import load_run  # benchmarks/checkpoints.py, beside this script
from smoke import add_smoke_flag, skipped, tiny_checkpoint, tiny_tokenizer

from meshlm.checkpoint.load import open_checkpoint
from meshlm.data.chat import encode_chat, render, stop_strings, template_for
from meshlm.data.tokenizers import get_tokenizer

COMMANDS: list[str] = []


def run(cmd: list[str], log: Path, shown: str | None = None) -> tuple[str, float]:
    """Run a command (printed as `shown`, default the command itself, and kept for the report), its output to
    `log`; (output, wall seconds)."""
    shown = shown or " ".join(shlex.quote(str(c)) for c in cmd)
    COMMANDS.append(shown)
    print("$ " + shown, flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run([str(c) for c in cmd], stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, check=False)
    text = log.read_text()
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {shown}\n{text[-3000:]}")
    wall = time.perf_counter() - t0
    print(f"  done in {wall:.0f} s (load average {os.getloadavg()[0]:.1f})", flush=True)
    return text, wall


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


# ---- scoring ------------------------------------------------------------------------------------------------
def encode(tok, template, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """A conversation's ids (end-of-document after it, as `meshlm tune` lays it out) and, per position, whether
    the next token is a target (the assistant's)."""
    ids, mask = encode_chat(tok, template, messages)
    ids = [int(i) for i in ids] + [tok.eod_id]
    mask = [bool(m) for m in mask] + [False]
    return ids, mask[1:] + [False]


@torch.no_grad()
def target_logprobs(model, seqs: list[tuple[list[int], list[bool]]], pad: int, batch: int = 16) -> list[torch.Tensor]:
    """Per sequence, the log-probabilities of its target tokens (the positions its mask marks)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))  # similar lengths together: less padding
    by_index: dict[int, torch.Tensor] = {}
    for s in range(0, len(order), batch):
        chunk = [seqs[i] for i in order[s:s + batch]]
        T = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), T), pad)
        for k, (row, _) in enumerate(chunk):
            ids[k, :len(row)] = torch.tensor(row)
        hidden = model.run_layers(model.embed(ids))  # the output layer only where a target is predicted
        for k, (row, mask) in enumerate(chunk):
            pos = torch.tensor([i for i, m in enumerate(mask) if m], dtype=torch.long)
            logp = torch.log_softmax(model.head(hidden[k, pos]).float(), -1)
            by_index[order[s + k]] = logp[torch.arange(len(pos)), torch.tensor(row)[pos + 1]]
    return [by_index[i] for i in range(len(seqs))]


def assistant_loss(model, tok, template, convs: list[dict]) -> float:
    """Mean cross-entropy over every assistant token of the conversations (token-weighted)."""
    lps = target_logprobs(model, [encode(tok, template, c["messages"]) for c in convs], tok.eod_id)
    return float(-torch.cat(lps).sum() / sum(len(x) for x in lps))


def pair_scores(model, tok, template, pairs: list[dict]) -> dict[str, torch.Tensor]:
    """Summed and mean log-probs of each pair's chosen and rejected answer after its prompt."""
    seqs = []
    for p in pairs:
        for answer in (p["chosen"], p["rejected"]):
            seqs.append(encode(tok, template, [{"role": "user", "content": p["prompt"]},
                                               {"role": "assistant", "content": answer}]))
    lps = target_logprobs(model, seqs, tok.eod_id)
    total = torch.tensor([float(x.sum()) for x in lps]).view(-1, 2)
    mean = torch.tensor([float(x.mean()) for x in lps]).view(-1, 2)
    count = torch.tensor([len(x) for x in lps]).view(-1, 2)
    return {"chosen": total[:, 0], "rejected": total[:, 1], "chosen_mean": mean[:, 0], "rejected_mean": mean[:, 1],
            "chosen_tokens": count[:, 0], "rejected_tokens": count[:, 1]}


def preference_metrics(scores: dict, pairs: list[dict], reference: dict | None = None) -> dict:
    """Accuracies from `pair_scores` (and the implicit reward's, against `reference`'s scores)."""
    wins = scores["chosen"] > scores["rejected"]
    out = {"pref_acc": float(wins.float().mean()),
           "pref_acc_per_token": float((scores["chosen_mean"] > scores["rejected_mean"]).float().mean()),
           "margin": float((scores["chosen"] - scores["rejected"]).mean())}
    for kind in ("other_speaker", "other_play"):
        idx = torch.tensor([p["rejected_from"] == kind for p in pairs])
        out[f"pref_acc_{kind}"] = float(wins[idx].float().mean()) if idx.any() else float("nan")
    if reference is not None:
        reward = (scores["chosen"] - reference["chosen"]) - (scores["rejected"] - reference["rejected"])
        out["reward_acc"] = float((reward > 0).float().mean())
    return out


# ---- models ---------------------------------------------------------------------------------------------------
def load(path: str, base_for_adapter: str | None = None):
    """A run directory's model: a whole checkpoint, or (adapter.json in it) an adapter on `base_for_adapter`."""
    if (Path(path) / "adapter.json").exists():
        from meshlm.tune.export import apply_adapter, read_adapter

        base = open_checkpoint(base_for_adapter)
        model = load_run(base_for_adapter)[0]
        return apply_adapter(model, base.config, read_adapter(path, base.config, base)).eval()
    return load_run(path)[0].eval()


def evaluate(name: str, model, tok, template, convs, pairs, reference: dict | None = None) -> tuple[dict, dict]:
    t0 = time.perf_counter()
    scores = pair_scores(model, tok, template, pairs)
    metrics = preference_metrics(scores, pairs, reference)
    metrics["assistant_loss"] = assistant_loss(model, tok, template, convs)
    print(f"{name}: preference accuracy {metrics['pref_acc']:.3f}, assistant-turn loss {metrics['assistant_loss']:.3f}"
          f" (evaluated in {time.perf_counter() - t0:.0f} s)", flush=True)
    return metrics, scores


def sample(py: str, checkpoint: str, adapter: str | None, prompts: list[str], work: Path, tag: str,
           max_new: int, stops: tuple[str, ...]) -> list[str]:
    """Greedy continuations of `prompts` by `meshlm generate`, cut at the template's end of turn."""
    outs = []
    for k, prompt in enumerate(prompts):
        (work / f"prompt_{k}.txt").write_text(prompt, encoding="utf-8")
        tail = ["--temperature", "0", "--max-new-tokens", str(max_new)] + (["--adapter", adapter] if adapter else [])
        cmd = [py, "-m", "meshlm", "generate", "--checkpoint", checkpoint, "--prompt", prompt, *tail]
        shown = " ".join(shlex.quote(str(c)) for c in cmd[:6]) + f' --prompt "$(cat {work / f"prompt_{k}.txt"})" ' + \
            " ".join(tail)
        text, _ = run(cmd, work / f"sample_{tag}_{k}.log", shown)
        text = text.rstrip("\n")
        at = text.find(prompt)
        reply = text[at + len(prompt):] if at >= 0 else text
        for stop in stops:
            reply = reply.split(stop)[0]
        outs.append(reply.strip())
    return outs


# ---- the pipeline -----------------------------------------------------------------------------------------------
def align_files(data: Path, template, sizes: dict[str, int]) -> None:
    """pref_*.jsonl as `meshlm align` reads them: the prompt rendered as the chat's first user turn with the
    generation prompt, each answer followed by the template's end of turn (what SFT taught); the first
    `sizes[split]` pairs of each file (the reference model scores every one before training starts)."""
    for split, n in sizes.items():
        rows = []
        for p in read(data / f"pref_{split}.jsonl")[:n]:
            prompt = render(template, [{"role": "user", "content": p["prompt"]}], add_generation_prompt=True)
            ends = render(template, [{"role": "user", "content": p["prompt"]},
                                     {"role": "assistant", "content": p["chosen"]}])
            tail = ends[len(prompt) + len(p["chosen"]):]  # the end of turn the template writes ("\n")
            rows.append({"prompt": prompt, "chosen": p["chosen"] + tail, "rejected": p["rejected"] + tail})
        with open(data / f"align_{split}.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="runs/demo", help="the base checkpoint (run directory); `make demo` writes runs/demo")
    ap.add_argument("--work", default="runs/chat-task")
    ap.add_argument("--stages", default="sft,dpo", help="sft, sft,dpo, or '' (the base alone)")
    ap.add_argument("--data-args", default="", help="more arguments for scripts/make_chat_task.py")
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--sft-lr", type=float, default=1e-3, help="SFT's learning rate (meshlm tune's full default: 3e-4)")
    ap.add_argument("--sft-extra", default="", help="more arguments for meshlm tune")
    ap.add_argument("--method", default="dpo", choices=("dpo", "ipo", "simpo"))
    ap.add_argument("--dpo-steps", type=int, default=20)
    ap.add_argument("--dpo-batch", type=int, default=8, help="pairs per DPO step (train.global_batch_size)")
    ap.add_argument("--dpo-lr", type=float, default=1e-4, help="DPO's learning rate (meshlm align's default: 1e-6)")
    ap.add_argument("--beta", type=float, default=0.1, help="meshlm align --beta")
    ap.add_argument("--dpo-extra", default="", help="more arguments for meshlm align")
    ap.add_argument("--dpo-pairs", type=int, default=160, help="training pairs given to meshlm align (the first N)")
    ap.add_argument("--dpo-valid-pairs", type=int, default=48, help="validation pairs given to meshlm align")
    ap.add_argument("--max-length", type=int, default=256, help="tokens per SFT row (meshlm tune --max-length)")
    ap.add_argument("--align-max-length", type=int, default=256, help="tokens per pair row (meshlm align --max-length)")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--reuse", action="store_true", help="keep what an earlier run of --work measured and trained "
                    "(WORK/results.json, WORK/sft, WORK/dpo) instead of doing it again")
    add_smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        args.data_args = "--train 16 --pref-train 8 --valid 4 --pref-valid 4 --test 4 --pref-test 4"
        args.sft_steps, args.dpo_steps, args.dpo_batch, args.dpo_pairs, args.dpo_valid_pairs = 1, 1, 4, 4, 4
        args.samples, args.reuse = 0, False
        args.sft_extra += " --train.peak_tflops=1"
        args.dpo_extra += " --train.peak_tflops=1"
    return args


def stage_commands(args, py: str, data: Path, work: Path, base: str) -> dict[str, list[str]]:
    # the step counts as given (the base config's time budget would refit them to this host), no sample
    quiet = ["--train.progress=false", "--train.resume=never", "--train.sample_tokens=0", "--train.time_budget_s=0"]
    sft = [py, "-m", "meshlm", "tune", "--checkpoint", base, "--method", "full", "--train", data / "chat_train.jsonl",
           "--valid", data / "chat_valid.jsonl", "--out", work / "sft", "--max-length", str(args.max_length),
           "--pack", f"--optim.lr={args.sft_lr:g}", f"--train.max_steps={args.sft_steps}", *quiet,
           *shlex.split(args.sft_extra)]
    dpo = [py, "-m", "meshlm", "align", "--checkpoint", work / "sft", "--method", args.method, "--train",
           data / "align_train.jsonl", "--valid", data / "align_valid.jsonl", "--out", work / args.method,
           "--max-length", str(args.align_max_length), f"--train.max_steps={args.dpo_steps}",
           f"--train.global_batch_size={args.dpo_batch}", f"--optim.lr={args.dpo_lr:g}", f"--beta={args.beta:g}", *quiet,
           *shlex.split(args.dpo_extra)]
    return {"sft": sft, "dpo": dpo}


class Ledger:
    """WORK/results.json, written after every model's evaluation; with --reuse, what an earlier run of the same
    WORK measured is taken instead of measured again (and its trained models instead of training them)."""

    def __init__(self, work: Path, reuse: bool):
        self.path, self.work = work / "results.json", work
        old = json.loads(self.path.read_text()) if reuse and self.path.exists() else {}
        self.state = {"results": {}, "samples": {}, "walls": {}, "commands": {}, **old}
        self.reuse = reuse

    def has(self, name: str) -> bool:
        return self.reuse and name in self.state["results"] and (self.work / f"scores_{name}.pt").exists()

    def scores(self, name: str) -> dict:
        return torch.load(self.work / f"scores_{name}.pt")

    def record(self, name: str, metrics: dict, scores: dict, samples: list[str]) -> None:
        self.state["results"][name], self.state["samples"][name] = metrics, samples
        torch.save(scores, self.work / f"scores_{name}.pt")
        self.state["commands"] = {**self.state["commands"], name: COMMANDS[:]}
        COMMANDS.clear()
        self.path.write_text(json.dumps(self.state, indent=1))


def trained(out: Path) -> bool:
    return (out / "checkpoints" / "latest").exists() or (out / "adapter.json").exists()


def main() -> int:
    args = parse_args()
    if args.smoke:
        skipped("the greedy samples (meshlm generate)")
        with tempfile.TemporaryDirectory() as tmp:
            args.work = tmp
            # a 512-token byte-level BPE, not GPT-2's 50,257 tokens, whose output layer would be most of every step
            # and evaluation; a conversation then takes more tokens: rows and positions of 512
            tok, vocab = tiny_tokenizer(Path(tmp) / "tokenizer")
            args.base = str(tiny_checkpoint(Path(tmp) / "base", tokenizer=str(tok), vocab_size=vocab, n_layers=1,
                                            hidden_size=32, n_heads=2, seq_len=512))
            args.max_length = args.align_max_length = 512
            return run_task(args)
    return run_task(args)


def run_task(args: argparse.Namespace) -> int:
    """Data, every stage of `args.stages` and its evaluation, the report."""
    py = sys.executable
    work = (ROOT / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = str((ROOT / args.base).resolve())
    stages = [s for s in args.stages.split(",") if s]
    t_start = time.perf_counter()
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    data = work / "data"
    run([py, "scripts/make_chat_task.py", "--out", data, *shlex.split(args.data_args)], work / "data.log")
    cfg = open_checkpoint(base).config
    tok = get_tokenizer(cfg.data.tokenizer)
    template = template_for(cfg.data.tokenizer)
    stops = stop_strings(template)
    align_files(data, template, {"train": args.dpo_pairs, "valid": args.dpo_valid_pairs})
    convs, pairs = read(data / "chat_test.jsonl"), read(data / "pref_test.jsonl")
    picked = convs[:args.samples]
    prompts = [render(template, c["messages"][:[m["role"] for m in c["messages"]].index("assistant")],
                      add_generation_prompt=True) for c in picked]
    ledger = Ledger(work, args.reuse)
    commands = stage_commands(args, py, data, work, base)
    dpo_name = f"SFT+{args.method.upper()}"
    plan = [("base", None, base, None), ("SFT", "sft", str(work / "sft"), None),
            (dpo_name, "dpo", str(work / args.method), "SFT")]
    for name, stage, out, reference in plan:
        if stage is not None and stage not in stages:
            continue
        if ledger.has(name):
            print(f"{name}: measured before (--reuse), {ledger.path}", flush=True)
            continue
        if stage is not None and not (args.reuse and trained(Path(out))):
            _, ledger.state["walls"][stage] = run(commands[stage], work / f"{stage}.log")
        ref = ledger.scores(reference) if reference else None
        metrics, scores = evaluate(name, load(out, str(work / "sft")), tok, template, convs, pairs, ref)
        if stage is not None:  # the run's last line: its final validation loss
            metrics["train_log"] = (work / f"{stage}.log").read_text().strip().splitlines()[-1]
        adapter = out if (Path(out) / "adapter.json").exists() else None
        outs = sample(py, str(work / "sft") if adapter else out, adapter, prompts, work, name, args.max_new_tokens,
                      stops)
        ledger.record(name, metrics, scores, outs)
    scores = ledger.scores("base")
    lengths = (float((scores["chosen_tokens"] > scores["rejected_tokens"]).float().mean()),
               float((scores["chosen_tokens"] < scores["rejected_tokens"]).float().mean()))
    state = ledger.state
    report(state["results"], state["samples"], state["walls"], picked, len(convs), len(pairs), args,
           time.perf_counter() - t_start, lengths, [c for cs in state["commands"].values() for c in cs])
    return 0


def report(results, samples, walls, picked, n_convs, n_pairs, args, total_s, lengths, commands) -> None:
    print(f"\nheld-out test plays: {n_pairs} preference pairs, {n_convs} conversations; base {args.base}; "
          f"{total_s / 60:.1f} min in all, load average now {os.getloadavg()[0]:.1f}")
    print(f"length alone: the chosen answer has more tokens in {lengths[0]:.3f} of the pairs, fewer in "
          f"{lengths[1]:.3f}\n")
    print("| model | pref. accuracy (sum log-prob) | per token | vs other speaker | vs other play "
          "| implicit reward acc. | assistant-turn loss | train wall |")
    print("|---|---|---|---|---|---|---|---|")
    wall_of = {"SFT": walls.get("sft"), f"SFT+{args.method.upper()}": walls.get("dpo")}
    for name, r in results.items():
        reward = f"{r['reward_acc']:.3f}" if "reward_acc" in r else "-"
        wall = f"{wall_of[name]:.0f} s" if wall_of.get(name) else "-"
        print(f"| {name} | {r['pref_acc']:.3f} | {r['pref_acc_per_token']:.3f} | {r['pref_acc_other_speaker']:.3f} "
              f"| {r['pref_acc_other_play']:.3f} | {reward} | {r['assistant_loss']:.3f} | {wall} |")
    print_samples(picked, samples, commands)


def print_samples(picked: list[dict], samples: dict[str, list[str]], commands: list[str]) -> None:
    """Each run's greedy reply to the first user turn of the held-out conversations `picked`, beside the true
    line, then the commands that made the runs."""
    print("\nGreedy samples (the first user turn of held-out conversations):\n")
    for k, conv in enumerate(picked):
        user = next(m["content"] for m in conv["messages"] if m["role"] == "user")
        print(f"{k + 1}. {conv['play']}, {conv['speaker']}: {' / '.join(user.splitlines()[:2])}")
        print(f"   - true line: {next(m['content'] for m in conv['messages'] if m['role'] == 'assistant')!r}")
        for name, outs in samples.items():
            print(f"   - {name}: {outs[k]!r}")
    print("\nCommands:\n")
    for c in dict.fromkeys(commands):
        print("    " + c)


if __name__ == "__main__":
    sys.exit(main())
