#!/usr/bin/env python3
"""The character-voice chat task (`benchmarks/chat_task.py`) on a released model, SmolLM2-135M-Instruct from
its GGUF file: the base, meshlm's LoRA SFT, SFT + DPO, and the same LoRA SFT by TRL's `SFTTrainer` + PEFT,
each judged on the held-out play by chat_task.py's own functions.

    .venv/bin/python benchmarks/chat_task_smollm2.py [--work runs/chat-task-smollm2] [--steps 30]
        [--micro-batch 4] [--max-length 200] [--lr 1e-3] [--rank 8] [--alpha 16] [--dropout 0]
        [--dpo-steps 8] [--dpo-batch 4] [--dpo-pairs 32] [--dpo-lr 1e-4] [--beta 0.1] [--samples 1] [--skip-trl]
    .venv/bin/python benchmarks/chat_task_smollm2.py --smoke   # a tiny random Llama (and BPE) written as GGUF, 2 steps

The stages, each its own process, run back to back (the load average is printed before and after each):

1. `meshlm tune --method lora` on the task's `{"messages": ...}` lines, from the GGUF file (imported once into
   meshlm's cache), loss on the assistant turns, one conversation a row of `--max-length` tokens;
2. TRL's `SFTTrainer(assistant_only_loss=True)` with a PEFT `LoraConfig` of the same rank, alpha, dropout and
   targets (q and v), on the model transformers reads from the same GGUF file (`gguf_file=`, fp32), the
   tokenizer meshlm imported (so both see the same token ids), the same learning rate and schedule (AdamW,
   no warmup, linear decay to 0 over the steps: meshlm's `lr_at` and transformers' linear schedule agree
   there step for step), batch, `max_length`, steps and gradient clipping (1.0), fp32 and torch's two threads
   in both. It runs in a subprocess of this script (`--trl-worker`), which saves the merged model;
3. `meshlm align --method dpo --adapter lora` on the preference pairs, from the SFT adapter merged into the
   base (written by this script as a run directory; it is DPO's frozen reference too).

Both SFT models are scored by the same function on merged weights: meshlm's adapter merged by
`tune.export.apply_adapter`, TRL's merged by PEFT's `merge_and_unload` and mapped onto meshlm's model of the
base's config by `interop.hf.from_hf_llama`'s table (weights outside the LoRA targets are checked equal to
meshlm's base). Per training run: held-out loss, process wall and CPU time (user+sys of the child), training
loop time and tokens/s (tokens of the conversations trained, without padding).

SmolLM2 declares ChatML's end of turn `<|im_end|>` as its end of sequence; meshlm separates packed
conversations with its `<|endoftext|>` instead (`data.tokenizers.document_separator`), so `--pack` works on it
(tests/tune/test_pack_chatml.py), but this comparison keeps one conversation a row in both trainers, as TRL
runs here with `packing=False`. SmolLM2's
template has no `{% generation %}` marks (which TRL's assistant-only loss needs): both trainers get
`CHATML_GENERATION`, checked to render every conversation exactly as the model's own template does.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import chat_task as ct  # benchmarks/chat_task.py: the task's data, metrics and sampling
from checkpoints import load_run
from smoke import add_smoke_flag, skipped, tiny_gguf

from meshlm.data.chat import BUILTIN_TEMPLATE, render, stop_strings, template_for
from meshlm.data.tokenizers import get_tokenizer

# SmolLM2's ChatML template (its default system message when the conversation has none) with each assistant
# message and its end of turn inside `{% generation %}`: what meshlm's prefix rendering takes as the turn.
CHATML_GENERATION = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def training_template(base_template, convs: list[dict]) -> str:
    """The generation-marked template that renders every conversation (and generation prompt) exactly as the
    base's own template does: CHATML_GENERATION for SmolLM2, meshlm's builtin for a meshlm-trained base."""
    for text in (CHATML_GENERATION, BUILTIN_TEMPLATE):
        if all(render(text, c["messages"]) == render(base_template, c["messages"]) for c in convs) and \
                render(text, convs[0]["messages"][:1], add_generation_prompt=True) == \
                render(base_template, convs[0]["messages"][:1], add_generation_prompt=True):
            return text
    raise SystemExit("no generation-marked template renders as the base's own; add one to training_template")


def timed(cmd: list, log: Path) -> dict:
    """`chat_task.run` with the child's CPU time (user + sys) and the load average before and after."""
    before, load0 = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()
    text, wall = ct.run(cmd, log)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"log": text, "wall_s": wall, "cpu_s": cpu, "load_before": load0, "load_after": os.getloadavg()}


