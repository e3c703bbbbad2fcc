"""Adapters as one more transform over a parallel model (`parallel.parallelize`), after tensor parallelism.

`apply_adapters(model, spec, cfg, dims, rng)` adds what `cfg.tune` asks for (LoRA on the family's named
linears, or virtual tokens before the input) to this rank's part of the model, then freezes every
parameter of the base: only the adapter, and any parameter the base checkpoint does not have (a new task
head), train. Gradients, the optimizer, gradient synchronisation and the tune checkpoint then hold only
those (`trainable`); the base's weights stay bit-identical.

Adapter parameters carry `p.adapter = True`; the base's checkpoint machinery (`checkpoint/sharded.py`)
skips them, and `tune/state.py` saves them as whole tensors instead.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.core.config import Config, ConfigError


def is_adapter(p: torch.Tensor) -> bool:
    return bool(getattr(p, "adapter", False))


def _lora_blocks(spec, cfg: Config) -> dict[str, list]:
    """Linear path pattern → its LoRA blocks, from `tune.lora_targets`."""
    from meshlm.tune.lora import Block

    known = spec.lora_targets(cfg.model) if spec.lora_targets is not None else {}
    if not known:
        raise ConfigError(f"tune.method=lora: model.family={cfg.model.family!r} names no LoRA targets")
    out: dict[str, list] = {}
    for name in cfg.tune.lora_targets:
        if name not in known:
            m = cfg.model
            why = f"model.activation={m.activation!r}" if name in ("up", "gate", "fc") else \
                f"model.attention={m.attention!r}" + (f", model.q_lora_rank={m.q_lora_rank}" if m.attention == "mla"
                                                      and name.startswith("q_") else "")
            raise ConfigError(f"tune.lora_targets holds {name!r}, which this model does not have ({why}); choose "
                              f"from {', '.join(sorted(known))}")
        pattern, rows = known[name]
        out.setdefault(pattern, []).append((name, rows))
    blocks: dict[str, list] = {}
    for pattern, targets in out.items():
        ranges = []
        for name, rows in targets:
            lo, hi = rows if rows is not None else (0, None)
            ranges.append((name, lo, hi))
        whole = [n for n, _, hi in ranges if hi is None]
        if whole and len(ranges) > 1:
            others = [n for n, _, _ in ranges if n not in whole]
            raise ConfigError(f"tune.lora_targets names {whole[0]!r} and {others[0]!r}, which overlap ({whole[0]!r} is "
                              f"the whole linear {pattern}); keep one of them")
        blocks[pattern] = [Block(n, lo, hi if hi is not None else -1) for n, lo, hi in ranges]
    return blocks


def apply_lora(model: nn.Module, spec, cfg: Config, dims, rng) -> int:
    from meshlm.parallel.tensor import plan_targets
    from meshlm.tune.lora import Block, SharedRowsError, attach_lora

    t = cfg.tune
    count = 0
    for pattern, blocks in _lora_blocks(spec, cfg).items():
        for path in plan_targets(model, pattern):
            linear = model.get_submodule(path)
            full_out = getattr(linear, "full_out", linear.weight.shape[0])
            whole = [Block(b.name, b.lo, full_out if b.hi < 0 else b.hi) for b in blocks]
            try:
                attach_lora(linear, whole, t.lora_rank, t.lora_alpha, t.lora_dropout, path, cfg.train.seed, rng)
            except SharedRowsError as err:
                raise ConfigError(f"tune.lora_targets={t.lora_targets}: {err} rows are key/value heads held by several "
                                  f"ranks at parallel.tp={dims.tp} > model.n_kv_heads={cfg.model.kv_heads}; use tp <= "
                                  "n_kv_heads, or LoRA on q, o, up, gate, down") from None
            count += 1
    return count


def apply_prompt(model: nn.Module, spec, cfg: Config, dims) -> bool:
    """Virtual tokens on the rank that embeds the input (the first pipeline stage). Returns whether here."""
    from meshlm.tune.prompt import VirtualPrompt, attach_prompt

    if not spec.virtual_tokens:
        raise ConfigError(f"tune.method={cfg.tune.method!r} (virtual tokens) is not supported for model.family="
                          f"{cfg.model.family!r} yet; use tune.method=lora")
    name = spec.pipeline.first[0]
    embedding = getattr(model, name, None)
    if embedding is None or dims.pp_rank != 0:
        return False
    t, m = cfg.tune, cfg.model
    p = next(embedding.parameters())
    prompt = VirtualPrompt(t.method, max(1, len(t.tasks)), t.virtual_tokens, m.hidden_size, t.encoder,
                           t.encoder_hidden, cfg.train.seed, None, dims.tp_rank, cfg.parallel.sp, p.device,
                           torch.float32)
    attach_prompt(model, prompt)
    return True


def new_parameter_names(cfg: Config, spec) -> set[str]:
    """Plain parameters of this model (of family `spec`) that the base checkpoint lacks (a new task head):
    they train too."""
    from meshlm.checkpoint.load import open_checkpoint
    from meshlm.checkpoint.sharded import fused_blocks, logical_shapes, plain_shapes

    base = open_checkpoint(cfg.tune.base, log=None).config.model
    have = logical_shapes(base, spec=spec)
    mine = logical_shapes(cfg.model, spec=spec)
    missing = {n for n, shape in mine.items() if have.get(n) != shape}
    return {name for name in plain_shapes(cfg.model, spec=spec)
            if all(lname in missing for lname, _ in fused_blocks(name, cfg.model, spec=spec))}


def apply_adapters(model: nn.Module, spec, cfg: Config, dims, rng=None) -> None:
    """Add `cfg.tune`'s adapter to this rank's part of `model` and freeze the base (see the module doc)."""
    method = cfg.tune.method
    if method == "lora":
        apply_lora(model, spec, cfg, dims, rng)
    elif method in ("prompt", "ptuning"):
        apply_prompt(model, spec, cfg, dims)
    new = new_parameter_names(cfg, spec)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(p) or name in new)


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """This rank's trainable parameters by plain name (each tensor once)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def vocab_rows(cfg: Config, tokenizer, generator: torch.Generator) -> list[int]:
    """Token ids whose embeddings start a prompt-tuning table: `tune.prompt_init_text`'s tokens repeated
    (text), or ids drawn from the 5,000 first of the vocabulary (vocab; Lester et al. drew from the 5,000
    most frequent, and BPE vocabularies put frequent pieces first)."""
    t = cfg.tune
    n = t.virtual_tokens * max(1, len(t.tasks))
    if t.prompt_init == "text":
        ids = tokenizer.encode(t.prompt_init_text)
        if not ids:
            raise ConfigError(f"tune.prompt_init_text={t.prompt_init_text!r} has no tokens; give some words")
        return [ids[i % len(ids)] for i in range(n)]
    top = min(5000, tokenizer.vocab_size)
    return torch.randint(0, top, (n,), generator=generator).tolist()


