"""The argparse layer stays in `meshlm/commands/` and `meshlm/cli.py` (issue 45, item 6): the handlers below them
take typed arguments (a frozen dataclass built by the command module, or explicit parameters), never the parsed
`argparse.Namespace`. Checked from the source with `ast`: no other module imports argparse, annotates a parameter
as a Namespace, or reads attributes of a parameter named `args` (an unannotated Namespace passed down)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "meshlm"
ARGPARSE_LAYER = ("meshlm/commands/", "meshlm/cli.py")
# Known exceptions, each to be removed once its module is converted (none left; the check below keeps it honest).
EXCEPTIONS: set[str] = set()


def _is_namespace(annotation: ast.expr | None) -> bool:
    """`argparse.Namespace`, `Namespace`, or either as a string annotation."""
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return False
    if isinstance(annotation, ast.Attribute):
        return annotation.attr == "Namespace" and isinstance(annotation.value, ast.Name) and \
            annotation.value.id == "argparse"
    return isinstance(annotation, ast.Name) and annotation.id == "Namespace"


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = fn.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []), *([a.kwarg] if a.kwarg else [])]


def _reads_args_attributes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether `fn` has an unannotated parameter named `args` and reads `args.<name>` (a Namespace passed down
    without saying so; an `args: SomeOptions` is typed)."""
    if not any(p.arg == "args" and p.annotation is None for p in _parameters(fn)):
        return False
    return any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "args"
               for n in ast.walk(fn))


def argparse_uses(source: str, name: str) -> list[str]:
    """'NAME:LINE what' for each use of argparse in `source`: an import of it, a parameter annotated as its
    Namespace, a function reading attributes of an unannotated parameter named `args`."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names):
            found.append(f"{name}:{node.lineno} imports argparse")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "argparse":
            found.append(f"{name}:{node.lineno} imports from argparse")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for p in _parameters(node):
                if _is_namespace(p.annotation):
                    found.append(f"{name}:{node.lineno} {node.name}({p.arg}: Namespace)")
            if _reads_args_attributes(node):
                found.append(f"{name}:{node.lineno} {node.name} reads args.<attribute>")
    return found


def below_commands() -> list[tuple[str, Path]]:
    """(path relative to the repository, path) of every meshlm module outside the argparse layer."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(ARGPARSE_LAYER):
            out.append((rel, path))
    return out


def test_no_module_below_commands_uses_argparse():
    found = [use for rel, path in below_commands() if rel not in EXCEPTIONS
             for use in argparse_uses(path.read_text(), rel)]
    assert found == [], ("argparse belongs to meshlm/commands/ and meshlm/cli.py; give these handlers a typed options "
                         "dataclass built in the command module:\n" + "\n".join(found))


def test_each_exception_still_uses_argparse():
    """An exception that no longer needs to be one is removed from EXCEPTIONS (so the list cannot go stale)."""
    for rel in sorted(EXCEPTIONS):
        assert argparse_uses((ROOT / rel).read_text(), rel), f"{rel} no longer uses argparse; drop it from EXCEPTIONS"


def test_the_check_finds_each_kind_of_use():
    source = ("import argparse\n"
              "from argparse import Namespace\n"
              "def a(args: argparse.Namespace) -> int:\n    return 0\n"
              "def b(opts: 'Namespace'):\n    return opts\n"
              "def c(args):\n    return args.out\n"
              "def d(module, args, output):\n    return output\n"  # a hook's `args` tuple: read by index, not name
              "def e(opts, *, out: str):\n    return opts.out\n"
              "def f(args: 'TuneOptions'):\n    return args.out\n")
    assert argparse_uses(source, "m.py") == ["m.py:1 imports argparse", "m.py:2 imports from argparse",
                                             "m.py:3 a(args: Namespace)", "m.py:5 b(opts: Namespace)",
                                             "m.py:7 c reads args.<attribute>"]


