"""`meshlm serve --engine-process`: the engine in a process of its own, as vLLM runs its engine core.

In one process the HTTP server's event loop and the engine's loop share an interpreter, so every streamed chunk
the server writes (about 45 µs of Python a token) holds the lock the engine's step also needs between its
kernels: at 64 streamed clients that is about 3 ms of each step (docs/serving.md, "The engine in a process of
its own"). Here the engine runs in a child process (started with `spawn`: it loads the checkpoint itself, as
`build_server` would, and never shares an OpenMP pool with its parent) and the server talks to it through one
pipe:

- **The server's side, `EngineClient`**, answers for the engine (what `Server` and the routes use of it). A
  request is checked where it arrives, against the child's `Limits` (context, vocabulary, pool, the queue's
  room and each client's share of it), numbered, and sent; no round trip. The requests the child has not yet
  scheduled count as the waiting queue. A reader thread takes each step's message: for every request that
  changed, its new tokens, the text past what was safe to stream last time, its finish; and the engine's
  counters. It applies them to the server's copy of each request (a `Request`), then calls its `on_update`,
  as the engine's thread does in one process.
- **The child** runs the engine's loop thread as usual; its main thread reads the pipe (submit, cancel,
  stop). Each request's `on_update` only marks it changed; `Engine.on_step` sends the step's changes as one
  message.
- **Ends.** `stop` (the server's drain) asks the child to finish what it holds and waits for it. The child
  ignores SIGINT (a Ctrl-C reaches the whole process group; the server drains it) and exits when the pipe
  closes: a server killed outright leaves no engine behind. An engine that dies (its process killed, its
  loop failed) fails every request in flight with its reason, and `alive` turns false (/health: 503).

`meshlm serve` runs it so wherever it can (`wants_engine_process`). Adapters given at start (`--adapter`) are
loaded by the child with the checkpoint; the server's side keeps their names, sources and virtual-token counts
(`_Adapters`), which is all the routes read of them. Not yet with adapters loaded at run time
(`--allow-runtime-lora`: its routes change the engine's adapter set under the server's lock), tensor or
pipeline parallelism (their rank 0 already runs the engine beside the workers) or an encoder, which serve in one
process (asked for with `--engine-process`, a ConfigError at start). `build_server` keeps the engine in its
caller's process unless asked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace

from meshlm.core.config import ConfigError
from meshlm.infer.engine import EngineDead, InvalidRequest, Limits, QueueFull
from meshlm.infer.guided import Recipe
from meshlm.infer.request import Request

UNBOUNDED_QUEUE = 1 << 30  # the child's own queue bound: the server's side holds the real one


def wants_engine_process(asked: bool | None, tp: int, pp: int, runtime_lora: bool, decoder: bool,
                         given: str) -> bool:
    """Whether the engine runs in a process of its own: `asked` True (`--engine-process`), or None (`meshlm
    serve`'s default) wherever it can, that is one process's decoder without adapters loaded at run time.
    ConfigError, before anything is loaded, when it was asked for what it does not serve."""
    refused = [(tp > 1 or pp > 1, "--parallel.tp / --parallel.pp (rank 0 runs the engine beside the workers)"),
               (runtime_lora, "--allow-runtime-lora"),
               (not decoder, f"an encoder (BERT) checkpoint: {given} serves embeddings in one process")]
    why = next((flag for given_flag, flag in refused if given_flag), None)
    if asked and why is not None:
        raise ConfigError(f"--engine-process serves one process's decoder without run-time adapters, not {why}; drop "
                          "--engine-process (the engine then stays in the server's process)")
    return bool(asked or asked is None) and why is None


# ---- the server's side -------------------------------------------------------------------------------------------
class _Adapters:
    """The child's adapters given at start, as the server reads an `AdapterSet` (`infer/adapters.py`): `served`,
    each with its name, source, method and virtual tokens; none is ever removed (no run-time adapters here)."""

    def __init__(self, described: list[tuple[str, str, str, int]]):
        self.served = [SimpleNamespace(name=name, source=source, method=method, virtual_tokens=n, removed=False)
                       for name, source, method, n in described]


class _Histogram:
    """The child's histogram as of its last message (`engine.Histogram.snapshot`'s answer)."""

    def __init__(self, value):
        self.value = value

    def snapshot(self):
        return self.value


class EngineClient:
    """The engine of a child process, seen from the server (see the module docstring). `launch` starts one."""

    def __init__(self, process, conn, info: dict, max_queue: int):
        self.process, self.conn = process, conn
        self.limits: Limits = dataclasses.replace(info["limits"], max_queue=max_queue)
        self.max_len, self.max_queue = self.limits.max_len, max_queue
        self.model = SimpleNamespace(cfg=info["model_config"])  # routes read model.cfg (vocab_size)
        self.adapters = _Adapters(info["adapters"]) if info["adapters"] else None
        runner = info["runner"]
        self.runner = SimpleNamespace(compile_s=runner["compile_s"], cache_bytes=lambda: runner["cache_bytes"],
                                      cache_bytes_per_token=lambda: runner["cache_bytes_per_token"])
        self.pool = SimpleNamespace(num_blocks=self.limits.num_blocks, block_size=self.limits.block_size, used=0,
                                    stats={"evictions": 0})
        local = info["local_blocks"]
        self.local_pool = SimpleNamespace(num_blocks=local, used=0) if local else None
        self.stats = dict(info["stats"])
        self.ttft, self.tpot = (_Histogram(h) for h in info["histograms"])
        self.queue_length = self.running = 0
        self.lock = threading.Lock()  # the requests below
        self.send_lock = threading.Lock()  # the pipe's sending end (never taken while waiting on `lock`)
        self.requests: dict[int, Request] = {}  # not finished, by id
        self.waiting: dict[int, Request] = {}  # sent, not yet in a step of the child's
        self.next_id = 0
        self.stopping = False
        self.dead: str | None = None
        self.thread = threading.Thread(target=self._read, name="meshlm-engine-reader", daemon=True)
        self.thread.start()

    @classmethod
    def launch(cls, builder, build: dict, max_queue: int, start_timeout: float | None = None) -> EngineClient:
        """Start the child, which calls `builder(**build, max_queue=...)` (`server.build_server`, sent by
        reference, its engine in the child's own process) for the server whose engine it keeps; wait until it is built (a checkpoint loaded, a step compiled: minutes at worst) and return its
        client; ConfigError for what the child refused, RuntimeError when it died.

        The child is a fresh interpreter (`python -m meshlm.infer.engine_process`, the pipe's end passed as a
        file descriptor), not a fork: a forked process would inherit this one's OpenMP threads, and
        multiprocessing's `spawn` would run the caller's main script again."""
        mine, theirs = multiprocessing.Pipe()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding this meshlm, installed or not
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        process = subprocess.Popen([sys.executable, "-m", "meshlm.infer.engine_process", str(theirs.fileno())],
                                   pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        failed = RuntimeError("the engine process exited while loading the checkpoint (see the log above)")
        try:
            mine.send_bytes(pickle.dumps((builder, build), pickle.HIGHEST_PROTOCOL))
            deadline = None if start_timeout is None else time.monotonic() + start_timeout
            while not mine.poll(1.0):
                if process.poll() is not None:
                    raise failed
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"the engine process was not ready in {start_timeout:.0f} s")
            message = pickle.loads(mine.recv_bytes())
        except (EOFError, OSError):
            message = None
        except BaseException:
            process.kill()
            process.wait()
            raise
        if message is None or message[0] == "failed":
            process.wait(10)
            if message is None:
                raise failed
            _, kind, text = message
            raise (ConfigError if kind == "ConfigError" else RuntimeError)(text)
        return cls(process, mine, message[1], max_queue)

    # ---- what the server calls ----
    def head(self, adapter: int) -> list[int]:
        """As `Engine.head`: a prompt adapter's virtual-token placeholders (the child lays out the same)."""
        n = len(self.adapters.served) if self.adapters is not None else 0
        if not 0 <= adapter <= n:
            raise InvalidRequest(f"adapter index {adapter} is not one of this engine's (0..{n})", "model")
        return [0] * (self.adapters.served[adapter - 1].virtual_tokens if adapter else 0)

    def submit_group(self, items, on_update=None, adapter: int = 0, client: str | None = None) -> list[Request]:
        """As `Engine.submit_group`, checked here; the requests are sent to the child without waiting."""
        head = len(self.head(adapter))
        self.limits.check_group(len(items), client)
        for ids, sp in items:
            self.limits.check(ids, sp, head)
        with self.lock:
            if self.dead is not None:
                raise EngineDead(self.dead)
            if self.stopping:
                raise QueueFull("the server is shutting down")
            self.limits.check_room([r.client for r in self.waiting.values()], len(items), client)
            reqs = []
            for ids, sp in items:
                req = Request(list(ids), sp, on_update, id=self.next_id, adapter=adapter, client=client)
                self.next_id += 1
                self.requests[req.id] = self.waiting[req.id] = req
                reqs.append(req)
        # sent outside `lock`: a full pipe never holds up the reader thread (which frees the child to read it)
        try:
            self._send(("submit", [(r.id, r.prompt_ids, r.params) for r in reqs], adapter, client))
        except OSError:  # the child is gone; the reader thread says why to the others
            with self.lock:
                for r in reqs:
                    self.requests.pop(r.id, None)
                    self.waiting.pop(r.id, None)
            raise EngineDead(self.dead or "the engine process has exited") from None
        return reqs

    def cancel(self, req: Request) -> None:
        req.cancelled = True
        with self.lock:
            live = req.id in self.requests and self.dead is None
        if live:
            with contextlib.suppress(OSError):  # the child is gone: the reader fails the request
                self._send(("cancel", req.id))

    @property
    def alive(self) -> bool:
        return self.dead is None and self.process.poll() is None

    def stop(self, timeout: float | None = None) -> None:
        """Take no new requests; let the child finish the ones it holds (their last messages are read), then
        end it."""
        with self.lock:
            self.stopping = True
            live = self.dead is None
        if live:
            with contextlib.suppress(OSError):
                self._send(("stop",))
        self.thread.join(timeout)
        try:
            self.process.wait(5 if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _send(self, message) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.conn.send_bytes(data)

    # ---- the reader thread ----
    def _read(self) -> None:
        reason = None
        try:
            while True:
                try:
                    message = pickle.loads(self.conn.recv_bytes())
                except (EOFError, OSError):
                    break
                if message[0] == "steps":
                    self._apply(message[1], message[2])
                elif message[0] == "stopped":
                    break
        except BaseException as err:  # noqa: BLE001 -- this thread ends: its requests must not wait forever
            traceback.print_exc()
            reason = f"the server lost its engine's messages ({type(err).__name__}: {err})"
        with self.lock:
            if self.dead is None and (self.requests or not self.stopping or reason):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(1)
                code = self.process.poll()
                self.dead = reason or ("the engine process exited" + (f" with code {code}" if code is not None
                                                                       else ""))
            stranded = list(self.requests.values())
            self.requests.clear()
            self.waiting.clear()
        for req in stranded:
            req.error, req.finish_reason = self.dead or "the engine stopped", "error"
            req.emitted = len(req.text)
            self._notify(req)

    def _apply(self, changes: list, state: tuple) -> None:
        """One step's message: the engine's counters first (a client that sees its request finished reads them
        after), then each request's change, then each owner's `on_update`."""
        (stats, self.queue_length, self.running, self.pool.used, evictions, local_used, self.ttft.value,
         self.tpot.value, dead) = state
        self.stats.update(stats)
        self.pool.stats["evictions"] = evictions
        if self.local_pool is not None:
            self.local_pool.used = local_used
        changed = []
        with self.lock:
            for (rid, tokens, prompt_tokens, text_from, text, emitted, reason, error, first, finished) in changes:
                req = self.requests.get(rid)
                if req is None:
                    continue
                self.waiting.pop(rid, None)
                if tokens:
                    req.output.extend(tokens)
                    req.output_ids.extend(t.id for t in tokens)
                req.prompt_tokens.extend(prompt_tokens)
                req.text = req.text[:text_from] + text
                req.emitted, req.first_token_at, req.error = emitted, first, error
                if reason is not None:
                    req.finished_at, req.finish_reason = finished, reason
                    del self.requests[rid]
                changed.append(req)
            if dead is not None and self.dead is None:
                self.dead = dead
        for req in changed:
            self._notify(req)

    @staticmethod
    def _notify(req: Request) -> None:
        if req.finished:
            req.done_event.set()
        if req.on_update is not None:
            try:
                req.on_update(req)
            except Exception:  # noqa: BLE001 -- one owner's failure is not the others'
                traceback.print_exc()


# ---- the child ---------------------------------------------------------------------------------------------------
class _Child:
    """The engine's side of the pipe (see the module docstring)."""

    def __init__(self, conn, engine):
        self.conn, self.engine = conn, engine
        self.send_lock = threading.Lock()
        self.changed: dict[Request, None] = {}  # requests changed since the last message, in order
        self.sent: dict[Request, list[int]] = {}  # per request: tokens, prompt tokens, text characters sent
        self.by_id: dict[int, Request] = {}
        engine.on_step = self.flush

    def changed_one(self, req: Request) -> None:
        self.changed[req] = None  # (the engine's thread)

    def flush(self) -> None:
        """Send the changes of the requests that changed since the last call, with the engine's counters (the
        engine's thread, after a step)."""
        if not self.changed:
            return
        changes = []
        for req in list(self.changed):
            n_out, n_prompt, text_from = self.sent.setdefault(req, [0, 0, 0])
            changes.append((req.tag, req.output[n_out:], req.prompt_tokens[n_prompt:], text_from,
                            req.text[text_from:], req.emitted, req.finish_reason, req.error, req.first_token_at,
                            req.finished_at))
            if req.finished:
                self.sent.pop(req, None)
                self.by_id.pop(req.tag, None)
            else:  # the text before `emitted` no longer changes (a stop string, a split character: after it)
                self.sent[req] = [len(req.output), len(req.prompt_tokens), req.emitted]
        self.changed.clear()
        self.send(("steps", changes, self._state()))

    def send(self, message) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.conn.send_bytes(data)

    def serve(self) -> bool:
        """Read the server's messages until it asks to stop (drain, say so, return True) or goes away (return
        False: nobody reads what is left)."""
        eng = self.engine
        while True:
            try:
                message = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return False
            if message[0] == "submit":
                _, items, adapter, client = message
                try:
                    for _, _, sp in items:  # a guide comes as its recipe: compiled here (cached per format)
                        if isinstance(sp.guide, Recipe):
                            sp.guide = sp.guide.compile(eng.tokenizer, eng.model.cfg.vocab_size)
                    reqs = eng.submit_group([(ids, sp) for _, ids, sp in items], self.changed_one, adapter, client,
                                            tags=[rid for rid, _, _ in items])
                    self.by_id.update((r.tag, r) for r in reqs)
                except Exception as err:  # noqa: BLE001 -- checked by the server first: a dead engine, at worst
                    error = f"{type(err).__name__}: {err}"
                    now = time.monotonic()
                    self.send(("steps", [(rid, [], [], 0, "", 0, "error", error, None, now) for rid, _, _ in items],
                               self._state()))
            elif message[0] == "cancel":
                req = self.by_id.get(message[1])
                if req is not None:
                    eng.cancel(req)
            elif message[0] == "stop":
                eng.stop()  # drained: the loop sent its last step's changes before it ended
                self.send(("stopped",))
                return True

    def _state(self) -> tuple:
        eng = self.engine
        local = eng.local_pool.used if eng.local_pool is not None else 0
        return (eng.stats, len(eng.waiting), len(eng.active), eng.pool.used, eng.pool.stats["evictions"], local,
                eng.ttft.snapshot(), eng.tpot.snapshot(), eng.dead)


def child_main(fd: int) -> None:
    """The engine process (on the pipe's end `fd`): build the engine, say what the server needs, run the loop,
    read the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains on Ctrl-C and tells us
    conn = Connection(fd)
    try:
        builder, build = pickle.loads(conn.recv_bytes())  # `builder` unpickled by name: server.build_server
    except (EOFError, OSError):
        return  # the server went away before saying what to load
    try:
        server = builder(**build, max_queue=UNBOUNDED_QUEUE)
    except BaseException as err:  # noqa: BLE001 -- told to the server, which raises it at start
        if not isinstance(err, ConfigError):
            traceback.print_exc()
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps(("failed", type(err).__name__, str(err))))
        return
    engine = server.engine
    runner = engine.runner
    child = _Child(conn, engine)
    info = {"limits": engine.limits, "model_config": engine.model.cfg, "stats": dict(engine.stats),
            "histograms": (engine.ttft.snapshot(), engine.tpot.snapshot()),
            "local_blocks": engine.local_pool.num_blocks if engine.local_pool is not None else 0,
            "adapters": [(a.name, a.source, a.method, a.virtual_tokens) for a in server.adapters],
            "runner": {"compile_s": getattr(runner, "compile_s", 0.0), "cache_bytes": runner.cache_bytes(),
                       "cache_bytes_per_token": runner.cache_bytes_per_token()}}
    try:
        conn.send_bytes(pickle.dumps(("ready", info), pickle.HIGHEST_PROTOCOL))
    except OSError:
        return
    engine.start()
    drained = child.serve()
    sys.stderr.flush()
    if not drained:  # the server went away mid-step: end now, not after the loop's next step
        os._exit(0)


if __name__ == "__main__":
    from meshlm.infer.engine_process import child_main as main  # the package's module, not this __main__ copy

    main(int(sys.argv[1]))
