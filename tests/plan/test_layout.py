"""core/layout.py: one torch-free answer to "is this layout valid, and what are its numbers"."""

from __future__ import annotations

import pytest

from meshlm.core.config import ConfigError, load_config
from meshlm.core.layout import plan_layout
from meshlm.families.registry import get_spec


def test_a_valid_layout_gives_its_micro_batches_and_stages():
    cfg = load_config("gpt2-1.3b", ["--parallel.pp=2", "--parallel.vpp=2", "--train.micro_batch_size=4"])
    layout = plan_layout(cfg, pp=2, dp=4, tp=2, stage_cost=get_spec("gpt").stage_costs(cfg.model))
    assert layout.world_size == 16
    assert layout.microbatches == 512 // (4 * 4)
    assert len(layout.stage_layers) == 4 and sum(layout.stage_layers) == 24
    assert layout.stage_layers[-1] < layout.stage_layers[0], "the head's cost leaves the last stage fewer layers"


@pytest.mark.parametrize("overrides, world, key", [
    (["--model.n_heads=6", "--model.hidden_size=48"], (1, 1, 4), "parallel.tp=4"),
    (["--train.global_batch_size=8", "--train.micro_batch_size=4"], (1, 4, 1), "train.global_batch_size=8"),
    (["--parallel.pp=2", "--parallel.vpp=2", "--train.global_batch_size=6", "--train.micro_batch_size=2"],
     (2, 1, 1), "parallel.vpp=2"),
    (["--train.recompute=full", "--train.recompute_num_layers=2", "--parallel.pp=2"], (2, 1, 1),
     "train.recompute_num_layers=2"),
])
def test_an_invalid_layout_names_the_key(overrides, world, key):
    """Rules that need the world (dp) or the real, cost-balanced stage partition (gpt-tiny on pp=2: its 50k
    head leaves the last stage one layer) are caught here, before any transform."""
    cfg = load_config("gpt-tiny", overrides)
    pp, dp, tp = world
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        plan_layout(cfg, pp=pp, dp=dp, tp=tp, stage_cost=get_spec("gpt").stage_costs(cfg.model))
