"""The files of a checkpoint, in any format: written with a checksum, published atomically, verified.

Layout: OUT_DIR/checkpoints/step_0000100/ holds the parts (one process: `model.pt`, `optim.pt`, `state.pt`;
a parallel run: `index.json`, `state.pt`, `shards/rank*.safetensors`, `shards/rank*.pt`, see
`sharded.py`), `config.json`, and, written last, `manifest.json`: every other file's relative
path, size and CRC-32 (zlib), computed while the bytes were written. OUT_DIR/checkpoints/latest names the
newest published checkpoint, but readers do not trust it alone: `find_valid` scans every `step_*`
directory, newest first, and takes the first that is usable: its manifest lists every file the checkpoint
needs (`required_files`, decided by the format and, for a parallel run, by its index, never by the
manifest's own list) and every file a reader loads that lies in it, the files match their entries, the
directory's name agrees with the manifest's step (a renamed copy is refused), and its weights are finite.
A `latest` that is a directory (a user's) is never replaced: it is left alone, with a warning.

Publishing: everything goes into `.tmp-step_N-*`, is fsynced, and the directory is renamed to `step_N`.
If `step_N` already exists (a re-save), it is first renamed aside (`.aside-step_N-*`), the new one renamed
into place, `latest` moved, and only then the old copy deleted; `find_valid` counts an aside copy as a
candidate too, so a crash at any moment leaves a complete checkpoint of the newest step findable.

This module is the low level both `single.py` (one process, "load any format") and `sharded.py`
(sharded) use; it imports neither.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import sys
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshlm.checkpoint.consistency import shapes_disagreement, step_disagreement
from meshlm.core.errors import CheckpointError, CheckpointWriteError

LATEST = "latest"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "meshlm-manifest-v1"
_STEP = re.compile(r"^(?:\.aside-)?step_(\d+)(?:-.*)?$")
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

Entry = dict[str, int]  # {"size": bytes, "crc32": checksum}


def checkpoints_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- writing ------------------------------------------------------------------------------------------------
class _ChecksumWriter(io.RawIOBase):
    """A write-only file that checksums and counts the bytes on their way to disk."""

    def __init__(self, fh):
        super().__init__()
        self.fh, self.size, self.crc = fh, 0, 0
        self.error: OSError | None = None

    def _disk_write(self, view: memoryview) -> None:
        self.fh.write(view)

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            self._disk_write(view)
        except OSError as err:  # torch.save would turn it into "[enforce fail at inline_container.cc]"
            self.error = err
            raise
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return len(view)


def write_file(path: Path, fill: Callable[[Any], None]) -> Entry:
    """Create `path`, let `fill(file)` write it, fsync; returns its size and CRC-32 (from the bytes written)."""
    out = None
    try:
        with open(path, "wb") as fh:
            out = _ChecksumWriter(fh)
            fill(out)
            fh.flush()
            os.fsync(fh.fileno())
    except (OSError, RuntimeError) as err:
        cause = out.error if out is not None and out.error is not None else err
        if isinstance(cause, OSError) and cause.filename is None:
            cause.filename = str(path)
        if cause is err:
            raise
        raise cause from err
    return {"size": out.size, "crc32": out.crc}


def save_torch(obj: Any, path: Path) -> Entry:
    return write_file(path, lambda fh: torch.save(obj, fh))


def save_bytes(data: bytes, path: Path) -> Entry:
    return write_file(path, lambda fh: fh.write(data))


def begin_checkpoint(out_dir: str | Path, step: int) -> Path:
    """A fresh temporary directory for step `step`'s files (several processes may write into it)."""
    root = checkpoints_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{step_name(step)}-"))