# ---- TRL + PEFT (in its own process) ----------------------------------------------------------------------------
def trl_worker(spec_file: str) -> int:
    """TRL's SFTTrainer + PEFT LoRA per the JSON spec; writes the merged model (config + state dict) and stats."""
    import peft
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s = json.loads(Path(spec_file).read_text())
    out = Path(s["out"])
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(s["tokenizer_dir"])
    tok.chat_template = s["template"]
    gguf = Path(s["gguf"])
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    # The weights are dequantized fp32 tensors; only the GGUF quantizer's marker is left, which Trainer refuses
    model.hf_quantizer, model.is_quantized = None, False
    model.config.quantization_config = None
    lora = peft.LoraConfig(r=s["rank"], lora_alpha=s["alpha"], lora_dropout=s["dropout"],
                           target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = trl.SFTConfig(output_dir=str(out / "trainer"), assistant_only_loss=True, max_length=s["max_length"],
                         packing=False, per_device_train_batch_size=s["batch"], gradient_accumulation_steps=1,
                         max_steps=s["steps"], learning_rate=s["lr"], lr_scheduler_type="linear", warmup_steps=0,
                         weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                         optim="adamw_torch", use_cpu=True, bf16=False, fp16=False, report_to=[], logging_steps=1,
                         save_strategy="no", eval_strategy="no", disable_tqdm=True, seed=0, dataset_num_proc=None,
                         gradient_checkpointing=False)  # TRL's default recomputes activations; meshlm's run does not
    rows = [{"messages": c["messages"]} for c in ct.read(Path(s["train"]))]
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                             peft_config=lora)
    t0 = time.perf_counter()
    trainer.train()
    loop_s = time.perf_counter() - t0
    logs = [x for x in trainer.state.log_history if "loss" in x]
    merged = trainer.model.merge_and_unload()
    torch.save({k: v.detach().clone() for k, v in merged.state_dict().items()}, out / "merged.pt")
    (out / "merged_config.json").write_text(merged.config.to_json_string())
    stats = {"loop_s": loop_s, "losses": [x["loss"] for x in logs], "tokens": logs[-1].get("num_tokens"),
             "threads": torch.get_num_threads(), "lr": [x.get("learning_rate") for x in logs]}
    (out / "stats.json").write_text(json.dumps(stats))
    print(f"trl: {len(logs)} steps in {loop_s:.0f} s, last loss {stats['losses'][-1]:.4f}", flush=True)
    return 0


def trl_model(out: Path, base_path: str):
    """TRL's merged weights on meshlm's model of the base's config (interop.hf's Llama table), and the largest
    difference to meshlm's base outside the LoRA targets (the same dequantized GGUF: ~0)."""
    from transformers import LlamaConfig

    from meshlm.interop.hf import from_hf_llama

    state = torch.load(out / "merged.pt")
    hf_cfg = LlamaConfig.from_dict(json.loads((out / "merged_config.json").read_text()))
    mapped = from_hf_llama(hf_cfg, state).state_dict()
    model = load_run(base_path)[0]
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(mapped)
    off = max(float((mapped[k] - v).abs().max()) for k, v in base_state.items() if ".qkv." not in k)
    return model.eval(), off


# ---- meshlm ---------------------------------------------------------------------------------------------------
def merged_run(base_path: str, adapter: Path, out: Path) -> Path:
    """The base with meshlm's SFT adapter merged, saved as a run directory (DPO's start and frozen reference)."""
    from meshlm.checkpoint.load import open_checkpoint
    from meshlm.checkpoint.single import save_checkpoint

    model = ct.load(str(adapter), base_path)
    save_checkpoint(out, 1, {"model": model.state_dict()}, open_checkpoint(base_path).config.to_dict())
    return out


