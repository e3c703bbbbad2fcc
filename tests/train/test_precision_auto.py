"""train.precision=auto: resolved by the device's native 16-bit support (mocked here, so the tests do not depend
on this host's CPU), printed at start, recorded in the checkpoint's config, kept on resume."""

import json

import pytest
import torch

from meshlm.core import precision as prec
from meshlm.core.precision import Precision, resolve_precision, resume_precision
from meshlm.models.loss import fused_head_wins, use_fused_loss
from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def cpu_has(monkeypatch):
    """cpu_has(*flags): the CPU reports these /proc/cpuinfo flags, and torch's probes say nothing."""

    def set_flags(*flags):
        monkeypatch.setattr(prec, "cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(prec, "_torch_says", lambda name: False)

    return set_flags


@pytest.mark.parametrize("flags, want, why", [
    (("avx2", "amx_bf16", "avx512_bf16"), "bf16", "AMX-BF16"),
    (("avx512f", "avx512_bf16"), "bf16", "AVX512-BF16"),
    (("avx512f", "avx2"), "fp32", "no native"),  # AVX-512 alone converts bf16: slower than fp32
    ((), "fp32", "no native"),
])
def test_auto_on_cpu_follows_the_bf16_instructions(cpu_has, flags, want, why):
    cpu_has(*flags)
    name, reason = resolve_precision("auto", CPU, hidden_size=768)
    assert name == want and why in reason


def test_auto_on_cpu_keeps_fp32_below_the_measured_width(cpu_has):
    cpu_has("amx_bf16")
    small = prec.CPU_BF16_MIN_HIDDEN // 2
    name, reason = resolve_precision("auto", CPU, hidden_size=small)
    assert name == "fp32" and f"model.hidden_size={small}" in reason
    assert resolve_precision("auto", CPU, hidden_size=prec.CPU_BF16_MIN_HIDDEN)[0] == "bf16"


def test_auto_on_cpu_without_proc_asks_torch(monkeypatch):
    monkeypatch.setattr(prec, "cpu_flags", lambda: frozenset())
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(prec, "_torch_says", lambda name: name == "_is_avx512_bf16_supported")
    assert resolve_precision("auto", CPU, 768) == ("bf16", "CPU AVX512-BF16")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # kernels without AVX-512
    assert resolve_precision("auto", CPU, 768)[0] == "fp32"


@pytest.mark.parametrize("bf16, want", [(True, "bf16"), (False, "fp16")])
def test_auto_on_cuda_is_bf16_where_supported_else_fp16(monkeypatch, bf16, want):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Test GPU")
    name, reason = resolve_precision("auto", CUDA, hidden_size=64)  # no width rule on a GPU
    assert name == want and "Test GPU" in reason


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_a_set_precision_is_kept(cpu_has, name):
    cpu_has()
    assert resolve_precision(name, CPU, 32) == (name, "set")


def test_precision_refuses_an_unresolved_name():
    with pytest.raises(ValueError, match="resolve_precision"):
        Precision("auto", CPU)


def test_resume_precision_reads_a_known_name_only():
    assert resume_precision({"train": {"precision": "bf16"}}) == "bf16"
    assert resume_precision({"train": {"precision": "auto"}}) is None
    assert resume_precision({}) is None and resume_precision(None) is None


def test_trainer_prints_records_and_resumes_the_resolution(cpu_has, monkeypatch, tmp_path, capsys):
    cpu_has("amx_bf16")
    monkeypatch.setattr(prec, "CPU_BF16_MIN_HIDDEN", 16)  # the tiny model (h = 32) counts as wide
    cfg = tiny_config(tmp_path, train={"precision": "auto", "max_steps": 2})
    trainer = Trainer(cfg)
    assert "precision: auto → bf16 (CPU AMX-BF16)" in capsys.readouterr().out
    assert trainer.precision.name == "bf16" and trainer.precision.dtype == torch.bfloat16
    assert trainer.cfg.train.precision == "bf16"
    trainer.run()
    saved = json.loads(next((tmp_path / "checkpoints").glob("step_*/config.json")).read_text())
    assert saved["train"]["precision"] == "bf16"  # the resolution, not "auto"

    cpu_has()  # the same run resumed on a host without bf16: it keeps the run's precision
    resumed = Trainer(tiny_config(tmp_path, train={"precision": "auto", "max_steps": 3}))
    out = capsys.readouterr().out
    assert resumed.step == 2 and resumed.precision.name == "bf16"
    assert "precision: auto → bf16 (as the resumed run step_" in out

    fresh = Trainer(tiny_config(tmp_path / "fresh", train={"precision": "auto", "max_steps": 3}))
    assert fresh.precision.name == "fp32"  # a new run on that host: fp32
    assert "precision: auto → fp32 (cpu: no native 16-bit matmul)" in capsys.readouterr().out


def test_an_explicit_precision_is_not_overridden_on_resume(cpu_has, tmp_path):
    cpu_has("amx_bf16")
    Trainer(tiny_config(tmp_path, train={"precision": "bf16", "max_steps": 1})).run()
    assert Trainer(tiny_config(tmp_path, train={"precision": "fp32", "max_steps": 2})).precision.name == "fp32"


def test_fused_loss_auto_resolves_by_shape_and_device(tmp_path):
    assert fused_head_wins(50257, 768, CUDA, torch.bfloat16)
    for h in (32, 128, 384, 768, 1024):  # chunks of ≥ 2h rows: measured faster than the unfused head
        assert fused_head_wins(50257, h, CPU, torch.float32)
    assert not fused_head_wins(10**7, 384, CPU, torch.float32)  # 512 MiB caps the chunk at 8 rows < 2h
    assert fused_head_wins(10**7, 384, CUDA, torch.float32)
    for setting in (True, False):
        assert use_fused_loss(tiny_config(tmp_path, train={"fused_loss": setting}), CPU) is setting
    cfg = tiny_config(tmp_path, train={"fused_loss": "auto"})
    m = cfg.model
    assert use_fused_loss(cfg, CPU) is fused_head_wins(m.vocab_size, m.hidden_size, CPU, torch.float32)
    assert Trainer(cfg).fused_loss is use_fused_loss(cfg, CPU)