def publish_checkpoint(out_dir: str | Path, step: int, tmp: Path, config: dict, files: dict[str, Entry]) -> Path:
    """Add the config and the manifest (last), then move `tmp` into place and point `latest` at it. A
    published copy of the same step is replaced, never removed before its replacement is in place."""
    root = checkpoints_dir(out_dir)
    final = root / step_name(step)
    files = {**files, "config.json": save_bytes(json.dumps(config, indent=2).encode(), tmp / "config.json")}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": dict(sorted(files.items()))}
    save_bytes(json.dumps(manifest, indent=1).encode(), tmp / MANIFEST)
    fsync_dir(tmp)
    aside = None
    if final.exists():  # a re-save of the same step (resumed and stopped at once, a finished run rerun)
        aside = Path(tempfile.mkdtemp(dir=root, prefix=f".aside-{final.name}-"))
        os.rename(final, aside / "old")  # the aside directory's name carries the step, for `find_valid`
    os.rename(tmp, final)
    if latest_is_directory(root):  # a user's directory: never replaced (readers do not need `latest`)
        _warn_once(f"warning: {root / LATEST} is a directory, not the one-line pointer file meshlm writes; it is left "
                   f"as it is (checkpoints are found without it), {final.name} is published beside it")
    else:
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, root / LATEST)
    fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final


_warned: set[str] = set()


def _warn_once(text: str) -> None:
    if text.split(";")[0] not in _warned:
        _warned.add(text.split(";")[0])
        print(text, file=sys.stderr, flush=True)


def space_error(err: BaseException) -> bool:
    """Is `err` (an OSError, or torch.save's RuntimeError wrapping one) a full disk or quota?"""
    if isinstance(err, OSError):
        return err.errno in _SPACE_ERRNOS
    text = str(err)
    return isinstance(err, RuntimeError) and ("No space left" in text or "Disk quota" in text
                                              or ("inline_container.cc" in text and "write" in text))


def write_failure(err: BaseException, tmp: Path, step: int, need_bytes: int) -> CheckpointWriteError:
    """One line for the user: the file, the bytes needed, the fix. Removes the partial directory."""
    name = getattr(err, "filename", None) or "a checkpoint file"
    free = shutil.disk_usage(tmp.parent).free if tmp.parent.exists() else 0
    shutil.rmtree(tmp, ignore_errors=True)
    cause = "no space left on device" if space_error(err) else f"{type(err).__name__}: {err}".splitlines()[0]
    return CheckpointWriteError(
        f"could not write step {step}'s checkpoint ({cause}) at {name}: it needs about {need_bytes / 2**20:.1f} MiB, "
        f"{free / 2**20:.1f} MiB are free; free disk space or set train.out_dir to a larger disk (the partial "
        f"checkpoint was removed; the previous checkpoints are intact)")


def state_nbytes(obj: Any) -> int:
    """The bytes of the tensors in `obj` (nested dicts, lists): about what torch.save writes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(v) for v in obj)
    return 0


def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of floating-point tensors holding NaN or ±inf (one host sync for all of them)."""
    named = [(k, t) for k, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not named:
        return []
    flags = torch.stack([_nan_probe(t).to("cpu") for _, t in named]).isnan().tolist()
    return [k for (k, _), bad in zip(named, flags) if bad]


def _nan_probe(t: torch.Tensor) -> torch.Tensor:
    """0 if every element of `t` is finite, else NaN: NaN propagates to the minimum or maximum and ±inf is one of
    them, and x * 0 is 0 for finite x and NaN for NaN and ±inf. `aminmax` reads the tensor once without a
    temporary copy (15x faster than `t.mul(0).sum()` on a CPU core, and no tensor-sized allocation to fragment
    the heap while a checkpoint is saved)."""
    flat = t.detach().reshape(-1)
    return torch.stack(torch.aminmax(flat)).float().mul(0).sum() if flat.numel() \
        else torch.zeros((), device=t.device)


# ---- verifying and finding ---------------------------------------------------------------------------------
INDEX = "index.json"  # a parallel run's index of pieces (`sharded.py`)
SHARDS = "shards"
ONE_PROCESS_FILES = ("model.pt", "config.json")  # what every reader of a one-process checkpoint needs
RESUME_FILES = ("optim.pt", "state.pt")  # and what resuming its training reads too
SHARDED_FILES = (INDEX, "state.pt", "config.json")  # plus every shard the index names
LOADED_FILES = ("model.pt", "optim.pt", "state.pt", "config.json", "model.safetensors", INDEX)


class Problem(str):
    """What is wrong with a checkpoint, and the verdict a note gives it ("is incomplete", ...)."""

    verdict = "is incomplete"

    def __new__(cls, text: str, verdict: str | None = None):
        obj = super().__new__(cls, text)
        if verdict is not None:
            obj.verdict = verdict
        return obj


def read_manifest(path: Path) -> dict:
    """Checkpoint `path`'s manifest, its structure checked (a format, a step, a mapping of files)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{MANIFEST} missing") from None
    except (OSError, ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{MANIFEST} is not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{MANIFEST} is not a {MANIFEST_FORMAT} manifest")
    files = manifest.get("files")
    entry_ok = (lambda e: isinstance(e, dict) and all(type(e.get(k)) is int for k in ("size", "crc32")))
    if not isinstance(files, dict) or not all(isinstance(k, str) and entry_ok(e) for k, e in files.items()):
        raise CheckpointError(f"{MANIFEST} has no valid file list (each file's size and crc32)")
    if type(manifest.get("step")) is not int:
        raise CheckpointError(f"{MANIFEST} names no step")
    return manifest


def _index_shards(path: Path) -> list[str]:
    """The shard files a parallel run's index names: every rank's two files (the index records the world
    size), or, in an index from before that, each file holding pieces and its rank's state."""
    try:
        index = json.loads((path / INDEX).read_text())
        ranks = index.get("ranks")
        named = {str(chunk[0]) for chunk in index["chunks"]}
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError, AttributeError):
        raise CheckpointError(f"{INDEX} cannot be read") from None
    if isinstance(ranks, int) and ranks > 0:
        named |= {f"rank{r:05d}.safetensors" for r in range(ranks)}
    named |= {n.removesuffix(".safetensors") + ".pt" for n in named if n.endswith(".safetensors")}
    return [f"{SHARDS}/{n}" for n in sorted(named)]


