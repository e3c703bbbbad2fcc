"""A tuned adapter on disk, and back onto a model: meshlm's own files and Hugging Face PEFT's.

At the end of `meshlm tune`, DIR (the run directory) gets, from its newest checkpoint:

* `adapter.json` + `adapter.safetensors`: meshlm's adapter, every trainable tensor whole under its
  meshlm name (a p-tuning encoder replaced by the table it produces: `prompt.table`, tasks × n × h),
  with the tune settings, the base's model config and a fingerprint of the base's weights files;
* `adapter_config.json` + `adapter_model.safetensors`: the same adapter in PEFT's format, for the base
  that `meshlm convert --to-hf` writes (LoRA on GPT-2, Llama and BERT encoders; a one-task prompt table
  as PEFT prompt tuning). meshlm's q/k/v targets on GPT-2's fused `c_attn` become one LoRA of rank
  (targets × r) whose B is block-diagonal, with PEFT's `rank_pattern`/`alpha_pattern` keeping α/r.

`load_adapter(model, cfg, DIR)` puts either kind (meshlm's, or a PEFT LoRA / prompt-tuning directory
written by `peft`) onto a plain model, after checking it was made for this base.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from meshlm.core.config import Config, ConfigError, TuneConfig, config_from_dict
from meshlm.core.errors import CheckpointError

META = "adapter.json"
WEIGHTS = "adapter.safetensors"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
FORMAT = "meshlm-adapter-v1"
PEFT_PREFIX = "base_model.model."


# ---- the base's identity ------------------------------------------------------------------------------------
def base_fingerprint(path: Path) -> str:
    """A short hash of the weights files of the base's verified step directory `path` (`Checkpoint.path`;
    their sizes and CRC-32s, from its manifest when it has one): an adapter records it, and loading it onto
    other weights is refused."""
    from meshlm.checkpoint.files import file_crc32, read_manifest

    try:
        files = read_manifest(path)["files"]
    except CheckpointError:  # a directory without a manifest (`meshlm convert --to-single`): read the files
        files = {p.name: {"size": p.stat().st_size, "crc32": file_crc32(p)}
                 for p in sorted(path.glob("model*")) if p.is_file()}
    weights = {k: v for k, v in files.items() if k.startswith(("model", "shards/")) or k == "index.json"}
    return hashlib.sha256(json.dumps(weights, sort_keys=True).encode()).hexdigest()[:16]


# ---- PEFT names ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HFModule:
    """A Hugging Face linear holding rows [lo, hi) of meshlm linear `path`."""

    name: str
    path: str
    lo: int
    hi: int


def hf_linears(cfg: Config) -> list[HFModule]:
    """The Hugging Face modules of every linear a LoRA target can sit on (the interop tables' weights)."""
    from meshlm.families.common import entry_rows
    from meshlm.families.registry import get_spec
    from meshlm.interop.hf_config import hf_architecture

    m = cfg.model
    arch = hf_architecture(m)
    spec = get_spec(m.family)
    table, prefix = spec.hf_table(m), spec.hf_prefix(m)
    out = []
    for entry in table:
        ours = entry.ours
        if not (ours.startswith("layers.") and ours.endswith(".weight")) or ".norm" in ours:
            continue
        path = ours[:-len(".weight")]
        theirs = [t[:-len(".weight")] for t in entry.theirs]
        sizes = [m.hidden_size] * 3 if arch == "bert" and len(theirs) == 3 else \
            entry_rows(m, entry) or [-1]
        lo = 0
        for name, n in zip(theirs, sizes):
            out.append(HFModule(prefix + name, path, lo, lo + n if n > 0 else -1))
            lo += max(n, 0)
    return out


def _blocks_by_path(cfg: Config) -> dict[str, list[tuple[str, int, int]]]:
    """meshlm linear path → [(target, lo, hi)] of the run's LoRA targets (hi −1: the whole linear)."""
    from meshlm.families.registry import get_spec

    known = get_spec(cfg.model.family).lora_targets(cfg.model)
    out: dict[str, list] = {}
    for path in {h.path for h in hf_linears(cfg)}:
        for target in cfg.tune.lora_targets:
            pattern, rows = known[target]
            if _match(path, pattern):
                lo, hi = rows if rows is not None else (0, -1)
                out.setdefault(path, []).append((target, lo, hi))
    return out


def _match(path: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(path, pattern)


def peft_lora(cfg: Config, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, adapter_model.safetensors tensors) of meshlm LoRA `tensors` (whole, by meshlm name)."""
    t = cfg.tune
    blocks = _blocks_by_path(cfg)
    out, targets, rank_pattern, alpha_pattern = {}, set(), {}, {}
    from meshlm.checkpoint.sharded import plain_shapes
    from meshlm.families.registry import get_spec

    spec = get_spec(cfg.model.family)
    for hf in hf_linears(cfg):
        mine = blocks.get(hf.path, [])
        rows = plain_shapes(cfg.model, spec=spec)[f"{hf.path}.weight"][0]  # the meshlm linear's whole output
        hi = hf.hi if hf.hi > 0 else rows
        inside = [(name, lo, b_hi if b_hi > 0 else rows) for name, lo, b_hi in mine
                  if lo >= hf.lo and (b_hi if b_hi > 0 else rows) <= hi]
        if not inside:
            continue
        if any(not (lo == hf.lo and b_hi == hi) for _, lo, b_hi in inside) or len(inside) > 1:
            # several meshlm targets inside one HF linear (q, v in GPT-2's c_attn): a block-diagonal LoRA
            a = torch.cat([tensors[f"{hf.path}.lora.A_{n}"] for n, _, _ in inside])
            b = torch.zeros(hi - hf.lo, len(inside) * t.lora_rank)
            for j, (n, lo, b_hi) in enumerate(inside):
                b[lo - hf.lo:b_hi - hf.lo, j * t.lora_rank:(j + 1) * t.lora_rank] = tensors[f"{hf.path}.lora.B_{n}"]
            rank_pattern[hf.name] = len(inside) * t.lora_rank
            alpha_pattern[hf.name] = len(inside) * t.lora_alpha
        else:
            n = inside[0][0]
            a, b = tensors[f"{hf.path}.lora.A_{n}"], tensors[f"{hf.path}.lora.B_{n}"]
        out[f"{PEFT_PREFIX}{hf.name}.lora_A.weight"] = a.float().contiguous()
        out[f"{PEFT_PREFIX}{hf.name}.lora_B.weight"] = b.float().contiguous()
        targets.add(hf.name.rsplit(".", 1)[1])
    from meshlm.interop.hf_config import hf_architecture

    arch_gpt2 = hf_architecture(cfg.model) == "gpt2"  # GPT-2's Conv1D holds its weights transposed
    config = {"peft_type": "LORA", "task_type": _task_type(cfg), "r": t.lora_rank, "lora_alpha": t.lora_alpha,
              "lora_dropout": t.lora_dropout, "target_modules": sorted(targets), "fan_in_fan_out": arch_gpt2,
              "bias": "none", "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "inference_mode": True,
              "base_model_name_or_path": None, "modules_to_save": None, "use_rslora": False}
    return config, out


def _task_type(cfg: Config) -> str:
    """PEFT's task_type of an adapter on this model (the family's `peft_task_type`)."""
    from meshlm.families.registry import get_spec

    task_type = get_spec(cfg.model.family).peft_task_type
    return task_type(cfg.model) if task_type is not None else "FEATURE_EXTRACTION"


def peft_prompt(cfg: Config, table: torch.Tensor) -> tuple[dict, dict[str, torch.Tensor]]:
    m = cfg.model
    config = {"peft_type": "PROMPT_TUNING", "task_type": _task_type(cfg), "num_virtual_tokens": table.shape[1],
              "token_dim": m.hidden_size, "num_transformer_submodules": 1, "num_attention_heads": m.n_heads,
              "num_layers": m.n_layers, "prompt_tuning_init": "RANDOM", "inference_mode": True,
              "base_model_name_or_path": None}
    return config, {"prompt_embeddings": table[0].float().contiguous()}


# ---- writing a run's adapter ----------------------------------------------------------------------------------
def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> None:
    from safetensors.torch import save_file

    _write_atomic(path, lambda p: save_file({k: v.contiguous() for k, v in tensors.items()}, str(p), metadata=meta))


def _write_json(path: Path, obj: dict) -> None:
    _write_atomic(path, lambda p: p.write_text(json.dumps(obj, indent=1) + "\n"))


def table_of(cfg: Config, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The (tasks, n, h) virtual-token table of a prompt or p-tuning adapter's tensors."""
    if cfg.tune.method == "prompt":
        return tensors["prompt.table"].float()
    from meshlm.tune.prompt import VirtualPrompt

    t = cfg.tune
    prompt = VirtualPrompt("ptuning", max(1, len(t.tasks)), t.virtual_tokens, cfg.model.hidden_size, t.encoder,
                           t.encoder_hidden, 0, None, 0, False, "cpu", torch.float32)
    prompt.load_state_dict({k.removeprefix("prompt."): v for k, v in tensors.items() if k.startswith("prompt.")})
    return prompt.export_table()


def export_run(out: str | Path) -> list[Path]:
    """Write DIR's adapter files from its newest checkpoint; returns the paths written."""
    from meshlm.checkpoint.files import load_config_dict, load_torch
    from meshlm.checkpoint.single import load_part, resolve_checkpoint

    out = Path(out)
    source = resolve_checkpoint(out, log=None)
    cfg = config_from_dict(load_config_dict(source))
    tensors = {k: v.detach().float().cpu() for k, v in load_torch(source / "model.pt").items()}
    t = cfg.tune
    mine = dict(tensors)
    if t.method in ("prompt", "ptuning"):
        table = table_of(cfg, tensors)
        mine = {k: v for k, v in tensors.items() if not k.startswith("prompt.")}
        mine["prompt.table"] = table
    heads = sorted(k for k in mine if ".lora." not in k and not k.startswith("prompt."))
    base = resolve_checkpoint(t.base, log=None)  # the run's base, as the run's config names it
    meta = {"format": FORMAT, "method": t.method, "base": t.base, "base_fingerprint": base_fingerprint(base),
            "step": load_part(source, "state")["step"], "tune": cfg.to_dict()["tune"],
            "model": cfg.to_dict()["model"], "tokenizer": cfg.data.tokenizer, "tasks": list(t.tasks),
            "heads": heads, "peft": None}
    written = []
    peft = None
    if heads:
        meta["peft"] = f"not written: PEFT's files here hold no new task heads ({', '.join(heads[:2])})"
    elif t.method == "lora":
        peft = peft_lora(cfg, tensors)
    elif len(t.tasks) <= 1:
        peft = peft_prompt(cfg, mine["prompt.table"])
    else:
        meta["peft"] = "not written: PEFT's prompt tuning holds one task's prompt; meshlm's files hold every task's"
    if peft is not None:
        _write_safetensors(out / PEFT_WEIGHTS, peft[1], {"format": "pt"})
        _write_json(out / PEFT_CONFIG, peft[0])
        written += [out / PEFT_CONFIG, out / PEFT_WEIGHTS]
        meta["peft"] = PEFT_CONFIG
    _write_safetensors(out / WEIGHTS, mine)
    _write_json(out / META, meta)
    return [out / META, out / WEIGHTS, *written]


# ---- reading an adapter back ----------------------------------------------------------------------------------
@dataclass
class Adapter:
    """An adapter ready to apply: its tune settings (method prompt or lora) and whole tensors by meshlm name."""

    tune: TuneConfig
    tensors: dict[str, torch.Tensor]
    tasks: list[str]
    source: str

    @property
    def virtual_tokens(self) -> int:
        return self.tune.virtual_tokens if self.tune.method == "prompt" else 0

    def task_index(self, task: str | None) -> int:
        if not self.tasks:
            if task:
                raise ConfigError(f"--task {task!r}: adapter {self.source} was tuned on one task, with no names")
            return 0
        if task is None:
            if len(self.tasks) > 1:
                raise ConfigError(f"adapter {self.source} holds prompts for tasks {', '.join(self.tasks)}; choose one "
                                  "with --task")
            return 0
        if task not in self.tasks:
            raise ConfigError(f"--task {task!r} is not one of adapter {self.source}'s tasks: {', '.join(self.tasks)}")
        return self.tasks.index(task)


def read_adapter(directory: str | Path, cfg: Config, base=None) -> Adapter:
    """The adapter in `directory` (meshlm's files, or PEFT's) for base model `cfg` (opened checkpoint `base`, a
    `checkpoint.load.Checkpoint`, whose weights' fingerprint is compared when given):
    ConfigError when it was made for another base (other shapes, or other weights by fingerprint)."""
    from safetensors.torch import load_file

    d = Path(directory)
    if not d.is_dir():
        raise ConfigError(f"--adapter {directory!r} is not a directory; give the --out of meshlm tune or a PEFT "
                          "adapter directory")
    if (d / META).exists():
        meta = json.loads((d / META).read_text())
        if meta.get("format") != FORMAT:
            raise ConfigError(f"{d / META} is not a {FORMAT} file")
        theirs = config_from_dict({"model": meta["model"]}).model
        if theirs != cfg.model:
            diff = [k for k in meta["model"] if getattr(theirs, k) != getattr(cfg.model, k)]
            raise ConfigError(f"--adapter {directory!r} was tuned on another base model (model.{diff[0]}="
                              f"{getattr(theirs, diff[0])!r}, this one has {getattr(cfg.model, diff[0])!r}); give the "
                              f"checkpoint it was tuned on ({meta['base']})")
        mine = base_fingerprint(base.path) if base is not None else None
        if mine is not None and mine != meta["base_fingerprint"]:
            raise ConfigError(f"--adapter {directory!r} was tuned on other weights than {base.given!r} (fingerprint "
                              f"{meta['base_fingerprint']}, this checkpoint's {mine}); give the "
                              f"checkpoint it was tuned on ({meta['base']})")
        tune = config_from_dict({"tune": meta["tune"]}).tune
        if tune.method == "ptuning":  # exported as its table: inference is prompt tuning
            tune = replace(tune, method="prompt")
        return Adapter(tune, load_file(str(d / WEIGHTS)), list(meta.get("tasks", [])), str(d))
    if (d / PEFT_CONFIG).exists():
        return import_peft(d, cfg)
    raise ConfigError(f"--adapter {directory!r} holds neither {META} (meshlm tune) nor {PEFT_CONFIG} (PEFT)")


def import_peft(d: Path, cfg: Config) -> Adapter:
    """A PEFT LoRA or prompt-tuning directory as a meshlm adapter for `cfg`'s model (converted by the same
    tables as `meshlm convert`)."""
    from safetensors.torch import load_file

    peft = json.loads((d / PEFT_CONFIG).read_text())
    kind = peft.get("peft_type")
    weights_file = d / PEFT_WEIGHTS
    if not weights_file.exists():
        raise ConfigError(f"{d} has {PEFT_CONFIG} but no {PEFT_WEIGHTS}")
    raw = {k.removeprefix(PEFT_PREFIX): v.float() for k, v in load_file(str(weights_file)).items()}
    if kind == "PROMPT_TUNING":
        table = raw.get("prompt_embeddings")
        if table is None or table.dim() != 2 or table.shape[1] != cfg.model.hidden_size:
            raise ConfigError(f"{d}: its prompt_embeddings do not fit this model (hidden size {cfg.model.hidden_size})")
        tune = TuneConfig(method="prompt", base="(peft)", virtual_tokens=table.shape[0])
        return Adapter(tune, {"prompt.table": table[None]}, [], str(d))
    if kind != "LORA":
        raise ConfigError(f"{d}: PEFT adapter type {kind!r} is not supported; meshlm reads LORA and PROMPT_TUNING")
    if peft.get("rank_pattern") or peft.get("alpha_pattern") or peft.get("use_dora"):
        raise ConfigError(f"{d}: rank_pattern, alpha_pattern and DoRA are not supported when reading a PEFT adapter")
    r, alpha = int(peft["r"]), float(peft["lora_alpha"])
    if peft.get("use_rslora"):
        alpha = alpha * r ** 0.5  # rsLoRA scales by α/√r: the same update with α' = α√r over r
    by_name = {h.name: h for h in hf_linears(cfg)}
    from meshlm.families.registry import get_spec

    known = get_spec(cfg.model.family).lora_targets(cfg.model)
    tensors, targets = {}, []
    for key, value in raw.items():
        module, _, rest = key.partition(".lora_")
        hf = by_name.get(module)
        if hf is None or rest not in ("A.weight", "B.weight"):
            raise ConfigError(f"{d}: {key} is not a LoRA matrix on a linear meshlm knows for this model")
        target = next((n for n, (pattern, rows) in known.items() if _match(hf.path, pattern) and (
            (rows is None and hf.lo == 0 and hf.hi < 0) or (rows is not None and rows == (hf.lo, hf.hi)))), None)
        if target is None:
            raise ConfigError(f"{d}: {module} has no meshlm LoRA target")
        if target not in targets:
            targets.append(target)
        tensors[f"{hf.path}.lora.{rest[0]}_{target}"] = value
    tune = TuneConfig(method="lora", base="(peft)", lora_rank=r, lora_alpha=alpha, lora_targets=targets)
    return Adapter(tune, tensors, [], str(d))


@torch.no_grad()
def apply_adapter(model: torch.nn.Module, cfg: Config, adapter: Adapter, merge: bool = True) -> torch.nn.Module:
    """Put `adapter` onto a plain (one-process) model: LoRA merged into the weights (or kept as an
    unmerged update with `merge=False`), virtual tokens attached; new heads' weights copied in."""
    from meshlm.families.registry import get_spec
    from meshlm.tune.adapters import apply_lora, apply_prompt

    spec = get_spec(cfg.model.family)
    run_cfg = replace(cfg, tune=adapter.tune)
    dims = SimpleNamespace(pp_rank=0, tp_rank=0, tp=1)
    if adapter.tune.method == "lora":
        apply_lora(model, spec, run_cfg, dims, None)
    else:
        apply_prompt(model, spec, replace(run_cfg, tune=replace(adapter.tune, tasks=adapter.tasks)), dims)
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if getattr(p, "adapter", False) and n not in adapter.tensors]
    unknown = [n for n in adapter.tensors if n not in params]
    if missing or unknown:
        raise ConfigError(f"adapter {adapter.source} does not fit this model: "
                          + (f"it lacks {missing[0]}" if missing else f"this model has no {unknown[0]}"))
    for name, value in adapter.tensors.items():
        if params[name].shape != value.shape:
            raise ConfigError(f"adapter {adapter.source}: {name} has shape {tuple(value.shape)}, this model's "
                              f"{tuple(params[name].shape)}; it was made for another base")
        params[name].copy_(value.to(params[name].dtype))
    if merge and adapter.tune.method == "lora":
        from meshlm.tune.lora import merge_lora

        for module in list(model.modules()):
            if hasattr(module, "lora") and hasattr(module, "_lora_hook"):
                merge_lora(module)
    return model