def meshlm_commands(args, py: str, data: Path, work: Path, gguf: str, template_file: Path) -> dict[str, list]:
    # fp32 and torch's own thread count in both trainers
    same = ["--train.precision=fp32", "--train.adapt_threads=false", "--train.progress=false", "--train.resume=never",
            "--train.sample_tokens=0", "--train.time_budget_s=0", "--train.log_every=1", "--optim.warmup_steps=0"]
    sft = [py, "-m", "meshlm", "tune", "--checkpoint", gguf, "--method", "lora", "--train", data / "chat_train.jsonl",
           "--valid", data / "chat_valid_small.jsonl", "--out", work / "sft", "--max-length", str(args.max_length),
           "--chat-template", template_file, f"--optim.lr={args.lr:g}", f"--train.max_steps={args.steps}",
           f"--train.micro_batch_size={args.micro_batch}", f"--train.global_batch_size={args.micro_batch}",
           f"--tune.lora_rank={args.rank}", f"--tune.lora_alpha={args.alpha:g}",
           f"--tune.lora_dropout={args.dropout:g}", "--tune.lora_targets=[\"q\",\"v\"]", *same]
    dpo = [py, "-m", "meshlm", "align", "--checkpoint", work / "sft_merged", "--method", "dpo", "--adapter", "lora",
           "--train", data / "align_train.jsonl", "--valid", data / "align_valid.jsonl", "--out", work / "dpo",
           "--max-length", str(args.max_length), f"--train.max_steps={args.dpo_steps}",
           f"--train.micro_batch_size={args.dpo_batch}", f"--train.global_batch_size={args.dpo_batch}",
           f"--optim.lr={args.dpo_lr:g}", f"--beta={args.beta:g}", *same]
    return {"sft": sft, "dpo": dpo}


