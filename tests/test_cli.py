"""User errors: one line naming the key or path and the fix, exit code 2, no traceback; CLI start-up."""

import subprocess
import sys

import pytest

from tests.conftest import run_cli


@pytest.mark.parametrize("args, words", [
    (["train", "--train.max_stepz=3"], ["train.max_stepz", "train.max_steps"]),
    (["train", "--train.max_steps=abc"], ["train.max_steps", "expected int"]),
    (["train", "--train.micro_batch_size=3", "--train.global_batch_size=10"], ["global_batch_size", "set it to 9"]),
    (["train", "--config", "missing.toml"], ["missing.toml", "does not exist"]),
    (["train", "--train.resume=/nonexistent/run"], ["/nonexistent/run", "no checkpoint"]),
    (["generate", "--checkpoint", "/nonexistent/run"], ["/nonexistent/run", "no checkpoint"]),
    (["plot", "/nonexistent/run"], ["metrics.jsonl"]),
    (["train", "--data.paths=[\"/nonexistent/corpus.txt\"]"], ["data.paths", "/nonexistent/corpus.txt"]),
])
def test_user_errors_exit_2_with_one_clear_line(args, words, tmp_path):
    extra = [f"--train.out_dir={tmp_path}"] if args[0] == "train" else []
    proc = run_cli(*args, *extra, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0]


def test_unknown_flag_is_a_usage_error():
    proc = run_cli("train", "--bogus")
    assert proc.returncode == 2 and "--train.lr=3e-4" in proc.stderr


def test_prepare_never_imports_torch(tmp_path):
    """`meshlm prepare` (and the CLI's parser) start without torch: it takes ~2 s to import on this CPU."""
    (tmp_path / "a.txt").write_text("To be, or not to be.\n")
    code = ("import sys; from meshlm.cli import main\n"
            f"sys.argv = ['meshlm', 'prepare', '--input', {str(tmp_path / 'a.txt')!r}, '--output', "
            f"{str(tmp_path / 'out' / 'a')!r}, '--tokenizer', 'gpt2']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"
    assert (tmp_path / "out" / "a.bin").stat().st_size > 0