def required_files(path: Path, listed: dict, resume: bool = False) -> list[str]:
    """The files checkpoint `path` needs, decided by its format, not by its manifest's list: a parallel
    run's index, state, config and every shard the index names; a one-process run's model and config, and
    for resuming its training also its optimizer and state."""
    if INDEX in listed or (path / INDEX).exists():
        return [*SHARDED_FILES, *_index_shards(path)]
    return [*ONE_PROCESS_FILES, *(RESUME_FILES if resume else ())]


def _unlisted(path: Path, listed: dict) -> str | None:
    """A file readers load that lies in the checkpoint but is not in its manifest."""
    present = [name for name in LOADED_FILES if (path / name).is_file()]
    if (path / SHARDS).is_dir():
        present += sorted(f"{SHARDS}/{f.name}" for f in (path / SHARDS).iterdir() if f.is_file())
    return next((name for name in present if name not in listed), None)


def _step_problem(path: Path, manifest: dict) -> Problem | None:
    """A step directory whose name, manifest and `state.pt` do not all name the same step (a renamed copy, an
    edited manifest or state: `consistency.step_disagreement`)."""
    m = _STEP.match(_label(path))
    found = step_disagreement(path, int(m.group(1)) if m else None, manifest["step"])
    return None if found is None else Problem(*found)


