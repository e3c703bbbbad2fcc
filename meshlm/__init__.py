"""meshlm: GPT and BERT training with Megatron-style parallelism on torch.distributed."""

__version__ = "0.1.0"