def test_the_argparse_layer_itself_is_not_checked():
    """The command modules and cli.py parse flags (they import argparse): the check leaves them out, and sees
    every other module."""
    checked = {rel for rel, _ in below_commands()}
    assert "meshlm/cli.py" not in checked and not any(r.startswith("meshlm/commands/") for r in checked)
    assert argparse_uses((PACKAGE / "cli.py").read_text(), "meshlm/cli.py")  # it does parse flags
    assert len(checked) == len(list(PACKAGE.rglob("*.py"))) - 1 - len(list((PACKAGE / "commands").glob("*.py")))


# ---- every flag reaches the typed options -------------------------------------------------------------------
def _parsed(argv: list[str]):
    from meshlm.cli import build_parser

    args, extra = build_parser().parse_known_args(argv)
    assert extra == []
    return args


def _assert_every_flag_reaches(args, opts, leave_out: set[str] = frozenset()) -> None:
    """Each parsed flag of `args` (but `leave_out`) is a field of `opts` with the same value (lists as tuples), and
    `opts` has no other field: a flag added to the parser and not to the options fails here."""
    import dataclasses

    given = {k: v for k, v in vars(args).items() if k not in {"command", "func", *leave_out}}
    got = dataclasses.asdict(opts)
    assert set(got) == set(given)
    assert got == {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}


def test_every_tune_flag_reaches_tune_options():
    from meshlm.commands.tune import tune_options

    args = _parsed(["tune", "--checkpoint", "B", "--method", "lora", "--train", "t.jsonl", "--valid", "v.jsonl",
                    "--out", "o", "--template", "x=Q {q} A {answer}", "--template", "{answer}", "--task", "classify",
                    "--epochs", "2", "--max-length", "9", "--truncate", "--chat-template", "c.jinja", "--pack"])
    opts = tune_options(args)
    _assert_every_flag_reaches(args, opts)
    assert opts.template == ("x=Q {q} A {answer}", "{answer}") and opts.max_length == 9 and opts.pack is True
    bare = tune_options(_parsed(["tune", "--checkpoint", "B", "--method", "full", "--train", "t", "--valid", "v",
                                 "--out", "o"]))
    assert (bare.template, bare.task, bare.max_length, bare.truncate, bare.pack, bare.epochs) == ((), None, None,
                                                                                                   False, False, 3)


def test_every_finetune_flag_reaches_finetune_options():
    from meshlm.commands.finetune import finetune_options

    args = _parsed(["finetune", "--checkpoint", "B", "--task", "span", "--train", "t.jsonl", "--valid", "v.jsonl",
                    "--out", "o", "--epochs", "5", "--max-length", "64", "--truncate"])
    opts = finetune_options(args)
    _assert_every_flag_reaches(args, opts)
    assert (opts.task, opts.epochs, opts.max_length, opts.truncate) == ("span", 5, 64, True)


def test_every_preference_flag_of_align_reaches_align_options():
    """`meshlm align --method dpo|ipo|simpo`: every flag but the online-RL group's (GRPO's own) is in AlignOptions."""
    import argparse

    from meshlm.commands.align import add_align_command, align_options

    parser = argparse.ArgumentParser()
    add_align_command(parser.add_subparsers())
    align = next(a for a in parser._subparsers._group_actions[0].choices.values())
    online = {a.dest for g in align._action_groups if g.title and g.title.startswith("online RL")
              for a in g._group_actions}
    assert {"reward", "num_generations", "loss_type"} <= online
    args = _parsed(["align", "--checkpoint", "B", "--method", "simpo", "--train", "p.jsonl", "--valid", "v.jsonl",
                    "--out", "o", "--beta", "2.5", "--label-smoothing", "0.1", "--simpo-gamma", "1.5", "--adapter",
                    "lora", "--epochs", "2", "--max-length", "48", "--chat-template", "c.jinja"])
    opts = align_options(args)
    _assert_every_flag_reaches(args, opts, leave_out=online)
    assert (opts.method, opts.beta, opts.label_smoothing, opts.simpo_gamma, opts.adapter) == ("simpo", 2.5, 0.1, 1.5,
                                                                                              "lora")


