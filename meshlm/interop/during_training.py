"""Hugging Face directories written during training (`train.save_hf`), from the checkpoints it publishes.

    train.save_hf = "end"                             the run's last checkpoint
    train.save_hf = "every", train.save_hf_every = N  the checkpoints of steps N, 2N, ... and the last one

Each one becomes `OUT_DIR/hf_checkpoints/step_XXXXXXX/` (config.json, safetensors weights, tokenizer files:
what `meshlm convert --to-hf` writes), and `OUT_DIR/hf_checkpoints/latest` is a symbolic link to the newest,
so `AutoModelForCausalLM.from_pretrained("OUT_DIR/hf_checkpoints/latest")` loads it.

The conversion starts from the checkpoint on disk once it is published (`Extension.published`), so it
reads the same files under any layout (a tp x pp x dp run's per-rank pieces): rank 0 alone reads them,
one tensor at a time, and writes the weights tensor by tensor (`hf_stream.py`); the other ranks do
nothing, and no collective is involved. The directory is written beside its final name and renamed into
place (a re-save of the same step replaces it), so a crash leaves no half-written directory, only a
hidden `.tmp-*` one, removed by the next run's first conversion.

With `train.async_save` the conversion runs in a background thread of rank 0 while training goes on, one
at a time: the next conversion, and the end of the run, wait for it. The checkpoint's files are first
hard-linked into a hidden folder (where the file system allows), so pruning it (`train.keep_last`) does
not pull the files from under the reader. Without async_save it runs at once, on the main thread.

A model Hugging Face cannot hold (another family, switches GPT-2 or Llama lack), or a `meshlm tune` run
(its checkpoints hold an adapter), is refused before training starts. A conversion that fails later
(disk full) is one warning line, and the run goes on: its checkpoint is intact, and
`meshlm convert --checkpoint CKPT --to-hf DIR` writes the directory from it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

from meshlm.core.config import Config, ConfigError
from meshlm.train.extension import Extension

HF_CHECKPOINTS = "hf_checkpoints"
LATEST = "latest"


def check_save_hf(cfg: Config) -> None:
    """ConfigError, one line, when `cfg` sets train.save_hf for a run whose checkpoints cannot be written
    as Hugging Face directories."""
    from meshlm.interop.hf_config import hf_config_dict

    key = f"train.save_hf={cfg.train.save_hf!r}"
    if cfg.tune.method != "none":
        raise ConfigError(f"{key}: a meshlm tune run's checkpoints hold its adapter, not a whole model; drop "
                          "train.save_hf (merge the adapter and convert the result with meshlm convert --to-hf)")
    try:
        hf_config_dict(cfg.model)
    except ConfigError as err:
        raise ConfigError(f"{key}: this model cannot be written as Hugging Face: {err}; or set train.save_hf=''"
                          ) from None


def hf_extensions(cfg: Config) -> list[Extension]:
    """[HFCheckpoints(cfg)] when `cfg` sets train.save_hf (checked: `check_save_hf`), else []."""
    if not cfg.train.save_hf:
        return []
    check_save_hf(cfg)
    return [HFCheckpoints(cfg)]


class HFCheckpoints(Extension):
    """`train.save_hf`: a Hugging Face directory from each published checkpoint it asks for (module doc)."""

    implements = ("train.save_hf",)

    def __init__(self, cfg: Config):
        t = cfg.train
        self.mode, self.every, self.background = t.save_hf, t.save_hf_every, t.async_save
        self.worker: threading.Thread | None = None
        self.lines: list[str] = []  # what the worker has to say, logged by the main thread
        self.tokenizer_files: dict[str, bytes] | None = None  # written once, copied after (GPT-2's take seconds)
        self.pruned = False

    def published(self, trainer, path: Path) -> None:
        if not trainer.dims.is_main:
            return
        path = Path(path)
        step = int(path.name.removeprefix("step_"))
        last = step == trainer.step and (step >= trainer.cfg.train.max_steps or trainer.stop_signal is not None)
        if not last and not (self.mode == "every" and step % self.every == 0):
            return
        self.wait(trainer)  # one conversion at a time
        root = Path(trainer.out_dir) / HF_CHECKPOINTS
        if not self.pruned:
            _prune_temporaries(root)
            self.pruned = True
        if not self.background:
            self._convert(path, path, root, step)
            self._flush(trainer)
            return
        weights = _linked_copy(path, root)
        self.worker = threading.Thread(target=self._convert, args=(path, weights, root, step), daemon=False,
                                       name="meshlm-save-hf")
        self.worker.start()
        if last:
            self.wait(trainer)

    def wait(self, trainer) -> None:
        """Wait for the conversion in flight, if any, and log what it said."""
        if self.worker is not None:
            self.worker.join()
            self.worker = None
        self._flush(trainer)

    def _flush(self, trainer) -> None:
        lines, self.lines = self.lines, []
        for line in lines:
            trainer.log(line)

    def _convert(self, path: Path, weights: Path, root: Path, step: int) -> None:
        """Write `root/step_XXXXXXX` from checkpoint `path` (its files read from `weights`); file work only."""
        from meshlm.checkpoint.files import load_config_dict
        from meshlm.core.config import config_from_dict
        from meshlm.interop.convert import write_hf_dir

        try:
            config = config_from_dict(load_config_dict(path))
            target = publish_dir(root, path.name, lambda tmp: write_hf_dir(
                path, config, tmp, self.lines.append, weights=weights, tokenizer=self._tokenizer(config)))
            self.lines.append(f"wrote Hugging Face directory {target}")
        except Exception as err:  # noqa: BLE001 (any failure is reported; the checkpoint itself is intact)
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            self.lines.append(f"warning: train.save_hf: step {step} was not written as a Hugging Face directory "
                              f"({type(err).__name__}: {first}); the checkpoint is intact: meshlm convert "
                              f"--checkpoint {path} --to-hf DIR writes it")
        finally:
            if weights != path:
                shutil.rmtree(weights, ignore_errors=True)

    def _tokenizer(self, config: Config):
        """The tokenizer files' writer: the first conversion writes them, the next ones copy those bytes."""
        from meshlm.interop.hf_files import write_tokenizer_files

        def write(directory: Path) -> None:
            if self.tokenizer_files is None:
                names = write_tokenizer_files(config.data.tokenizer, directory, config.model.seq_len, self.lines.append)
                self.tokenizer_files = {name: (directory / name).read_bytes() for name in names}
                return
            for name, data in self.tokenizer_files.items():
                (directory / name).write_bytes(data)

        return write


