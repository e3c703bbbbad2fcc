"""The README's user-facing commands, run as a user would (with a few steps instead of hundreds)."""

import json
from pathlib import Path

from tests.cli_batch import run_meshlm_batch, shell_words
from tests.conftest import ROOT, run_cli, run_shell

SMALL = ["--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32", "--train.micro_batch_size=2",
         "--train.global_batch_size=4", "--train.eval_iters=2", "--train.peak_tflops=1"]


def test_train_generate_plot_end_to_end(tmp_path):
    """Train, generate twice with one seed, plot: the four commands in one process (tests/cli_batch.py), so the
    second `generate` repeats the first from the seed alone, not from a fresh interpreter's RNG state."""
    out = tmp_path / "run"
    sampling = ["--prompt", "ROMEO.", "--max-new-tokens", "8", "--temperature", "0.8", "--top-k", "50", "--top-p",
                "0.95", "--seed", "1"]
    proc, gen, again, plot = run_meshlm_batch(
        [["train", "--config", "gpt-tiny", *SMALL, "--train.max_steps=6", "--train.log_every=2",
          "--train.eval_every=3", "--train.sample_tokens=20", f"--train.out_dir={out}"],
         ["generate", "--checkpoint", str(out), *sampling], ["generate", "--checkpoint", str(out), *sampling],
         ["plot", str(out)]], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "val loss" in proc.stdout and "bits/byte" in proc.stdout and "---- sample ----" in proc.stdout
    assert "MFU" in proc.stdout and "TFLOP/s" in proc.stdout and "tok/s" in proc.stdout
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [2, 4, 6] and [r["step"] for r in evals] == [3, 6]
    for r in train:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "hfu", "peak_mem_mb"} <= set(r)
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"]
    assert evals[-1]["val_bpb"] > 0 and evals[-1]["val_ppl"] > 1
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))

    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("ROMEO.")
    assert again.returncode == 0 and again.stdout == gen.stdout
    assert plot.returncode == 0, plot.stderr
    assert (out / "loss.png").stat().st_size > 1000


