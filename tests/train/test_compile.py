import json

from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config


def test_torch_compile_gives_the_eager_losses(tmp_path):
    """train.compile=true runs the same math through Inductor (fp32: equal within 1e-5 relative)."""
    losses = {}
    for compile_ in (False, True):
        out = tmp_path / str(compile_)
        Trainer(tiny_config(out, train={"compile": compile_, "max_steps": 2, "eval_iters": 1})).run()
        losses[compile_] = [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()
                            if json.loads(ln)["kind"] == "train"]
    for a, b in zip(losses[False], losses[True], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)
