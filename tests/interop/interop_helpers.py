"""Shared by the tests of meshlm/interop and `meshlm embed`: the CLI in this process, one-line errors."""

from __future__ import annotations

import contextlib
import io

import torch

from meshlm.cli import main

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