def test_llama_tiny_config_trains(tmp_path):
    proc = run_cli("train", "--config", "llama-tiny", *SMALL, "--model.n_heads=4", "--model.n_kv_heads=2",
                   "--train.max_steps=2", "--train.sample_tokens=0", f"--train.out_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr


def _section_commands(title: str) -> list[str]:
    from tests.conftest import ROOT

    section = (ROOT / "README.md").read_text().split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```bash\n")[1:]
    return [line for block in blocks for line in block.split("```", 1)[0].splitlines() if line.strip()]


def test_readme_bert_commands(tmp_path):
    """Every command of the README's BERT section, as typed (outputs moved under tmp_path; the training
    runs narrowed to a few steps)."""
    import shlex
    import subprocess
    import sys

    import numpy as np

    bin_dir = str(Path(sys.executable).parent)
    texts = tmp_path / "texts.txt"
    texts.write_text("To be, or not to be: that is the question.\nNow is the winter of our discontent.\n"
                     "A horse! a horse! my kingdom for a horse!\n")
    commands = _section_commands("BERT: pretraining, embeddings, Hugging Face")
    assert len(commands) == 7, commands
    typed = []
    for line in commands:
        line = line.replace(".venv/bin/", bin_dir + "/").replace("runs/", f"{tmp_path}/runs/")
        line = line.replace("data/genre", f"{tmp_path}/data/genre")
        if " finetune " in line:  # the narrowed bert-tiny above has 32 positions; two steps
            line = line.replace("--max-length 64", "--max-length 32") + " --train.max_steps=2 --train.progress=false"
        line = line.replace("texts.txt", str(texts)).replace("vectors.npy", str(tmp_path / "vectors.npy"))
        if line.startswith("torchrun"):
            line = line.replace("torchrun", f"{shlex.quote(sys.executable)} -m torch.distributed.run", 1)
        if " train " in line:
            out = f" --train.out_dir={tmp_path}/runs/bert-tiny" if "out_dir" not in line else ""
            line += out + " " + " ".join(SMALL) + " --train.max_steps=2 --model.seq_len=32 --parallel.timeout_s=60"
        typed.append(line)
    # The torchrun launch and the data script first (no `meshlm` line writes what they read), then the five
    # `meshlm` lines in their order, in one process (tests/cli_batch.py).
    meshlm = [line for line in typed if line.startswith(f"{bin_dir}/meshlm ")]
    for line in [line for line in typed if line not in meshlm]:
        proc = subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              check=False)
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
    assert len(meshlm) == 5, meshlm
    batch = run_meshlm_batch([shell_words(line, ROOT)[1:] for line in meshlm], cwd=ROOT)
    for line, proc in zip(meshlm, batch):
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
    vectors = np.load(tmp_path / "vectors.npy")
    assert vectors.shape == (3, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert (tmp_path / "runs" / "minilm-hf" / "config.json").exists()
    assert (tmp_path / "runs" / "bert-tiny" / "metrics.jsonl").exists()
    assert (tmp_path / "runs" / "bert-tiny-tp2" / "metrics.jsonl").exists()
    evals = [json.loads(line) for line in (tmp_path / "runs" / "genre" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "eval"]
    assert evals and {"val_accuracy", "val_f1"} <= set(evals[-1])


def test_readme_tune_commands(tmp_path):
    """Every command of the README's tuning section, as typed, on a narrowed `make demo` base (outputs moved
    under tmp_path; each tuning run two steps; `meshlm eval` reads the first items of the shipped set, put
    in its cache, as tests/eval/test_readme_eval.py does)."""
    import shlex
    import subprocess
    import sys

    from meshlm.eval import sets
    from tests.infer.server_helpers import free_port

    bin_dir = str(Path(sys.executable).parent)
    base = ["--model.n_layers=2", "--model.hidden_size=32", "--train.micro_batch_size=2", "--train.global_batch_size=2",
            "--train.eval_iters=1", "--train.peak_tflops=1", "--train.max_steps=2", "--train.progress=false",
            "--train.sample_tokens=0", f"--train.out_dir={tmp_path}/runs/gpt-tiny"]
    commands = _section_commands("Tuning: prompt tuning, p-tuning, LoRA")
    assert len(commands) == 10, commands
    # The serving lines run as one shell script (the server a background job), waiting for it to answer.
    first = next(i for i, c in enumerate(commands) if c.endswith("&"))
    last = next(i for i, c in enumerate(commands) if c == "kill %1")
    port = str(free_port())
    wait = f"for i in $(seq 120); do curl -sf http://127.0.0.1:{port}/health >/dev/null && break; sleep 0.5; done"
    script = "\n".join([commands[first], wait, *commands[first + 1:last + 1]]).replace("8002", port)
    commands = [*commands[:first], script, *commands[last + 1:]]
    shipped = sets.cache_path("shakespeare-choice", tmp_path / "cache" / "eval")
    shipped.parent.mkdir(parents=True)
    shipped.write_text("".join(sets.ensure_set("shakespeare-choice").read_text().splitlines(keepends=True)[:8]))
    typed = []
    for line in commands:
        line = line.replace(".venv/bin/", bin_dir + "/").replace("runs/", f"{tmp_path}/runs/")
        line = line.replace("data/plays", f"{tmp_path}/data/plays")
        if line.startswith("torchrun"):
            line = line.replace("torchrun", f"{shlex.quote(sys.executable)} -m torch.distributed.run", 1)
        if " tune " in line:
            line += " --train.max_steps=2 --train.progress=false --train.eval_iters=1 --train.peak_tflops=1"
            line += " --parallel.timeout_s=60"
        typed.append(line)
    # The data script, then the base's training and the five one-process `meshlm` lines in their order, in one
    # process (tests/cli_batch.py), then the torchrun launch and the serving script (which read their outputs).
    meshlm = [line for line in typed if line.startswith(f"{bin_dir}/meshlm ") and "\n" not in line]
    data, later = typed[:1], [line for line in typed[1:] if line not in meshlm]
    assert "make_play_task.py" in data[0] and len(meshlm) == 5, typed
    outputs = {}
    for line in data:
        proc = subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
    eval_at = next(i for i, line in enumerate(meshlm) if " eval " in line)
    batch = run_meshlm_batch([["train", "--config", "gpt-tiny", *base], *(shell_words(ln, ROOT)[1:] for ln in meshlm)],
                             cwd=ROOT, command_env={1 + eval_at: {"MESHLM_CACHE": str(tmp_path / "cache")}})
    for line, proc in zip(["(the base) train", *meshlm], batch):
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
        outputs[line] = proc.stdout
    for line in later:  # the serving script's server must not outlive it (`run_shell`)
        proc = run_shell(line, 300)
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
        outputs[line] = proc.stdout
    for name in ("plays-lora", "plays-prompt", "plays-ptuning", "plays-lora-tp2"):
        run = tmp_path / "runs" / name
        assert (run / "adapter.json").exists() and (run / "adapter_config.json").exists(), name
    generated = next(v for k, v in outputs.items() if " generate " in k)
    assert generated.startswith("Something is rotten in the state of Denmark.\nPlay:")
    evaluated = json.loads(next(v for k, v in outputs.items() if " eval " in k))
    assert evaluated["examples"] > 0 and 0 <= evaluated["accuracy"] <= 1
    served = json.loads(next(v for k, v in outputs.items() if " serve " in k))
    assert served["model"] == "plays-lora" and served["choices"][0]["finish_reason"] in ("length", "stop")


def test_readme_plan_commands_print_what_the_readme_shows():
    """Each `meshlm plan` command of the README's planning section, run as typed, prints exactly the output
    block that follows it (the planner is arithmetic: no wall time, no machine in its output)."""
    import shlex
    from itertools import pairwise

    section = (ROOT / "README.md").read_text().split("## Planning a run", 1)[1].split("\n## ", 1)[0]
    parts = section.split("```")  # text, lang+code, text, lang+code, ...
    blocks = [parts[i] for i in range(1, len(parts), 2)]
    pairs = [(a, b) for a, b in pairwise(blocks) if a.startswith("bash\n") and not
             b.startswith("bash\n")]
    assert len(pairs) == 2, "the section shows a training plan and a serving plan, each with its output"
    argvs = [shlex.split(command.removeprefix("bash\n").strip()) for command, _ in pairs]
    for args in argvs:
        assert args[:2] == ["meshlm", "plan"], args
    for args, (_, shown), proc in zip(argvs, pairs, run_meshlm_batch([a[1:] for a in argvs], cwd=ROOT)):
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == shown.strip("\n").removeprefix("text").strip(), " ".join(args)


def test_make_demo_trains_the_demo_config_and_prints_a_sample(tmp_path):
    """`make demo` is `meshlm train --config demo` (the README's first command): its tokenizer trained on the
    corpus, Muon, a sample at the end; narrowed here to a few steps of a small shape."""
    from meshlm.checkpoint.files import load_config_dict
    from meshlm.checkpoint.single import load_part, resolve_checkpoint
    from tests.conftest import ROOT

    demo = [ln for ln in (ROOT / "Makefile").read_text().splitlines() if "meshlm train" in ln]
    assert demo == ["\t$(PY) -m meshlm train --config demo"]
    assert (ROOT / "README.md").read_text().split("```bash\n", 1)[1].startswith("make demo ")
    out = tmp_path / "demo"
    proc = run_cli("train", "--config", "demo", *SMALL, "--train.max_steps=3", "--train.sample_tokens=12",
                   f"--train.out_dir={out}")
    assert proc.returncode == 0, proc.stderr
    assert "---- sample ----" in proc.stdout and "ROMEO." in proc.stdout
    path = resolve_checkpoint(out)
    cfg = load_config_dict(path)
    assert (cfg["data"]["tokenizer"], cfg["model"]["vocab_size"], cfg["optim"]["name"]) == \
        ("shakespeare-bpe:4096", 4096, "muon")
    kinds = {k for st in load_part(path, "optim")["state"].values() for k in st}
    assert {"momentum_buffer", "exp_avg"} <= kinds
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]
    assert evals and 0 < evals[-1]["val_bpb"] < float("inf")


def test_readme_resume_commands_continue_from_the_step_they_say(tmp_path):
    """The README's resume example, as typed (300 and 600 steps narrowed to 2 and 4, outputs under
    tmp_path): the second command resumes at the first one's last step and ends where a straight run does. The
    three runs share one process (tests/cli_batch.py)."""
    import shlex
    import sys

    commands = _section_commands("Checkpoints and resuming")
    assert len(commands) == 2, commands
    assert "from step 300" in commands[1]
    narrow = SMALL + ["--train.sample_tokens=0", "--train.eval_every=0", "--train.progress=false",
                      "--train.log_every=1"]
    typed = []
    for line in commands:
        line = line.split("#", 1)[0].replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
        line = line.replace("runs/", f"{tmp_path}/runs/").replace("max_steps=300", "max_steps=2")
        line = line.replace("max_steps=600", "max_steps=4").replace("decay_steps=600", "decay_steps=4")
        typed.append(line)
    straight = tmp_path / "straight"
    argvs = [shell_words(line + " " + " ".join(map(shlex.quote, narrow)), ROOT)[1:] for line in typed]
    *procs, proc = run_meshlm_batch([*argvs, ["train", "--config", "gpt-tiny", "--train.max_steps=4",
                                              f"--train.out_dir={straight}", *narrow]], cwd=ROOT)
    for line, done in zip(typed, procs):
        assert done.returncode == 0, (line, done.stderr[-2000:])
    outputs = [done.stdout + done.stderr for done in procs]
    assert "step_0000002 at step 2" in outputs[1], outputs[1][-2000:]
    run = tmp_path / "runs" / "gpt-tiny-600"
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4]
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [[r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
               if r["kind"] == "train"] for d in (run, straight)]
    assert losses[0] == losses[1], "the two halves are the straight run's steps"