@torch.no_grad()
def init_virtual_tokens(trainer) -> None:
    """A fresh prompt-tuning run: the table from the base's word embeddings (`tune.prompt_init`), read
    from the base checkpoint (the same rows whatever the layout)."""
    from meshlm.checkpoint.load import open_checkpoint
    from meshlm.checkpoint.sharded import open_source
    from meshlm.tune.lora import seeded

    cfg = trainer.cfg
    prompt = getattr(trainer.model, "prompt", None)
    if prompt is None or cfg.tune.method != "prompt" or cfg.tune.prompt_init == "random":
        return
    ids = vocab_rows(cfg, trainer.tokenizer, seeded(cfg.train.seed, "prompt.vocab"))
    base = open_checkpoint(cfg.tune.base, log=None)
    source = open_source(base.path, base.config.model, spec=trainer.spec)
    name = f"{trainer.spec.pipeline.first[0]}.weight"
    rows = torch.zeros(len(ids), cfg.model.hidden_size)
    try:
        for i, row in enumerate(ids):
            if source.read("weight", name, row, 0, rows[i:i + 1]) != cfg.model.hidden_size:
                raise ConfigError(f"tune.base={cfg.tune.base!r} holds no word embedding {name} to start the prompt "
                                  "from; set tune.prompt_init=random")
    finally:
        source.close()
    prompt.table.copy_(rows.view_as(prompt.table))


def describe_adapter(trainer) -> str:
    """One log line: the method, what trains, and how much of the model that is."""
    import torch.distributed as dist

    from meshlm.parallel.grads import sharded_row_masks

    t, dims = trainer.cfg.tune, trainer.dims
    split = sharded_row_masks(trainer.model)  # tp-split tensors: every tp rank holds a part
    counts = torch.tensor([0.0, 0.0], dtype=torch.float64)
    for p in trainer.model.parameters():
        if p.requires_grad and dims.dp_rank == 0 and (id(p) in split or dims.tp_rank == 0):
            counts[0 if is_adapter(p) else 1] += p.numel()
    if dims.world_size > 1:  # summed over tp parts and pp stages (one dp replica)
        counts = counts.to(dims.device)
        dist.all_reduce(counts)
    what = {"lora": f"LoRA r={t.lora_rank} α={t.lora_alpha:g} on {', '.join(t.lora_targets)}",
            "prompt": f"prompt tuning, {t.virtual_tokens} virtual tokens", "ptuning":
            f"p-tuning ({t.encoder} encoder), {t.virtual_tokens} virtual tokens"}[t.method]
    tasks = f" × {len(t.tasks)} tasks" if len(t.tasks) > 1 else ""
    adapter, heads = int(counts[0]), int(counts[1])
    extra = f" + {heads:,} of new heads" if heads else ""
    return (f"tune: {what}{tasks} on frozen {t.base}: {adapter:,} adapter parameters{extra} trainable "
            f"({100 * (adapter + heads) / trainer.n_params:.3f}% of the base's {trainer.n_params:,})")