def verify(path: Path, checksum: bool = True, resume: bool = False) -> Problem | None:
    """None if checkpoint `path` is complete: its manifest lists every file the checkpoint needs
    (`required_files`) and every file readers load that lies in it, each matches its entry (sizes; CRC-32 too
    if `checksum`), and a step directory's name agrees with the manifest's step; else what is wrong, e.g.
    "model.pt: size 12 != 4096 in manifest"."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as err:
        return Problem(str(err))
    files = manifest["files"]
    for rel, entry in files.items():
        problem = _entry_problem(path / rel, rel, entry, checksum)
        if problem is not None:
            return Problem(problem)
    try:
        required = required_files(path, files, resume)
    except CheckpointError as err:
        return Problem(str(err))
    for rel in required:
        if rel not in files:
            return Problem(f"{rel} is not in {MANIFEST}" + ("" if (path / rel).exists() else f" ({rel} missing)"))
    extra = _unlisted(path, files)
    if extra is not None:
        return Problem(f"{extra} is not in {MANIFEST}")
    return _step_problem(path, manifest)


def _entry_problem(f: Path, rel: str, entry: Entry, checksum: bool) -> str | None:
    try:
        size = f.stat().st_size
    except OSError:
        return f"{rel} missing"
    if size != entry["size"]:
        return f"{rel}: size {size} != {entry['size']} in manifest"
    if checksum:
        crc = file_crc32(f)
        if crc != entry["crc32"]:
            return f"{rel}: checksum mismatch (CRC-32 {crc:08x} != {entry['crc32']:08x} in manifest)"
    return None


def weights_problem(path: Path) -> Problem | None:
    """None if the weights of checkpoint `path` (`model.pt`, `model.safetensors`, a parallel run's weight
    pieces) are all finite, else which file and tensor hold NaN or inf (or cannot be read)."""
    candidates_ = [path / "model.pt", path / "model.safetensors"]
    if (path / SHARDS).is_dir():
        candidates_ += sorted((path / SHARDS).glob("*.safetensors"))
    for f in candidates_:
        if not f.is_file():
            continue
        rel = f.relative_to(path).as_posix()
        try:
            bad = _non_finite_in(f)
        except CheckpointError as err:
            return Problem(str(err))
        if bad is not None:
            return Problem(f"{rel}: tensor {bad!r} holds NaN or inf; training or an edit damaged it",
                           "holds non-finite weights")
    return None


def _non_finite_in(f: Path) -> str | None:
    """The name of the first weight tensor of file `f` holding NaN or inf (a sharded piece by its logical
    tensor's name), or None."""
    if f.suffix == ".pt":
        state = load_torch(f)
        bad = non_finite(state) if isinstance(state, dict) else []
        return bad[0] if bad else None
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="pt") as fh:
            names = fh.keys()  # safe_open is not iterable
            for key in names:
                if f.parent.name == SHARDS and not key.startswith("weight/"):
                    continue  # optimizer states
                if non_finite({key: fh.get_tensor(key)}):
                    return key.split("/")[1] if key.startswith("weight/") else key
    except Exception as err:  # noqa: BLE001 (safetensors raises its own error types)
        raise CheckpointError(f"{f.name} cannot be read ({str(err).splitlines()[0] if str(err) else err!r})") from None
    return None


def file_crc32(path: Path, chunk: int = 1 << 22) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def candidates(root: Path) -> list[tuple[int, Path]]:
    """Published checkpoints (and copies set aside by an interrupted re-save) under checkpoints/, newest
    first; for one step, the published copy before an aside one."""
    found = []
    for p in root.iterdir() if root.is_dir() else ():
        m = _STEP.match(p.name)
        if m is None or not p.is_dir():
            continue
        if p.name.startswith(".aside-"):
            p = p / "old"
            if not p.is_dir():
                continue
        found.append((int(m.group(1)), p.parent.name.startswith(".aside-"), p))
    return [(step, p) for step, _, p in sorted(found, key=lambda x: (-x[0], x[1]))]


def latest_is_directory(root: Path) -> bool:
    """`checkpoints/latest` is a real directory (a user's), not the pointer file meshlm writes."""
    return (root / LATEST).is_dir() and not (root / LATEST).is_symlink()


def read_latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or "(empty)"
    except (OSError, UnicodeDecodeError):
        return None


def _label(path: Path) -> str:
    return path.parent.name if path.name == "old" else path.name


def usable(path: Path, checksum: bool = True, resume: bool = False, spec_of: Callable | None = None
           ) -> Problem | None:
    """`verify`, and with `checksum` (a full check, as before loading) the weights' finiteness too; with
    `spec_of` (family name → `ModelSpec`: checkpoint/ never looks one up) the weights' shapes against those
    the checkpoint's own config.json implies (`consistency.shapes_disagreement`)."""
    problem = verify(path, checksum, resume)
    if problem is None and checksum:
        problem = weights_problem(path)
    if problem is None and spec_of is not None:
        try:
            config = load_config_dict(path)
        except CheckpointError as err:
            return Problem(str(err))
        text = shapes_disagreement(path, config, spec_of)
        problem = None if text is None else Problem(text, "disagrees with its config.json")
    return problem


