"""Shared by the server tests: tiny checkpoints written directly, and `meshlm serve` on a free loopback port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from tests.conftest import ROOT, meshlm_command, tiny_config

GPT_MODEL = {"n_layers": 2, "hidden_size": 64, "n_heads": 4, "seq_len": 64}
BERT_MODEL = {"family": "bert", "vocab_size": 30522, "n_layers": 2, "hidden_size": 32, "n_heads": 4, "seq_len": 32,
              "activation": "gelu_exact", "bert_head": "mlm", "norm_eps": 1e-12, "pooling": "mean",
              "normalize_embeddings": True}


def save_gpt_checkpoint(out: Path, seed: int = 0, **model) -> Path:
    """A randomly initialised tiny GPT-2-style checkpoint (gpt2 tokenizer), as `meshlm train` would save it."""
    from meshlm.checkpoint.single import save_checkpoint
    from meshlm.models.gpt import GPT

    cfg = tiny_config(out, model={**GPT_MODEL, **model})
    torch.manual_seed(seed)
    save_checkpoint(out, 1, {"model": GPT(cfg.model).state_dict()}, cfg.to_dict())
    return out


def save_bert_checkpoint(out: Path, seed: int = 0) -> Path:
    from meshlm.checkpoint.single import save_checkpoint
    from meshlm.families.registry import get_spec

    cfg = tiny_config(out, model=BERT_MODEL, data={"tokenizer": "bert"})
    torch.manual_seed(seed)
    save_checkpoint(out, 1, {"model": get_spec("bert").model_class(cfg.model).state_dict()}, cfg.to_dict())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body=None, headers: dict | None = None, raw: bytes | None = None,
         timeout: float = 60) -> tuple[int, dict, str]:
    """(status, headers, body text) of one request; HTTP errors are returned, not raised."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read().decode()


class ServeProcess:
    """`meshlm serve ARGS` on a free loopback port, waited for until /health answers."""

    def __init__(self, *args: str, api_key: str | None = None, prefix: list[str] | None = None,
                 deadline_s: float = 120):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [*(prefix or meshlm_command()), "serve", *args, "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={"OMP_NUM_THREADS": "1", **os.environ})
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        deadline = time.monotonic() + deadline_s
        while True:
            assert self.proc.poll() is None, f"meshlm serve exited: {''.join(self.stderr)[-3000:]}"
            assert time.monotonic() < deadline, f"meshlm serve did not start: {''.join(self.stderr)[-3000:]}"
            try:
                auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
                if http("GET", self.url + "/health", headers=auth, timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def python_prefix() -> list[str]:
    return [sys.executable, "-m", "meshlm"]
