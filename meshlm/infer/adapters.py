"""Several adapters over one base model in the inference engine, chosen per request (docs/serving.md).

* LoRA stays unmerged. Each targeted linear keeps every adapter's A and B (the `LoRA` modules of
  `tune/lora.py`, loaded by `apply_adapter(..., merge=False)` and then detached from the linear), and one
  forward hook adds, to the batch rows that asked for adapter i, (α/r) B_i A_i x of those rows: the same
  `LoRA.delta` that tuning trains with, on a gather of the rows (`index_select`, then `index_add` back).
  Rows of the base get nothing, so one copy of the base weights serves the base and every adapter in the
  same decode step. A LoRA request's row is its prompt alone, as tuning rows start (`Engine.head`).
* Prompt tuning and p-tuning (exported as its table): a request's row is prefilled with n placeholder
  positions before its prompt, and the token embedding's output at those positions is replaced by the
  adapter's virtual tokens (as `tune/prompt.py` does while tuning, before positions are added). Decoding
  needs nothing more: the cache holds the virtual tokens' keys and values.

Index 0 is the base; adapter k is `served[k - 1]`. The runner says, before each forward, which index each
row of the batch uses (`batch`); outside of it the hooks do nothing.

Runtime LoRA (`meshlm serve --allow-runtime-lora`, POST /v1/load_lora_adapter and /v1/unload_lora_adapter):
the engine keeps running while an adapter is added or removed, so nothing here may change the live model's
forward. `load` builds the adapter's LoRA modules on a shadow of the model (its module tree copied, every
weight shared), and the hooks are put on every linear when the set is made (`runtime=True`), so a load only
swaps in a new list of (index, LoRA) for a linear, which the engine's thread reads whole. An unloaded adapter
keeps its index as a tombstone (`removed`): indices are never reused, so neither a request nor a prefix-cache
block (hashed with its adapter index) can ever meet another adapter under an old index.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
from dataclasses import dataclass, field

import torch

from meshlm.core.config import ConfigError


@dataclass
class ServedAdapter:
    """One adapter as the server holds it."""

    name: str
    source: str
    method: str  # "lora" | "prompt"
    table: torch.Tensor | None = None  # prompt: (n, h), the virtual tokens' embeddings
    loras: list = field(default_factory=list)  # lora: its LoRA modules, one per targeted linear
    tensor_bytes: int = 0
    removed: bool = False  # unloaded at runtime: a tombstone that keeps its index

    @property
    def virtual_tokens(self) -> int:
        return 0 if self.table is None else int(self.table.shape[0])


class AdapterSet:
    """The adapters served over `model` (a plain one-process decoder), by name; index 0 is the base."""

    def __init__(self, model: torch.nn.Module, cfg, adapters: list[tuple[str, object]], runtime: bool = False):
        from meshlm.families.registry import get_spec

        self.model, self.cfg = model, cfg
        self.spec = get_spec(cfg.model.family)
        self.served: list[ServedAdapter] = []
        self.rows: dict[int, torch.Tensor | None] = {}  # adapter index → rows of this forward (None: all)
        self.virtual: tuple[torch.Tensor, torch.Tensor] | None = None  # this forward's (rows, virtual tokens)
        self._loras: dict[int, list[tuple[int, torch.nn.Module]]] = {}  # id(linear) → its (adapter index, LoRA)
        self._embedding_hooked = False
        self._hooked: set[int] = set()  # id(linear) of the linears that carry `_lora_hook`
        self.changing = threading.Lock()  # one runtime load or unload at a time
        if runtime:  # every linear hooked now: a runtime load never adds a hook to a module the engine runs
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    self._hook(module)
        for name, adapter in adapters:
            self._add(name, adapter)

    def __getstate__(self) -> dict:  # copied with its model (copy.deepcopy): a fresh lock, not this one
        return {k: v for k, v in self.__dict__.items() if k != "changing"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.changing = threading.Lock()

    def _hook(self, linear: torch.nn.Module) -> None:
        if id(linear) not in self._hooked:
            self._hooked.add(id(linear))
            linear.register_forward_hook(self._lora_hook)

    # ---- loading ----
    def _add(self, name: str, adapter) -> None:
        self._check_tensors(f"--adapter {name}", adapter)
        size = sum(t.numel() * t.element_size() for t in adapter.tensors.values())
        if adapter.tune.method == "lora":
            served = ServedAdapter(name, adapter.source, "lora", tensor_bytes=size)
            self._add_lora(served, adapter)
        else:
            served = ServedAdapter(name, adapter.source, "prompt", tensor_bytes=size)
            self._add_prompt(served, adapter)
        self.served.append(served)

    @torch.no_grad()
    def _add_lora(self, served: ServedAdapter, adapter) -> None:
        from meshlm.tune.export import apply_adapter
        from meshlm.tune.lora import detach_lora

        index = len(self.served) + 1
        if self.cfg.model.attention == "mla" and any(".kv_up." in name for name in adapter.tensors):
            raise ConfigError(f"--adapter {served.name}={served.source} adapts kv_b_proj (an MLA layer's kv_up), which "
                              "the engine's latent cache folds into the queries and cannot apply per request; merge "
                              "it into the checkpoint (meshlm convert --adapter) or train it without kv_b_proj")
        apply_adapter(self.model, self.cfg, adapter, merge=False)  # checks every tensor's name and shape
        for _, linear in list(self.model.named_modules()):
            lora = detach_lora(linear)  # detached: this adapter's update now runs only on its own rows
            if lora is None:
                continue
            lora.eval().requires_grad_(False)  # no dropout
            self._hook(linear)
            self._loras[id(linear)] = [*self._loras.get(id(linear), []), (index, lora)]
            served.loras.append(lora)

    def _add_prompt(self, served: ServedAdapter, adapter) -> None:
        table = adapter.tensors.get("prompt.table")
        hidden = self.cfg.model.hidden_size
        if table is None or table.dim() != 3 or table.shape[-1] != hidden:
            raise ConfigError(f"--adapter {served.name}={served.source}: its virtual-token table does not fit this "
                              f"model (hidden size {hidden})")
        if table.shape[0] > 1:
            raise ConfigError(f"--adapter {served.name}={served.source} holds prompts for {table.shape[0]} tasks ("
                              f"{', '.join(adapter.tasks)}); meshlm serve serves one-task prompt adapters")
        if not self.spec.virtual_tokens:
            raise ConfigError(f"--adapter {served.name}={served.source}: virtual tokens are not supported for "
                              f"model.family={self.cfg.model.family!r}")
        embedding = getattr(self.model, self.spec.pipeline.first[0])
        weight = embedding.weight
        served.table = table[0].float().to(weight.device)  # float32, as tune/prompt.py keeps them
        if not self._embedding_hooked:
            self._embedding_hooked = True
            embedding.register_forward_hook(self._embedding_hook)

    # ---- runtime loading (the engine runs meanwhile) ----
    def _check_tensors(self, name: str, adapter) -> None:
        extra = sorted(n for n in adapter.tensors if ".lora." not in n and n != "prompt.table")
        if extra:
            raise ConfigError(f"{name}={adapter.source} holds {extra[0]} besides its adapter (a new task "
                              "head); meshlm serve serves adapters over the base's own output layer only")

    def _shadow(self) -> torch.nn.Module:
        """The model's module tree copied with every parameter and buffer shared (nothing of the live model
        changes when LoRA modules are attached to the copy)."""
        memo = {id(t): t for t in [*self.model.parameters(), *self.model.buffers()]}
        memo[id(self)] = self  # the hooks are this set's bound methods
        return copy.deepcopy(self.model, memo)

    @torch.no_grad()
    def load(self, name: str, adapter) -> ServedAdapter:
        """Serve the LoRA `adapter` (a `tune.export.Adapter`, read with the base's fingerprint checked) as
        `name` from now on, without stopping the engine; ConfigError when it cannot be served (its new
        index is `len(self.served)`)."""
        from meshlm.tune.export import apply_adapter
        from meshlm.tune.lora import detach_lora

        if adapter.tune.method != "lora":
            raise ConfigError(f"adapter {name}={adapter.source} is a {adapter.tune.method!r} adapter; only LoRA loads "
                              "at runtime (serve prompt adapters with meshlm serve --adapter)")
        self._check_tensors(f"adapter {name}", adapter)
        with self.changing:
            if name in self.names:
                raise ConfigError(f"an adapter named {name!r} is already served; unload it first or pick another name")
            shadow = self._shadow()
            apply_adapter(shadow, self.cfg, adapter, merge=False)  # checks every tensor's name and shape
            live = dict(self.model.named_modules())
            index = len(self.served) + 1
            size = sum(t.numel() * t.element_size() for t in adapter.tensors.values())
            served = ServedAdapter(name, adapter.source, "lora", tensor_bytes=size)
            placed = []
            for path, linear in shadow.named_modules():
                lora = detach_lora(linear)
                if lora is None:
                    continue
                if id(live[path]) not in self._hooked:
                    raise ConfigError(f"adapter {name}={adapter.source} targets {path}, not a linear layer the "
                                      "server can run LoRA on at runtime; serve it with meshlm serve --adapter")
                placed.append((id(live[path]), lora.eval().requires_grad_(False)))
            for key, lora in placed:  # a new list, never one the engine's thread may be reading
                self._loras[key] = [*self._loras.get(key, []), (index, lora)]
                served.loras.append(lora)
            self.served.append(served)
        return served

    def retire(self, index: int) -> None:
        """Mark adapter `index` unloaded at once (a tombstone that keeps its index: `Server.check_model` no
        longer finds it); `unload` then drops its LoRA modules."""
        self.served[index - 1] = dataclasses.replace(self.served[index - 1], removed=True, loras=[], table=None)

    def unload(self, index: int) -> None:
        """Stop serving adapter `index` (no request may be using it: the server checks): retired, and its LoRA
        modules taken off the linears (new lists: the engine's thread may be reading the old ones)."""
        self.retire(index)
        with self.changing:
            for key, entries in list(self._loras.items()):
                self._loras[key] = [e for e in entries if e[0] != index]

    # ---- the forward ----
    def _lora_hook(self, linear, args, output: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return output
        x = args[0]
        for index, lora in self._loras.get(id(linear), ()):
            if index not in self.rows:
                continue
            rows = self.rows[index]
            if rows is None:  # every row of the batch
                output = output + lora.delta(x, output.shape[-1])
            else:
                output = output.index_add(0, rows, lora.delta(x.index_select(0, rows), output.shape[-1]))
        return output

    def _embedding_hook(self, embedding, args, output: torch.Tensor) -> torch.Tensor:
        if self.virtual is None:
            return output
        rows, vectors = self.virtual
        return output.index_copy(0, rows, vectors[:, None].to(output.dtype))  # output: (N, 1, h), a row a token

    @contextlib.contextmanager
    def batch(self, indices: list[int], virtual: list[tuple[int, int, int]] = ()):
        """Within: the model's forward runs row i of its batch (the engine's: one token a row) with adapter
        `indices[i]` (0: the base); `virtual`: (row, adapter, position) of the rows that hold a prompt adapter's
        virtual token (their embeddings are that adapter's `position`-th virtual token)."""
        used = sorted(set(indices))
        rows: dict[int, torch.Tensor | None] = {}
        for index in used:
            if index == 0 or self.served[index - 1].method != "lora":
                continue
            rows[index] = None if len(used) == 1 else torch.tensor(
                [i for i, k in enumerate(indices) if k == index], dtype=torch.long, device=self._device())
        placed = [(row, a, p) for row, a, p in virtual if a and self.served[a - 1].method == "prompt"]
        vectors = None
        if placed:
            at = torch.tensor([row for row, _, _ in placed], dtype=torch.long, device=self._device())
            vectors = (at, torch.stack([self.served[a - 1].table[p] for _, a, p in placed]))
        self.rows, self.virtual = rows, vectors
        try:
            yield
        finally:
            self.rows, self.virtual = {}, None

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- names ----
    def virtual_tokens(self, index: int) -> int:
        return self.served[index - 1].virtual_tokens if index else 0

    @property
    def names(self) -> list[str]:
        """The names of the adapters served now (not the unloaded ones)."""
        return [s.name for s in self.served if not s.removed]

    @property
    def tensor_bytes(self) -> int:
        return sum(s.tensor_bytes for s in self.served if not s.removed)


def parse_adapter_args(values: list[str], base_name: str) -> list[tuple[str, str]]:
    """`--adapter` values (NAME=DIR, or DIR named after its last component) → [(name, directory)];
    ConfigError for an empty name, two adapters of one name, or one named like the base."""
    import os

    out: list[tuple[str, str]] = []
    for value in values:
        name, sep, directory = value.partition("=")
        if not sep or os.sep in name or "/" in name:  # a plain directory (possibly with "=" further on)
            name, directory = os.path.basename(os.path.normpath(value)), value
        if not name or not directory:
            raise ConfigError(f"--adapter {value!r}: give NAME=DIR or DIR (the name then is DIR's last component)")
        if name == base_name:
            raise ConfigError(f"--adapter {value!r} would be named {name!r}, the base model's name; give it another "
                              f"with --adapter OTHER={directory} (or rename the base with --served-model-name)")
        taken = next((d for n, d in out if n == name), None)
        if taken is not None:
            raise ConfigError(f"--adapter {value!r}: two adapters are named {name!r} ({taken} and {directory}); name "
                              f"them apart with --adapter NAME=DIR")
        out.append((name, directory))
    return out