def test_every_online_flag_of_align_reaches_grpo_flags():
    """`meshlm align --method grpo|rloo`: every flag but the preference methods' own is in `grpo.Flags`, and the
    checked Options carry what the run reads and writes."""
    from meshlm.commands.align import grpo_flags
    from meshlm.tune.grpo import check_options

    argv = ["align", "--checkpoint", "B", "--method", "grpo", "--train", "p.jsonl", "--out", "o", "--beta", "0.04",
            "--adapter", "lora", "--chat-template", "c.jinja", "--reward", "m:f", "--reward", "m:g",
            "--reward-weights", "1", "0.5", "--num-generations", "6", "--prompts-per-step", "3", "--steps", "7",
            "--num-iterations", "2", "--loss-type", "dapo", "--epsilon", "0.1", "--epsilon-high", "0.28",
            "--scale-rewards", "none", "--max-completion-length", "32", "--temperature", "0.7", "--top-k", "5",
            "--lr", "1e-5", "--seed", "3", "--off-policy-lag", "1", "--dynamic-sampling", "--max-sampling-rounds",
            "2", "--save-every", "4"]
    args = _parsed(argv)
    flags = grpo_flags(args)
    _assert_every_flag_reaches(args, flags, leave_out={"valid", "label_smoothing", "simpo_gamma", "epochs",
                                                       "max_length"})
    opts = check_options(flags)
    assert (opts.group_size, opts.loss.loss_type, opts.loss.epsilon_high, opts.off_policy_lag, opts.checkpoint,
            opts.out, opts.adapter) == (6, "dapo", 0.28, 1, "B", "o", "lora")
    bare = grpo_flags(_parsed(["align", "--checkpoint", "B", "--method", "rloo", "--train", "p", "--out", "o"]))
    assert (bare.reward, bare.reward_weights, bare.beta) == ((), None, 0.0)  # --beta's online default filled in


def test_betas_default_is_filled_in_by_each_method_and_the_parsed_flags_stay_as_given():
    """No --beta: DPO's options take TRL's 0.1, GRPO's flags 0.0, and neither writes into the parsed namespace."""
    from meshlm.commands.align import align_options, grpo_flags

    args = _parsed(["align", "--checkpoint", "B", "--method", "dpo", "--train", "p", "--out", "o"])
    assert align_options(args).beta == 0.1 and args.beta is None
    args = _parsed(["align", "--checkpoint", "B", "--method", "grpo", "--train", "p", "--out", "o"])
    assert grpo_flags(args).beta == 0.0 and args.beta is None


def test_every_plan_flag_reaches_plan_options():
    """Every `meshlm plan` flag, the `--gpu-NAME` overrides among them, is a field of PlanOptions."""
    from meshlm.commands.plan import plan_options

    args = _parsed(["plan", "--config", "gpt-tiny", "--gpus", "16", "--gpus-per-node", "4", "--gpu", "h100-80gb",
                    "--gpu-tflops", "900", "--gpu-memory-gb", "70", "--gpu-hbm-gbps", "3000", "--gpu-intra-gbps", "400",
                    "--gpu-inter-gbps", "50", "--gpu-intra-latency-us", "2", "--gpu-inter-latency-us", "8",
                    "--gpu-op-overhead-us", "4", "--gpu-gather-cost", "0.6", "--global-batch-size", "64",
                    "--seq-len", "256", "--precision", "fp16", "--runtime", "megatron-2022", "--top", "3", "--all",
                    "--json", "--layout", "tp=2", "--explain", "tp=2,pp=1", "--write-config", "w.toml", "--trial", "2",
                    "--steps", "4", "--inference", "--prompt-tokens", "100", "--output-tokens", "20", "--ttft-ms",
                    "200", "--tpot-ms", "25"])
    opts = plan_options(args)
    _assert_every_flag_reaches(args, opts)
    assert (opts.gpus_per_node, opts.gpu_memory_gb, opts.gpu_gather_cost, opts.runtime, opts.tpot_ms) == (
        4, 70.0, 0.6, "megatron-2022", 25.0)
    bare = plan_options(_parsed(["plan"]))
    assert (bare.gpus, bare.gpu, bare.gpu_tflops, bare.top, bare.trial, bare.inference) == (8, "a100-80gb", None, 10,
                                                                                              0, False)
