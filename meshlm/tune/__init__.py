"""Adapting a frozen model: prompt tuning, p-tuning and LoRA (`meshlm tune`, docs/tune.md).

`adapters.py` applies an adapter to a (parallel) model as one more transform and freezes the base;
`lora.py` and `prompt.py` are the two kinds; `state.py` the tune run's checkpoints (trainable tensors only,
whole); `extension.py` all of it given to the trainer (`Tuning`, a `train.extension.Extension`); `data.py`
the tuning data; `export.py` the adapter's files (meshlm's and Hugging Face PEFT's) and putting an adapter
back onto a model; `command.py` the command (its parser: `meshlm/commands/tune.py`).

May import: core, data, models, families, parallel, checkpoint, train, interop.
"""
