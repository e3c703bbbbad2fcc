"""`meshlm plan` bounds what it is asked (issue 35, item 11): an absurd GPU count or global batch is refused in
one line with exit 2 naming the flag, while real clusters (3,072 and 16,384 GPUs) are still answered, and a
cluster too large for its global batch says which batch would do rather than crashing or searching forever.
In-process through `meshlm.cli.main`."""

from __future__ import annotations

import json

import pytest

from meshlm.cli import main

CLUSTER = ["--config", "gpt2-124m", "--gpu", "a100-80gb", "--gpus-per-node", "8"]


def _run(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(rc: int, out: str, err: str) -> str:
    assert rc == 2 and out == "", (rc, out, err)
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_an_absurd_gpu_count_is_refused_and_real_large_clusters_are_answered(capsys):
    """1e9 GPUs used to hang (the divisors of the world were enumerated one by one); 3,072 and 16,384 (the
    size of the 1T model of Narayanan et al. 2021, and a larger cluster; here with GPT-2 124M, whose search is
    small) get a ranked plan whose layouts cover them."""
    err = _one_line_error(*_run(capsys, "--config", "gpt-tiny", "--gpus", "1000000000"))
    assert "--gpus 1000000000" in err and "1,048,576" in err, err
    for gpus, batch in ((3072, 3072), (16384, 16384)):
        rc, out, err = _run(capsys, *CLUSTER, "--gpus", str(gpus), "--global-batch-size", str(batch), "--json",
                            "--top", "3")
        assert rc == 0, err
        rows = json.loads(out)
        assert rows and all(r["tp"] * r["pp"] * r["dp"] == gpus and r["fits"] for r in rows), rows


@pytest.mark.parametrize("value", ["1000000000000000", "0", "-3"])
def test_a_global_batch_size_out_of_range_names_the_flag(capsys, value):
    err = _one_line_error(*_run(capsys, "--config", "gpt-tiny", "--global-batch-size", value))
    assert f"--global-batch-size {value}" in err and "16,777,216" in err, err


def test_a_global_batch_size_out_of_range_from_the_config_names_the_key(capsys):
    err = _one_line_error(*_run(capsys, "--config", "gpt-tiny", "--train.global_batch_size=1000000000000000"))
    assert "train.global_batch_size=1000000000000000" in err and "16,777,216" in err, err


def test_a_cluster_too_large_for_its_global_batch_says_which_batch_would_do(capsys):
    """65,536 GPUs for gpt-tiny's batch of 8 sequences: no layout can use them (a traceback before); the line
    names --global-batch-size and the smallest one that gives every GPU a sequence, which then plans."""
    err = _one_line_error(*_run(capsys, "--config", "gpt-tiny", "--gpus", "65536"))
    # tp up to its 4 heads, pp up to its 6 layers and dividing 65536 / tp: dp >= 65536 / (4 · 4) = 4096
    assert "--global-batch-size 8" in err and "at least 4096" in err, err
    rc, out, err = _run(capsys, "--config", "gpt-tiny", "--gpus", "65536", "--global-batch-size", "4096", "--json",
                        "--top", "1")
    assert rc == 0, err
    assert (json.loads(out)[0]["tp"], json.loads(out)[0]["pp"], json.loads(out)[0]["dp"]) == (4, 4, 4096)
