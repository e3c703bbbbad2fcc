import pytest

from meshlm.core.config import ConfigError, apply_overrides, build, bundled_configs, load_config


def test_bundled_configs_load_and_validate():
    names = bundled_configs()
    assert {"gpt-tiny", "gpt2-124m", "gpt2-1.3b", "llama-tiny"} <= set(names)
    for name in names:
        cfg = load_config(name)
        assert cfg.train.global_batch_size % cfg.train.micro_batch_size == 0


def test_overrides_are_typed_from_toml_syntax():
    cfg = load_config("gpt-tiny", ["--train.max_steps=7", "--optim.lr=3e-4", "--parallel.sp=false",
                                   "--model.position=rope", '--data.paths=["a.txt", "b.txt"]', "--train.resume=never"])
    assert cfg.train.max_steps == 7 and cfg.optim.lr == 3e-4 and cfg.parallel.sp is False
    assert cfg.model.position == "rope" and cfg.data.paths == ["a.txt", "b.txt"] and cfg.train.resume == "never"


def test_bare_string_override_without_quotes():
    assert load_config("gpt-tiny", ["--train.out_dir=runs/x"]).train.out_dir == "runs/x"


def test_precision_and_fused_loss_default_to_auto_and_take_booleans():
    cfg = build({})
    assert cfg.train.precision == "auto" and cfg.train.fused_loss == "auto"
    assert load_config("gpt-tiny", ["--train.fused_loss=false"]).train.fused_loss is False
    assert load_config("gpt-tiny", ["--train.fused_loss=auto", "--train.precision=auto"]).train.fused_loss == "auto"


def test_int_accepted_for_float_key():
    assert load_config("gpt-tiny", ["--optim.lr=1"]).optim.lr == 1.0


@pytest.mark.parametrize("override, words", [
    ("--train.max_step=5", ["train.max_step", "did you mean train.max_steps"]),
    ("--trian.max_steps=5", ["trian", "did you mean train"]),
    ("--train.max_steps=five", ["train.max_steps", "expected int"]),
    ("--train.max_steps=1.5", ["train.max_steps", "expected int"]),
    ("--train.global_batch_size=20", ["train.global_batch_size=20", "train.micro_batch_size=8", "set it to 16"]),
    ("--train.precision=fp8", ["train.precision", "fp32, bf16, fp16"]),
    ("--train.precision=fp8", ["auto"]),
    ("--train.fused_loss=maybe", ["train.fused_loss='maybe'", "true, false, auto"]),
    ("--model.n_heads=5", ["model.hidden_size=128", "model.n_heads=5"]),
    ("--parallel.tp=3", ["parallel.tp=3", "model.n_heads=4"]),
    ("--parallel.sp=true", ["parallel.sp", "parallel.tp > 1"]),
    ("--optim.decay=step", ["optim.decay", "cosine"]),
    ("--data.split=a,b", ["data.split"]),
])
def test_bad_values_name_the_key_and_fix(override, words):
    with pytest.raises(ConfigError) as err:
        load_config("gpt-tiny", [override])
    for word in words:
        assert word in str(err.value)


def test_malformed_override():
    with pytest.raises(ConfigError, match="--section.key=value"):
        apply_overrides({}, ["max_steps=3"])


def test_unknown_config_name_lists_bundled():
    with pytest.raises(ConfigError, match="gpt-tiny"):
        load_config("no-such-config")


def test_build_from_nested_dict_roundtrip():
    cfg = load_config("llama-tiny")
    assert build(cfg.to_dict()) == cfg
    assert cfg.model.kv_heads == 2 and cfg.model.ffn_size == 384