def publish_dir(root: Path, name: str, write) -> Path:
    """Run `write(tmp)` on a hidden temporary directory in `root`, rename it to `root/name` (replacing a
    directory of that name once the new one is complete), then point `root/latest` at it."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{name}-"))
    try:
        tmp.chmod(0o755)  # mkdtemp's is 0o700: the directory is for others to read too
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = root / name
    aside = None
    if final.exists():
        aside = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-old-{name}-"))
        os.rename(final, aside / name)
    os.rename(tmp, final)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    link = root / f".{LATEST}.tmp"
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(name, link)
    os.replace(link, root / LATEST)
    return final


def _linked_copy(path: Path, root: Path) -> Path:
    """Hard links to checkpoint `path`'s files in a hidden folder of `root` (so that pruning the checkpoint
    leaves them readable); `path` itself where the file system has no hard links."""
    root.mkdir(parents=True, exist_ok=True)
    copy = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-source-{path.name}-"))
    try:
        for f in sorted(path.rglob("*")):
            target = copy / f.relative_to(path)
            if f.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(f, target)
    except OSError:
        shutil.rmtree(copy, ignore_errors=True)
        return path
    return copy


def _prune_temporaries(root: Path) -> None:
    """Remove what a conversion that died left (hidden `.tmp-*` directories)."""
    if root.is_dir():
        for leftover in root.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
