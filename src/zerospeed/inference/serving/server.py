"""``serve()``: an engine, its engine thread and a uvicorn server, behind a handle that stops them.

Decisions:

* uvicorn runs in a thread of its own with its own event loop, for the Python API and the command
  alike. uvicorn installs signal handlers only in the main thread, so it installs none here: the
  command line owns SIGTERM/SIGINT and calls :meth:`ServerHandle.stop`, which lets the process exit
  with status 0 after a graceful shutdown (uvicorn would re-raise the signal).
* The listening socket is bound here, before uvicorn starts, so a port in use is a clear error at
  once and ``port=0`` (any free port) tells the caller which port it got.
* Shutdown order: uvicorn stops accepting and waits up to ``shutdown_timeout`` seconds for
  in-flight requests to finish (the engine keeps generating for them meanwhile), cancels the rest
  (which aborts their engine requests), then the engine thread stops, then a tensor-parallel
  engine releases its worker ranks (``engine.shutdown()``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from zerospeed.inference.serving.app import ServerState, build_app
from zerospeed.inference.serving.chat_template import ChatTemplate, tokenizer_info
from zerospeed.inference.serving.engine_loop import EngineLoop
from zerospeed.inference.serving.text import TokenizerAdapter

log = logging.getLogger("zerospeed.serve")

DEFAULT_MAX_WAITING = 1024
ENGINE_KEYS = ("dtype", "block_size", "num_blocks", "kv_cache_memory", "max_num_seqs",
               "max_model_len", "max_num_batched_tokens", "tensor_parallel",
               "max_prefill_tokens_with_decodes", "prefill_first", "max_decode_kv_bytes", "greedy_head",
               "cpu_kernels", "packed_linear")


class ServeError(ValueError):
    """A bad argument to :func:`serve` or the ``zerospeed serve`` command (names it)."""


class ServerHandle:
    """A running server: ``url``, ``port``, ``model_name``, ``engine``; ``stop()`` shuts it down
    gracefully (also on leaving a ``with`` block); ``wait()`` blocks until it has stopped."""

    def __init__(self, server: Any, thread: threading.Thread, engine_loop: EngineLoop,
                 engine: Any, host: str, port: int, model_name: str) -> None:
        self._server = server
        self._thread = thread
        self.engine_loop = engine_loop
        self.engine = engine
        self.host = host
        self.port = port
        self.model_name = model_name
        self._stopped = False
        self._stop_lock = threading.Lock()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def is_running(self) -> bool:
        return self._thread.is_alive() and self.engine_loop.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the HTTP server stopped; True when it did within ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish (cancelled after ``timeout`` seconds,
        default the server's ``shutdown_timeout``), then stop the engine. Idempotent."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        grace = self._server.config.timeout_graceful_shutdown if timeout is None else timeout
        self._server.config.timeout_graceful_shutdown = grace
        self._server.should_exit = True
        self._thread.join((grace or 0) + 10.0)
        if self._thread.is_alive():  # uvicorn did not finish: cut the connections
            self._server.force_exit = True
            self._thread.join(5.0)
        self.engine_loop.stop()
        shutdown = getattr(self.engine, "shutdown", None)
        if callable(shutdown):
            shutdown()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise ServeError(f"port: must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeError(f"host: cannot resolve {host!r} ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # no Nagle delay: a response goes out as its headers and then its body (and a stream chunk by
    # chunk); with Nagle the second write waited for the client's delayed ACK, ~40 ms on every
    # request over loopback. Accepted connections inherit the option from this socket.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServeError(f"port: {host}:{port} is already in use") from None
        raise ServeError(f"host/port: cannot listen on {host}:{port} ({e.strerror})") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def serve(model_dir: str | os.PathLike | None = None, *, engine: Any = None,
          host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, max_waiting: int = DEFAULT_MAX_WAITING,
          shutdown_timeout: float = 30.0, log_level: str = "warning",
          **engine_kwargs: Any) -> ServerHandle:
    """Serve ``model_dir`` (an HF model folder) over an OpenAI-compatible HTTP API and return a
    :class:`ServerHandle` once it accepts connections.

    ``engine_kwargs`` go to ``build_engine`` (``dtype``, ``block_size``, ``num_blocks``,
    ``kv_cache_memory``, ``max_num_seqs``, ``max_model_len``, ``max_num_batched_tokens``,
    ``max_prefill_tokens_with_decodes``, ``prefill_first``, ``max_decode_kv_bytes``, ``greedy_head``,
    ``cpu_kernels``, ``packed_linear``). An
    already built ``engine`` (an object with the :mod:`zerospeed.inference.api` interface) may be
    given instead; ``model_dir`` then only supplies the chat template.
    """
    unknown = sorted(set(engine_kwargs) - set(ENGINE_KEYS))
    if unknown:
        raise ServeError(f"{unknown[0]}: not an argument of serve() (engine arguments: "
                         f"{', '.join(ENGINE_KEYS)})")
    if max_waiting < 1:  # every new request waits for a step: 0 would refuse them all
        raise ServeError(f"max_waiting: must be at least 1, got {max_waiting}")
    if shutdown_timeout < 0:
        raise ServeError(f"shutdown_timeout: must be at least 0, got {shutdown_timeout}")
    if model_dir is not None and not Path(model_dir).is_dir():
        raise ServeError(f"model_dir: no such folder: {model_dir}")
    if engine is None:
        if model_dir is None:
            raise ServeError("model_dir: required (or pass engine=)")
        from zerospeed.inference.build import build_engine

        engine = build_engine(str(model_dir), **engine_kwargs)
    elif engine_kwargs:
        raise ServeError(f"{next(iter(engine_kwargs))}: engine arguments need model_dir, not engine=")

    import uvicorn

    template = ChatTemplate.from_model_dir(model_dir)
    name = served_model_name or getattr(engine, "model_name", None) or (
        Path(model_dir).name if model_dir else "zerospeed")
    sock = _bind(host, port)
    engine_loop = EngineLoop(engine, max_waiting)
    state = ServerState(
        engine_loop=engine_loop, tokenizer=TokenizerAdapter(engine.tokenizer),
        chat_template=template, model_name=name, max_model_len=int(engine.max_model_len),
        api_key=api_key, created=int(time.time()),
        tokenizer_info=tokenizer_info(model_dir, template, int(engine.max_model_len))
        if getattr(engine, "tokenizer", None) is not None else None)
    config = uvicorn.Config(build_app(state), log_level=log_level, access_log=False,
                            lifespan="off", timeout_graceful_shutdown=shutdown_timeout,
                            timeout_keep_alive=30)
    server = uvicorn.Server(config)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        except BaseException as e:  # noqa: BLE001 - reported by serve() or the handle
            failure.append(e)
            log.exception("the HTTP server failed")
        finally:
            sock.close()

    engine_loop.start()
    thread = threading.Thread(target=run, name="zerospeed-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            engine_loop.stop()
            raise ServeError(f"host/port: the HTTP server did not start: {failure[0] if failure else 'unknown'}")
        time.sleep(0.01)
    bound_port = sock.getsockname()[1]
    return ServerHandle(server, thread, engine_loop, engine, host, bound_port, name)
