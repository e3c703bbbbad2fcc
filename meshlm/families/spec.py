"""What a model family tells the rest of meshlm: one `ModelSpec` per family (`families/registry.py`).

`parallel/`, `train/`, checkpoints, conversion, `bench memory` and the CLI read a family only through
its spec; none names a family's attributes. A family's plain model class must offer this small protocol,
which the spec's plans refer to:

* `cfg` (its `ModelConfig`);
* `embed(ids)` → the residual stream (first pipeline stage), `run_layers(x, layer_ids)` → the stream after
  those layers (called with this stage's ids on a pruned model), `head(x)` → the output (logits) and,
  when `fused_loss`, `head_loss(x, targets)` → the mean loss without building the logits (last stage);
* `forward(ids)` = head(run_layers(embed(ids), all)), and `forward(ids, targets=y)` = the fused loss;
  with `stage_inputs` (BERT: the padding mask every layer needs) `run_layers(x, layer_ids, inputs=ids)`;
* `init_buffers(device)`: compute every buffer (GPT's RoPE tables) on `device` after a meta-device build;
  `parallel.materialize` only allocates buffers, so a buffer this does not fill would hold garbage;
* `init_seed`: the base seed it drew from the global generator when built (`models/init.py`);
* with `document_inputs` (packed documents, `data.document_mask`): `forward`, `embed` and `run_layers` take
  the keyword arguments it returns (GPT: `positions=`, `segments=`), which every pipeline stage gets.

The spec then says which submodules are tensor-parallel and how (`tp_plan`), which belong to the first
and last pipeline stage (`pipeline`), which methods of a layer selective recomputation wraps, how each
parameter starts (`init_rule`), how fused parameters split into layout-free checkpoint tensors
(`logical_blocks`), the loss, the dataset builder, and the FLOPs and activation
formulas the trainer logs and the planner uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshlm.core.config import ModelConfig


@dataclass(frozen=True)
class PipelinePlan:
    """How a family's model is cut into stages: `first` modules go with the first stage (embeddings),
    `last` with the last one (final norm, output layer), `layers` names the `nn.ModuleList` of layers that
    are split between stages."""

    first: tuple[str, ...]
    layers: str
    last: tuple[str, ...]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_class: type  # built as model_class(cfg: ModelConfig)
    tp_plan: Callable[[ModelConfig], dict]  # module pattern → parallel.styles style, applied in order
    check_tensor_parallel: Callable[[ModelConfig, int, bool], None]  # shape rules (ConfigError)
    pipeline: PipelinePlan
    selective_recompute: tuple[str, ...]  # method paths inside a layer that selective recomputation wraps
    init_rule: Callable[[str, tuple, ModelConfig], Any]  # (plain name, full shape, cfg) → models.init.InitRule
    logical_blocks: Callable[[str, ModelConfig], list[tuple[str, int]]]  # checkpoint tensors stacked in a param
    loss: Callable  # (output, targets) → mean loss, at tp = 1
    fused_loss: bool  # forward(ids, targets=y) / head_loss exist
    flops: Callable  # (cfg, batch, seq_len=None) → model FLOPs of a step on `batch` rows (default: model.seq_len)
    recompute_flops: Callable  # (cfg, batch, mode, seq_len=None, layers=) → extra forward FLOPs of recomputation
    stage_costs: Callable[[ModelConfig], tuple[float, float]]  # first/last stage extra work, in layers
    parameter_count: Callable[[ModelConfig], int]  # exact, from the config
    activation_bytes: Callable | None  # (Config, device_type=) → per-layer saved bytes (core/memory.py); None: none
    build_datasets: Callable  # (Config, progress=) → (tokenizer, train, valid)
    # Optional, for families whose loss is more than the token cross-entropy of `loss`:
    loss_for: Callable | None = None  # (ModelConfig, models.loss.TokenOps) → loss fn; tp>1 gets vocab-split ops
    stage_inputs: bool = False  # every pipeline stage's forward gets the batch's inputs too (`inputs=`)
    eval_metrics: Callable | None = None  # ({part name: mean}, mean loss) → the evaluation's reported metrics
    example_batch: Callable | None = None  # (cfg, micro_batch, torch.Generator) → random (inputs, targets); None: ids
    # Packed documents (`data.document_mask`): (ids (B, T), end-of-document id) → the model's keyword arguments
    # that keep attention and positions within each document; None: the family cannot (the trainer refuses).
    document_inputs: Callable | None = None
    decoder: bool = True  # generates text (`meshlm generate`, `train.sample_tokens`)
    # Adapters (`meshlm tune`, tune/): LoRA targets, name → (linear path pattern, rows of its weight or None),
    # and whether virtual tokens (prompt tuning, p-tuning) can go before the input (the model's `embed(ids, start)`).
    lora_targets: Callable | None = None  # (ModelConfig) → {target: (pattern, (lo, hi) | None)}
    virtual_tokens: bool = False  # the model has a `prompt` slot its `embed` runs (tune/prompt.py fills it)
    # What commands ask of a family (only families/ compares family names; the rest reads these):
    task_heads: bool = False  # fine-tunes with task heads: `meshlm finetune` (classify, span, tokens)
    sentence_embeddings: bool = False  # `meshlm embed`, sentence-transformers files on conversion
    default_tokenizer: str = "gpt2"  # the bundled tokenizer a checkpoint without tokenizer files gets
    special_tokens: Callable | None = None  # (ModelConfig) → names of special tokens its tokenizer must have
    peft_task_type: Callable | None = None  # (ModelConfig) → PEFT's task_type of an exported LoRA adapter
    hf_architecture: Callable | None = None  # (ModelConfig) → the Hugging Face architecture it converts to
    hf_table: Callable | None = None  # (ModelConfig) → [common.Entry]: each tensor's Hugging Face names
    hf_prefix: Callable = lambda cfg: ""  # (ModelConfig) → the prefix of the HF model's keys (BERT: 'bert.')


def family_loss(spec: ModelSpec, cfg: ModelConfig, ops=None) -> Callable:
    """The loss on the output of `spec`'s model with config `cfg`: `ops` are the per-token operations of
    the layout (None: whole logits, one process; `models.loss.TokenOps`)."""
    if spec.loss_for is not None:
        from meshlm.models.loss import TokenOps

        return spec.loss_for(cfg, ops or TokenOps())
    return spec.loss if ops is None else ops.ce