def meshlm_steps(run_dir: Path) -> dict:
    """Training-loop time (the steps' own times), tokens and the last loss from a run's metrics.jsonl."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    return {"loop_s": sum(r["step_time_s"] for r in train), "losses": [r["loss"] for r in train],
            "threads": train[-1].get("threads")}


def conversation_tokens(tok, template: str, convs: list[dict], max_length: int) -> int:
    """Tokens of the conversations as trained (without padding, the end-of-document token included)."""
    return sum(min(max_length, len(ct.encode(tok, template, c["messages"])[0])) for c in convs)


# ---- the pipeline -----------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="runs/chat-task-smollm2")
    ap.add_argument("--gguf", default=None, help="the base GGUF file (default: meshlm.data.assets.smollm2_gguf())")
    ap.add_argument("--data-args", default="--test 16 --pref-test 32",
                    help="more arguments for scripts/make_chat_task.py (default: a smaller held-out set)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch", type=int, default=4, help="conversations per step (no accumulation)")
    ap.add_argument("--max-length", type=int, default=200, help="tokens per row (every conversation fits: <= 195)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--dpo-steps", type=int, default=8)
    ap.add_argument("--dpo-batch", type=int, default=4)
    ap.add_argument("--dpo-lr", type=float, default=1e-4)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--dpo-pairs", type=int, default=32,
                    help="training pairs given to meshlm align (the first N; the reference scores each one first)")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--skip-trl", action="store_true", help="meshlm's runs only")
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    add_smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        args.data_args = "--train 8 --pref-train 4 --valid 4 --pref-valid 4 --test 4 --pref-test 4"
        args.steps, args.micro_batch, args.dpo_steps, args.dpo_batch, args.dpo_pairs = 2, 2, 1, 2, 4
        args.max_length = 512  # the smoke base's small vocabulary takes more tokens a conversation (smoke_gguf)
        args.samples = 0
    return args


def smoke_gguf(tmp: Path) -> str:
    """A tiny random Llama written as an f32 GGUF file (`smoke.tiny_gguf`: 1 layer, 512 positions, a 512-token
    BPE split as SmolLM2's; GPT-2's 50,257 tokens would cost seconds of GGUF parsing in every reader)."""
    return str(tiny_gguf(tmp, digits=True))


def main() -> int:
    args = parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    if args.smoke:
        skipped("the greedy samples (meshlm generate)")
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["MESHLM_CACHE"] = str(Path(tmp) / "cache")  # the tiny GGUF's import goes with it
            args.work, args.gguf = tmp, smoke_gguf(Path(tmp))
            return run_task(args)
    if args.gguf is None:
        from meshlm.data.assets import smollm2_gguf

        args.gguf = str(smollm2_gguf())
    return run_task(args)


def prepare_data(args, py: str, work: Path, tok, base_template) -> tuple[Path, str, Path]:
    """The task's files, the small validation file meshlm's run evaluates at its end, DPO's rendered pairs and
    the generation-marked template file both trainers get."""
    data = work / "data"
    ct.run([py, "scripts/make_chat_task.py", "--out", data, *shlex.split(args.data_args)], work / "data.log")
    valid = ct.read(data / "chat_valid.jsonl")[:8]
    (data / "chat_valid_small.jsonl").write_text("".join(json.dumps(c) + "\n" for c in valid), encoding="utf-8")
    text = training_template(base_template, ct.read(data / "chat_train.jsonl") + ct.read(data / "chat_test.jsonl"))
    template_file = data / "chat_template.jinja"
    template_file.write_text(text, encoding="utf-8")
    ct.align_files(data, base_template, {"train": args.dpo_pairs, "valid": 8})
    return data, text, template_file


def run_trl(args, py: str, data: Path, work: Path, tokenizer_dir: str, template: str) -> dict:
    out = work / "trl"
    out.mkdir(parents=True, exist_ok=True)
    spec = {"out": str(out), "gguf": args.gguf, "tokenizer_dir": tokenizer_dir, "template": template,
            "train": str(data / "chat_train.jsonl"), "rank": args.rank, "alpha": args.alpha, "dropout": args.dropout,
            "max_length": args.max_length, "batch": args.micro_batch, "steps": args.steps, "lr": args.lr}
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    run = timed([py, Path(__file__).resolve(), "--trl-worker", out / "spec.json"], work / "trl.log")
    return {**run, **json.loads((out / "stats.json").read_text())}


def run_task(args: argparse.Namespace) -> int:
    from meshlm.interop.checkpoints import open_checkpoint

    py, work = sys.executable, (ROOT / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    base_path = str(open_checkpoint(args.gguf).path)  # the GGUF imported once into meshlm's cache
    cfg = open_checkpoint(base_path).config
    tok, base_template = get_tokenizer(cfg.data.tokenizer), template_for(cfg.data.tokenizer)
    data, template, template_file = prepare_data(args, py, work, tok, base_template)
    convs, pairs = ct.read(data / "chat_test.jsonl"), ct.read(data / "pref_test.jsonl")
    commands = meshlm_commands(args, py, data, work, args.gguf, template_file)
    mean_tokens = conversation_tokens(tok, template, ct.read(data / "chat_train.jsonl"), args.max_length) / \
        len(ct.read(data / "chat_train.jsonl"))
    results, samples, runs = {}, {}, {}
    picked = convs[:args.samples]
    prompts = [render(base_template, c["messages"][:[m["role"] for m in c["messages"]].index("assistant")],
                      add_generation_prompt=True) for c in picked]
    stops = stop_strings(base_template)

    def measure(name, model, reference=None, checkpoint=None, adapter=None):
        results[name], scores = ct.evaluate(name, model, tok, base_template, convs, pairs, reference)
        del model
        if checkpoint:
            samples[name] = ct.sample(py, checkpoint, adapter, prompts, work, name.replace(" ", "_"),
                                      args.max_new_tokens, stops)
        return scores

    measure("base", load_run(base_path)[0].eval(), checkpoint=args.gguf)
    runs["meshlm"] = timed(commands["sft"], work / "sft.log") | meshlm_steps(work / "sft")
    runs["meshlm"]["tokens"] = args.steps * args.micro_batch * mean_tokens
    sft_scores = measure("SFT (meshlm LoRA)", ct.load(str(work / "sft"), base_path), checkpoint=args.gguf,
                         adapter=str(work / "sft"))
    if not args.skip_trl:
        runs["TRL"] = run_trl(args, py, data, work, cfg.data.tokenizer, template)
        model, runs["TRL"]["off_target_max_diff"] = trl_model(work / "trl", base_path)
        measure("SFT (TRL + PEFT LoRA)", model)
    merged = merged_run(base_path, work / "sft", work / "sft_merged")
    runs["dpo"] = timed(commands["dpo"], work / "dpo.log")
    measure("SFT + DPO (meshlm LoRA)", ct.load(str(work / "dpo"), str(merged)), sft_scores, checkpoint=str(merged),
            adapter=str(work / "dpo"))
    (work / "results.json").write_text(json.dumps({"results": results, "samples": samples, "runs": {
        k: {a: b for a, b in v.items() if a != "log"} for k, v in runs.items()}, "commands": ct.COMMANDS}, indent=1))
    report(args, results, samples, runs, picked, len(convs), len(pairs), time.perf_counter() - t_start)
    return 0


def report(args, results, samples, runs, picked, n_convs, n_pairs, total_s) -> None:
    print(f"\nheld-out test play: {n_pairs} preference pairs, {n_convs} conversations; base {args.gguf}; "
          f"{total_s / 60:.1f} min in all, load average now {os.getloadavg()[0]:.1f}\n")
    print("| model | assistant-turn loss | pref. accuracy (sum log-prob) | per token | vs other speaker "
          "| vs other play | implicit reward acc. |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        reward = f"{r['reward_acc']:.3f}" if "reward_acc" in r else "-"
        print(f"| {name} | {r['assistant_loss']:.4f} | {r['pref_acc']:.3f} | {r['pref_acc_per_token']:.3f} "
              f"| {r['pref_acc_other_speaker']:.3f} | {r['pref_acc_other_play']:.3f} | {reward} |")
    print(f"\nLoRA SFT, {args.steps} steps of {args.micro_batch} conversations (rows of {args.max_length}), "
          f"r={args.rank} α={args.alpha:g} dropout {args.dropout:g} on q, v, lr {args.lr:g} linear to 0, fp32:\n")
    print("| trainer | held-out loss | last train loss | process wall | process CPU (user+sys) | loop wall "
          "| conversation tokens/s (loop) | threads | load avg before → after |")
    print("|---|---|---|---|---|---|---|---|---|")
    names = {"meshlm": "SFT (meshlm LoRA)", "TRL": "SFT (TRL + PEFT LoRA)"}
    for key, run in runs.items():
        if key not in names:
            continue
        loss = results[names[key]]["assistant_loss"]
        print(f"| {key} | {loss:.4f} | {run['losses'][-1]:.4f} | {run['wall_s']:.0f} s | {run['cpu_s']:.0f} s "
              f"| {run['loop_s']:.0f} s | {(run['tokens'] or 0) / run['loop_s']:.0f} | {run['threads']} "
              f"| {run['load_before'][0]:.1f} → {run['load_after'][0]:.1f} |")
    if "TRL" in runs:
        mine, ref = results[names["meshlm"]]["assistant_loss"], results[names["TRL"]]["assistant_loss"]
        walls = runs["meshlm"]["wall_s"] / runs["TRL"]["wall_s"]
        print(f"\nmeshlm / TRL held-out loss: {mine / ref:.4f}; process wall {walls:.2f}×,"
              f" loop {runs['meshlm']['loop_s'] / runs['TRL']['loop_s']:.2f}×; TRL's merged weights outside q, v "
              f"against meshlm's base: max |Δ| {runs['TRL']['off_target_max_diff']:.2e}")
        print(f"per-step train loss, meshlm: {' '.join(f'{x:.3f}' for x in runs['meshlm']['losses'])}")
        print(f"per-step train loss, TRL:    {' '.join(f'{x:.3f}' for x in runs['TRL']['losses'])}")
    if "dpo" in runs:
        d = runs["dpo"]
        print(f"DPO: {d['wall_s']:.0f} s wall, {d['cpu_s']:.0f} s CPU, load {d['load_before'][0]:.1f} → "
              f"{d['load_after'][0]:.1f}")
    ct.print_samples(picked, samples, ct.COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
