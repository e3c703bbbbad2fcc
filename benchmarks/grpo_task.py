#!/usr/bin/env python3
"""GRPO on a verifiable task with a released model: SmolLM2-135M-Instruct (its GGUF file) learns arithmetic word
problems (benchmarks/grpo_task_data.py) with `meshlm align --method grpo --adapter lora`, and TRL's
`GRPOTrainer` + PEFT runs the same task on the same budget.

    .venv/bin/python benchmarks/grpo_task.py [--work runs/grpo-task] [--steps 30] [--prompts-per-step 4]
        [--num-generations 4] [--lr 1e-4] [--rank 8] [--alpha 16] [--max-completion-length 48]
        [--loss-type grpo] [--ops add|addsub|two] [--train 120] [--test 30] [--samples 3] [--skip-trl]
    .venv/bin/python benchmarks/grpo_task.py --smoke   # a tiny random Llama written as GGUF, 2 steps, no TRL

Rewards: `meshlm.tune.rewards:exact_number` (1 when the number after "####" is the answer) plus
`format_regex` weighted 0.2 (reasoning, then "#### N" on the last line). The held-out problems use other
templates and names than the training ones. The score is the held-out reward with greedy decoding
(meshlm's engine, `--max-completion-length` tokens): exact-answer and format rates, before and after.

The stages, each its own process, back to back: meshlm's run (the GGUF imported once into meshlm's cache);
TRL's (`--trl-worker`: the model transformers reads from the same GGUF, fp32, the tokenizer meshlm imported,
the same prompts in the same order, G, prompts per step, steps, constant learning rate, AdamW betas
(0.9, 0.99), no weight decay, clipping 1.0, LoRA rank/alpha on q and v, max completion length, temperature 1,
loss type, β = 0, one generation per step, dropout off). TRL's merged LoRA is mapped onto meshlm's model
(chat_task_smollm2.trl_model) and scored by the same greedy function. Per run: wall time, rollout tokens/s
(completion tokens / generation time) and training tokens/s, and the per-step reward curve.

Base SmolLM2-135M-Instruct on 30 held-out prompts, greedy, 48 tokens (measured while choosing the
difficulty): "add" 10% exact, 77% format; "addsub" 7% exact, 53% format.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import chat_task as ct  # benchmarks/chat_task.py: run()
import grpo_task_data as data
from smoke import add_smoke_flag, skipped

REWARDS = ["meshlm.tune.rewards:exact_number", "meshlm.tune.rewards:format_regex"]
WEIGHTS = [1.0, 0.2]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="runs/grpo-task")
    ap.add_argument("--gguf", default=None, help="the base GGUF file (default: meshlm.data.assets.smollm2_gguf())")
    ap.add_argument("--ops", default="add", choices=("add", "addsub", "two"), help="the problems' difficulty")
    ap.add_argument("--train", type=int, default=120, help="training prompts")
    ap.add_argument("--test", type=int, default=30, help="held-out prompts")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--max-completion-length", type=int, default=48)
    ap.add_argument("--loss-type", default="grpo", choices=("grpo", "bnpo", "dr_grpo", "dapo"))
    ap.add_argument("--seed", type=int, default=0, help="both trainers' seed (sampling, LoRA initialisation)")
    ap.add_argument("--samples", type=int, default=3, help="held-out completions shown per model")
    ap.add_argument("--skip-trl", action="store_true", help="meshlm's run only")
    ap.add_argument("--data-only", action="store_true", help="write WORK/train.jsonl and WORK/test.jsonl and stop")
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    add_smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        args.train, args.test, args.steps, args.prompts_per_step, args.num_generations = 4, 2, 2, 2, 2
        args.max_completion_length, args.samples, args.skip_trl = 8, 1, True
    return args


# ---- scoring ----------------------------------------------------------------------------------------------------
def held_out(model, tok, template, rows: list[dict], max_tokens: int) -> dict:
    """Greedy completions of `rows` by meshlm's engine on `model`: exact-answer and format rates, reward (as
    trained: 1·exact + 0.2·format) and the completions."""
    from meshlm.commands.align import engine_sampler
    from meshlm.data.chat import render
    from meshlm.tune.grpo import completion_text
    from meshlm.tune.rewards import exact_number, format_regex

    ids = [tok.encode(render(template, r["prompt"], add_generation_prompt=True)) for r in rows]
    sample = engine_sampler(model, tok, len(rows), max(map(len, ids)) + max_tokens)
    texts = [completion_text(tok, o) for o, _ in sample(ids, max_tokens, 0.0, 0, list(range(len(rows))))]
    exact = [exact_number("", t, r) for t, r in zip(texts, rows)]
    fmt = [format_regex("", t, r) for t, r in zip(texts, rows)]
    n = len(rows)
    return {"exact": sum(exact) / n, "format": sum(fmt) / n,
            "reward": sum(e * WEIGHTS[0] + f * WEIGHTS[1] for e, f in zip(exact, fmt)) / n, "completions": texts}


def load_checkpoint(path: str):
    from meshlm.checkpoint.load import load_model
    from meshlm.families.registry import get_spec
    from meshlm.interop.checkpoints import open_checkpoint

    checkpoint = open_checkpoint(path)
    return load_model(checkpoint, get_spec(checkpoint.config.model.family), "cpu")


# ---- TRL (in its own process) ------------------------------------------------------------------------------------
def trl_reward(fn):
    """A TRL reward function (prompts, completions, **columns) -> list[float] from a meshlm one."""
    def reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [fn("", t, {"answer": a}) for t, a in zip(texts, answer)]
    reward.__name__ = fn.__name__
    return reward


def check_same_prompts(tok, tokenizer_dir: str, rows: list[dict]) -> None:
    """Stop unless transformers' chat template renders every prompt as meshlm's does (the same text in)."""
    from meshlm.data.chat import render, template_for

    template = template_for(tokenizer_dir)
    for r in rows:
        if tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) != \
                render(template, r["prompt"], add_generation_prompt=True):
            raise SystemExit(f"transformers renders {r['prompt'][-1]['content']!r} otherwise than meshlm")


def trl_worker(spec_file: str) -> int:
    """TRL's GRPOTrainer + PEFT LoRA per the JSON spec; writes the merged model and the per-step stats."""
    import peft
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshlm.tune.rewards import exact_number, format_regex

    s = json.loads(Path(spec_file).read_text())
    out = Path(s["out"])
    torch.manual_seed(s["seed"])
    tok = AutoTokenizer.from_pretrained(s["tokenizer_dir"])
    gguf = Path(s["gguf"])
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    model.hf_quantizer, model.is_quantized = None, False  # dequantized fp32 weights (chat_task_smollm2.py)
    model.config.quantization_config = None
    lora = peft.LoraConfig(r=s["rank"], lora_alpha=s["alpha"], lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    batch = s["prompts_per_step"] * s["num_generations"]
    args = trl.GRPOConfig(
        output_dir=str(out / "trainer"), num_generations=s["num_generations"], per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, steps_per_generation=1, max_steps=s["steps"], learning_rate=s["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99,
        max_grad_norm=1.0, max_completion_length=s["max_completion_length"], temperature=1.0, top_k=0,
        loss_type=s["loss_type"], beta=0.0, num_iterations=1, scale_rewards="group", shuffle_dataset=False,
        disable_dropout=True, gradient_checkpointing=False, use_cpu=True, bf16=False, fp16=False, report_to=[],
        logging_steps=1, save_strategy="no", disable_tqdm=True, seed=s["seed"], reward_weights=s["weights"])
    rows = [json.loads(x) for x in Path(s["train"]).read_text().splitlines()]
    check_same_prompts(tok, s["tokenizer_dir"], rows)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    trainer = trl.GRPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok, peft_config=lora,
                              reward_funcs=[trl_reward(exact_number), trl_reward(format_regex)])
    t0 = time.perf_counter()
    trainer.train()
    loop_s = time.perf_counter() - t0
    logs = [x for x in trainer.state.log_history if "reward" in x]
    merged = trainer.model.merge_and_unload()
    torch.save({k: v.detach().clone() for k, v in merged.state_dict().items()}, out / "merged.pt")
    (out / "merged_config.json").write_text(merged.config.to_json_string())
    lengths = [x.get("completions/mean_length", 0.0) for x in logs]
    stats = {"loop_s": loop_s, "rewards": [x["reward"] for x in logs], "threads": torch.get_num_threads(),
             "completion_tokens": sum(lengths) * batch, "num_tokens": logs[-1].get("num_tokens")}
    (out / "stats.json").write_text(json.dumps(stats))
    print(f"trl: {len(logs)} steps in {loop_s:.0f} s, last reward {stats['rewards'][-1]:.3f}", flush=True)
    return 0


# ---- the pipeline -------------------------------------------------------------------------------------------------
def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def meshlm_run(args, py: str, train: Path, work: Path) -> dict:
    """`meshlm align --method grpo --adapter lora` on the training prompts (a new run: a previous one in WORK is
    removed, else the same --out would resume it); wall time and its metrics rows."""
    shutil.rmtree(work / "meshlm", ignore_errors=True)
    cmd = [py, "-m", "meshlm", "align", "--method", "grpo", "--checkpoint", args.gguf, "--train", train,
           "--out", work / "meshlm", "--adapter", "lora", "--reward", REWARDS[0], "--reward", REWARDS[1],
           "--reward-weights", *map(str, WEIGHTS), "--num-generations", str(args.num_generations),
           "--prompts-per-step", str(args.prompts_per_step), "--steps", str(args.steps), "--lr", f"{args.lr:g}",
           "--max-completion-length", str(args.max_completion_length), "--loss-type", args.loss_type,
           "--seed", str(args.seed), f"--tune.lora_rank={args.rank}", f"--tune.lora_alpha={args.alpha:g}", "--tune.lora_dropout=0",
           "--tune.lora_targets=[\"q\",\"v\"]"]
    _, wall = ct.run(cmd, work / "meshlm.log")
    rows = [json.loads(x) for x in (work / "meshlm" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind") == "train"]
    gen, train = sum(r["generation_s"] for r in rows), sum(r["training_s"] for r in rows)
    tokens = sum(r["completion_tokens"] for r in rows)
    return {"wall_s": wall, "rewards": [r["reward"] for r in rows], "loop_s": gen + train,
            "rollout_tok_s": tokens / max(gen, 1e-9), "train_tok_s": sum(r["train_tokens_per_s"] * r["training_s"]
                                                                          for r in rows) / max(train, 1e-9),
            "completion_tok_s": tokens / max(gen + train, 1e-9),
            "mismatch_max": max(r["logprob_mismatch_max"] for r in rows)}


def trl_run(args, py: str, train: Path, work: Path, tokenizer_dir: str) -> dict:
    out = work / "trl"
    out.mkdir(parents=True, exist_ok=True)
    spec = {"out": str(out), "gguf": args.gguf, "tokenizer_dir": tokenizer_dir, "train": str(train),
            "rank": args.rank, "alpha": args.alpha, "lr": args.lr, "steps": args.steps, "weights": WEIGHTS,
            "prompts_per_step": args.prompts_per_step, "num_generations": args.num_generations,
            "max_completion_length": args.max_completion_length, "loss_type": args.loss_type,
            "seed": args.seed}
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    _, wall = ct.run([py, Path(__file__).resolve(), "--trl-worker", out / "spec.json"], work / "trl.log")
    stats = json.loads((out / "stats.json").read_text())
    return {"wall_s": wall, "rewards": stats["rewards"], "loop_s": stats["loop_s"],
            "rollout_tok_s": None, "train_tok_s": None,
            "completion_tok_s": stats["completion_tokens"] / max(stats["loop_s"], 1e-9)}


def write_data(args: argparse.Namespace, work: Path) -> tuple[Path, list[dict]]:
    """WORK/train.jsonl and WORK/test.jsonl (the held-out rows, also returned)."""
    work.mkdir(parents=True, exist_ok=True)
    train = write_rows(work / "train.jsonl", data.rows("train", args.train, 0, args.ops))
    test = data.rows("test", args.test, 0, args.ops)
    write_rows(work / "test.jsonl", test)
    return train, test


def run_task(args: argparse.Namespace) -> int:
    from meshlm.data.chat import template_for
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.interop.checkpoints import open_checkpoint

    py, work = sys.executable, (ROOT / args.work).resolve()
    train, test = write_data(args, work)
    t_start = time.perf_counter()
    base_path = str(open_checkpoint(args.gguf).path)  # imported once into meshlm's cache
    cfg = open_checkpoint(base_path).config
    tok, template = get_tokenizer(cfg.data.tokenizer), template_for(cfg.data.tokenizer)
    scores, runs = {"base": held_out(load_checkpoint(base_path), tok, template, test, args.max_completion_length)}, {}
    runs["meshlm"] = meshlm_run(args, py, train, work)
    scores["GRPO (meshlm LoRA)"] = held_out(load_checkpoint(str(work / "meshlm")), tok, template, test,
                                            args.max_completion_length)
    if args.skip_trl:
        skipped("TRL's GRPOTrainer")
    else:
        from chat_task_smollm2 import trl_model

        runs["TRL"] = trl_run(args, py, train, work, cfg.data.tokenizer)
        model, _ = trl_model(work / "trl", base_path)
        scores["GRPO (TRL + PEFT LoRA)"] = held_out(model, tok, template, test, args.max_completion_length)
    (work / "results.json").write_text(json.dumps({"scores": scores, "runs": runs}, indent=1))
    report(args, test, scores, runs, time.perf_counter() - t_start)
    return 0


def report(args, test: list[dict], scores: dict, runs: dict, total_s: float) -> None:
    print(f"\nheld-out: {len(test)} problems (templates and names unseen in training), greedy, "
          f"{args.max_completion_length} tokens; {args.steps} steps of {args.prompts_per_step} prompts x "
          f"{args.num_generations}, lr {args.lr:g}, LoRA r={args.rank} on q, v, loss {args.loss_type}; "
          f"{total_s / 60:.1f} min in all, load average now {os.getloadavg()[0]:.1f}\n")
    print("| model | exact answer | format | reward (exact + 0.2 format) |\n|---|---|---|---|")
    for name, s in scores.items():
        print(f"| {name} | {s['exact']:.3f} | {s['format']:.3f} | {s['reward']:.3f} |")

    def rate(x):
        return "-" if x is None else f"{x:.0f}"
    print("\n| trainer | process wall | loop | rollout tokens/s | training tokens/s | completion tokens/s (loop) "
          "|\n|---|---|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['wall_s']:.0f} s | {r['loop_s']:.0f} s | {rate(r['rollout_tok_s'])} | "
              f"{rate(r['train_tok_s'])} | {rate(r['completion_tok_s'])} |")
    if "meshlm" in runs:
        print(f"\nmeshlm engine/trainer log-prob mismatch, largest over the run: {runs['meshlm']['mismatch_max']:.2e}")
    for name, r in runs.items():
        print(f"per-step reward, {name}: {' '.join(f'{x:.2f}' for x in r['rewards'])}")
    for i, row in enumerate(test[:args.samples]):
        print(f"\n### {row['prompt'][-1]['content']} (answer {row['answer']})")
        for name, s in scores.items():
            print(f"- {name}: {s['completions'][i]!r}")


def main() -> int:
    args = parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    if args.data_only:
        train, test = write_data(args, (ROOT / args.work).resolve())
        print(f"wrote {train} and {train.parent / 'test.jsonl'} ({args.train} and {len(test)} rows)")
        return 0
    if args.smoke:
        from chat_task_smollm2 import smoke_gguf

        with tempfile.TemporaryDirectory() as tmp:
            os.environ["MESHLM_CACHE"] = str(Path(tmp) / "cache")  # the tiny GGUF's import goes with it
            args.work, args.gguf = tmp, smoke_gguf(Path(tmp))
            return run_task(args)
    if args.gguf is None:
        from meshlm.data.assets import smollm2_gguf

        args.gguf = str(smollm2_gguf())
    return run_task(args)


if __name__ == "__main__":
    sys.exit(main())