def find_valid(root: Path, checksum: bool = True, resume: bool = False, spec_of: Callable | None = None
               ) -> tuple[Path | None, str | None]:
    """The newest complete, verified checkpoint under `root` (a checkpoints/ directory), and a note saying
    what was passed over and why (None when `latest` names the one found and nothing was skipped), e.g.
    "checkpoints/latest names step_0000040, which is incomplete (model.pt: size 12 != 4096 in manifest)".
    `resume`: the files resuming training reads are needed too (`required_files`); `spec_of`: see `usable`."""
    latest = read_latest(root)
    bad: dict[str, Problem] = {}
    found = None
    for _, path in candidates(root):
        problem = usable(path, checksum, resume, spec_of)
        if problem is None:
            found = path
            break
        bad[_label(path)] = problem
    if (found is not None and latest == found.name and not bad) or (
            found is None and not bad and (latest is None or latest_is_directory(root))):
        return found, None
    notes = []
    if latest_is_directory(root):
        notes.append(f"{root.name}/{LATEST} is a directory, not the one-line pointer file meshlm writes; it is left "
                     "as it is and checkpoints are found without it (move it elsewhere to silence this note)")
    elif latest is None:
        notes.append(f"{root.name}/{LATEST} is missing")
    elif latest in bad:
        problem = bad.pop(latest)
        notes.append(f"{root.name}/{LATEST} names {latest}, which {problem.verdict} ({problem})")
    elif found is not None and latest == found.name:
        pass
    elif found is not None and (root / latest).is_dir():
        notes.append(f"{root.name}/{LATEST} names {latest}, but {_label(found)} is newer and complete")
    else:
        notes.append(f"{root.name}/{LATEST} names {latest!r}, which does not exist")
    notes += [f"{name} {problem.verdict} ({problem})" for name, problem in bad.items()]
    return found, "; ".join(notes)


def any_checkpoint(root: Path) -> bool:
    return ((root / LATEST).exists() and not latest_is_directory(root)) or bool(candidates(root))


def prune_temporaries(out_dir: str | Path) -> None:
    """Remove half-written temporaries left by a killed run; an aside copy whose step has no valid
    published copy is renamed back into place (never is a published checkpoint removed)."""
    root = checkpoints_dir(out_dir)
    if not root.exists():
        return
    for tmp in root.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    for aside in root.glob(".aside-*"):
        m = _STEP.match(aside.name)
        final = root / f"step_{m.group(1)}" if m else None
        if final is not None and (aside / "old").is_dir() and verify(final, checksum=False) is not None:
            if final.exists():
                shutil.rmtree(final)
            os.rename(aside / "old", final)
        shutil.rmtree(aside, ignore_errors=True)


def prune_old(out_dir: str | Path, keep_last: int, newest: int) -> list[Path]:
    """Keep the `keep_last` newest valid (size-checked) checkpoints up to step `newest`; delete the older
    ones (never one newer than `newest`, unless its name, manifest and state disagree about its step: it is
    no newer checkpoint, and resuming never takes it). Returns what was deleted."""
    if keep_last <= 0:
        return []
    kept, gone = 0, []
    found = candidates(checkpoints_dir(out_dir))
    for step, path in found:
        if step <= newest or path.name == "old":
            continue
        problem = verify(path, checksum=False)
        if problem is not None and problem.verdict == "disagrees about its step" and any(
                s <= newest and verify(p, checksum=False) is None for s, p in found):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    for step, path in found:
        if step > newest or path.name == "old":
            continue
        if kept < keep_last and verify(path, checksum=False) is None:
            kept += 1
            continue
        if kept >= 1:  # only once a newer valid one is kept
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


def load_torch(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """torch.load, with an unreadable (truncated, garbled, missing) file reported by name."""
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
    except Exception as err:  # noqa: BLE001 (torch.load raises RuntimeError, EOFError, UnpicklingError, ...)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path} cannot be read ({first}); the checkpoint is corrupt") from None


def load_config_dict(ckpt: Path) -> dict:
    """The run config saved in checkpoint directory `ckpt` (its config.json), as a dict."""
    try:
        return json.loads((Path(ckpt) / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{Path(ckpt) / 'config.json'} cannot be read ({err}); the checkpoint is "
                              "incomplete") from None
