"""Mixed precision from one key, `train.precision`: fp32, bf16 (autocast), fp16 (autocast + dynamic loss
scaling). Parameters and optimizer states stay fp32 (master weights); autocast casts per op."""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, precision: str, device: torch.device):
        self.name, self.device = precision, device
        self.dtype = DTYPES[precision]
        # fp16 needs a loss scale so small gradients don't flush to zero; bf16 has fp32's range.
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def autocast(self):
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler.is_enabled() else {}

    def load_state_dict(self, state: dict) -> None:
        if state and self.scaler.is_enabled():
            self.scaler.load_state_dict(state)
