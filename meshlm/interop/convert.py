"""`meshlm convert --checkpoint RUN --to-single OUT_DIR`: any checkpoint → one plain safetensors file.

A checkpoint of any layout (the single-process `model.pt`, or the per-rank pieces of a parallel run) is
assembled in one process, without torch.distributed, into the plain `GPT` state dict (fused `attn.qkv` and
`mlp.fc`, the vocabulary unpadded), and written as `OUT_DIR/model.safetensors` with the run's
`OUT_DIR/config.json`. Load it with `safetensors.torch.load_file` and `GPT.load_state_dict` (or
`checkpoint.load_model_state(OUT_DIR)`); `meshlm generate --checkpoint OUT_DIR` reads it too. A tied LM head is stored as its own
copy of the embedding (safetensors keeps no shared tensors).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from meshlm.config import ConfigError, check_output_dir

WEIGHTS = "model.safetensors"


def convert_to_single(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write the plain model of `checkpoint` (a run directory or a step directory) to OUT_DIR."""
    import torch  # here, not at the top: the CLI imports this module to build its parser
    from safetensors.torch import save_file

    from meshlm.train import checkpoint as ckpt

    source = ckpt.resolve_checkpoint(checkpoint)
    config = ckpt.load_config_dict(source)
    state = ckpt.load_model_state(source)  # any format: one process, a parallel run's pieces, converted
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in state.items()}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt", "source": str(source)})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out / WEIGHTS


def _convert(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"convert takes no config overrides (got {overrides[0]!r}); see meshlm convert -h")
    check_output_dir("--to-single", args.to_single)
    path = convert_to_single(args.checkpoint, args.to_single)
    print(f"wrote {path} and {path.parent / 'config.json'}")
    return 0


def add_convert_command(sub) -> None:
    """Register `meshlm convert` on the CLI's subparsers."""
    p = sub.add_parser("convert", help="write a checkpoint of any parallel layout as one plain safetensors file")
    p.add_argument("--checkpoint", required=True, help="run directory (its latest checkpoint) or a step directory")
    p.add_argument("--to-single", required=True, metavar="OUT_DIR",
                   help=f"directory for {WEIGHTS} (the plain GPT state dict) and config.json")
    p.set_defaults(func=_convert)
