"""``zerospeed serve MODEL_DIR [flags]``: the command line of the OpenAI-compatible server.

Decisions:

* The launcher (``zerospeed.launcher.runner``) dispatches here when its first argument is
  ``serve``; everything about serving stays in this package.
* Bad flags exit with status 2 and one ``zerospeed serve: error:`` line naming the flag; a model
  folder the engine cannot load exits with 1 and the engine's message.
* When the server is up it prints one line ``zerospeed serve: listening on URL (model NAME)`` on
  stdout, so scripts and tests started with ``--port 0`` learn the port.
* SIGTERM and SIGINT shut down gracefully (in-flight requests finish within
  ``--shutdown-timeout`` seconds, then are cancelled) and the process exits with status 0.
* ``--tensor-parallel N`` starts N ranks through the launcher's torchrun machinery; see
  :mod:`zerospeed.inference.serving.tensor_parallel`.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import threading
from collections.abc import Sequence

EXIT_USAGE = 2
# the values of the fast-path switches (zerospeed.ops.fast_paths.PATHS, whose import would load torch
# before a usage error could be printed; a test keeps the two equal)
GREEDY_HEADS = ("auto", "float32", "bf16", "int8")
CPU_KERNELS = ("auto", "off", "on")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


class _UsageError(Exception):
    pass


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: expected an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name}: must be at least 1, got {value}")
        return value
    return parse


def _non_negative(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: expected an integer, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{name}: must be at least 0, got {value}")
        return value
    return parse


def _prefill_cap(text: str) -> int | str:
    """``--max-prefill-tokens-with-decodes``: a positive integer, or ``none`` (no cap)."""
    if text.strip().lower() == "none":
        return "none"
    return _positive("--max-prefill-tokens-with-decodes")(text)


def _decode_kv(text: str) -> int | str:
    """``--max-decode-kv-bytes``: ``auto``, ``none`` or bytes with an optional unit suffix."""
    t = text.strip().lower()
    if t in ("auto", "none"):
        return t
    try:
        return _memory(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"--max-decode-kv-bytes: expected auto, none or bytes like 64MiB, got {text!r}") from None


def _memory(text: str) -> int:
    """Bytes, with an optional K/M/G/KiB/MiB/GiB suffix."""
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "kib": 2**10, "mib": 2**20, "gib": 2**30}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    try:
        value = float(num) * units[t[len(num):]]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"--kv-cache-memory: expected bytes like 2GiB or 500M, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--kv-cache-memory: must be positive, got {text!r}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zerospeed serve", allow_abbrev=False,
                description="Serve a model folder over an OpenAI-compatible HTTP API.")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="HF model folder (config.json, "
                   "safetensors, tokenizer.json, tokenizer_config.json with a chat template)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_non_negative("--port"), default=8000,
                   help="port (default 8000; 0 picks a free one, printed at start)")
    p.add_argument("--tensor-parallel", "--tensor-parallel-size", "-tp", dest="tensor_parallel",
                   type=_positive("--tensor-parallel"), default=1,
                   help="ranks the model is split over (started through torchrun)")
    p.add_argument("--max-num-seqs", type=_positive("--max-num-seqs"), default=None,
                   help="most sequences in one ragged batch")
    p.add_argument("--max-model-len", type=_positive("--max-model-len"), default=None,
                   help="context length (default: the model's)")
    p.add_argument("--max-num-batched-tokens", type=_positive("--max-num-batched-tokens"),
                   default=None, help="token budget of one forward")
    p.add_argument("--block-size", type=_positive("--block-size"), default=None,
                   help="tokens per KV-cache block")
    p.add_argument("--max-prefill-tokens-with-decodes", type=_prefill_cap, default=None,
                   help="prompt tokens joining a forward while sequences decode (default 16): lower "
                        "for steadier inter-token latency, 'none' for throughput")
    p.add_argument("--max-decode-kv-bytes", type=_decode_kv, default=None,
                   help="K/V bytes the running sequences may hold at their longest (default auto: "
                        "0.75x the weight bytes a decode step reads), like 64MiB, or 'none'")
    p.add_argument("--no-prefill-first", dest="prefill_first", action="store_false", default=None,
                   help="let the first prompts of a burst decode while the rest are prefilled")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--num-blocks", type=_positive("--num-blocks"), default=None,
                    help="KV-cache blocks")
    kv.add_argument("--kv-cache-memory", type=_memory, default=None,
                    help="KV-cache bytes (e.g. 2GiB)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="weights and activations dtype (default fp32)")
    p.add_argument("--greedy-head", choices=GREEDY_HEADS, default=None,
                   help="how greedy rows get their tokens on CPU in fp32: float32 logits, or a bf16 / int8 copy "
                        "of the LM head refined to the same tokens; auto (default) times them here")
    p.add_argument("--cpu-kernels", choices=CPU_KERNELS, default=None,
                   help="zerospeed's C kernels on CPU in fp32: on, off (plain torch), or auto (default: each "
                        "kernel where it builds and was timed faster than torch)")
    p.add_argument("--packed-linear", choices=CPU_KERNELS, default=None,
                   help="fp32 linears and LM head on CPU through oneDNN on weights packed once: on, off, or auto "
                        "(default: per shape where it was timed faster than the plain GEMM)")
    p.add_argument("--api-key", default=os.environ.get("ZEROSPEED_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default $ZEROSPEED_API_KEY)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients use (default: the folder's name)")
    p.add_argument("--max-waiting", type=_positive("--max-waiting"), default=None,
                   help="requests allowed to wait for a slot; more get 429 (default 1024)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish on SIGTERM (default 30)")
    p.add_argument("--weight-update-group", default=None, metavar="HOST:PORT",
                   help="accept weight updates from a trainer (engine.sync_weights) over a gloo process group "
                        "whose TCP store this server hosts at HOST:PORT (issue #32)")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    return p


def engine_kwargs(args: argparse.Namespace) -> dict:
    keys = ("dtype", "block_size", "num_blocks", "kv_cache_memory", "max_num_seqs",
            "max_model_len", "max_num_batched_tokens", "max_prefill_tokens_with_decodes", "prefill_first",
            "max_decode_kv_bytes", "greedy_head", "cpu_kernels", "packed_linear")
    kwargs = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    for key in ("max_prefill_tokens_with_decodes", "max_decode_kv_bytes"):
        if kwargs.get(key) == "none":
            kwargs[key] = None
    return kwargs


def _error(message: str, status: int) -> int:
    print(f"zerospeed serve: error: {message}", file=sys.stderr, flush=True)
    return status


def run_server(args: argparse.Namespace, engine: object | None = None) -> int:
    """Serve until SIGTERM/SIGINT; the exit status."""
    from zerospeed.inference.api import RequestError
    from zerospeed.inference.serving.server import DEFAULT_MAX_WAITING, ServeError, serve

    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        kwargs = {} if engine is not None else engine_kwargs(args)
        handle = serve(args.model_dir, engine=engine, host=args.host, port=args.port,
                       api_key=args.api_key, served_model_name=args.served_model_name,
                       max_waiting=DEFAULT_MAX_WAITING if args.max_waiting is None
                       else args.max_waiting,
                       shutdown_timeout=args.shutdown_timeout, log_level=args.log_level, **kwargs)
    except ServeError as e:
        return _error(str(e), EXIT_USAGE)
    except (ValueError, RequestError, FileNotFoundError, KeyError, OSError) as e:
        return _error(f"{args.model_dir}: {e}", 1)
    # everything loaded so far (torch, transformers, the model) lives as long as the process:
    # keep it out of the collector's generations, so GC pauses stay short while serving and the
    # interpreter does not spend seconds collecting it at exit
    gc.freeze()
    report = getattr(handle.engine, "fast_path_report", None)
    if report:  # which fast paths run (issue #25): the user sees it whatever the log level
        print(f"zerospeed serve: {report}", flush=True)
    receiver = None
    if getattr(args, "weight_update_group", None):
        from zerospeed.inference.serving.weight_sync import WeightUpdateReceiver

        try:
            receiver = WeightUpdateReceiver(handle, args.weight_update_group, model_dir=args.model_dir).start()
        except (ValueError, RuntimeError) as e:
            handle.stop(0)
            return _error(f"--weight-update-group: {e}", 1)
        print(f"zerospeed serve: weight updates accepted at {args.weight_update_group}", flush=True)
    print(f"zerospeed serve: listening on {handle.url} (model {handle.model_name})", flush=True)
    try:
        while not stop.wait(0.2):
            if not handle.is_running():
                handle.stop(0)
                return _error("the server stopped unexpectedly", 1)
        print("zerospeed serve: shutting down", flush=True)
        if receiver is not None:
            receiver.stop()
        handle.stop()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``zerospeed serve ...``; returns the exit status."""
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except _UsageError as e:
        return _error(str(e), EXIT_USAGE)
    if args.shutdown_timeout < 0:
        return _error(f"--shutdown-timeout: must be at least 0, got {args.shutdown_timeout}",
                      EXIT_USAGE)
    if not os.path.isdir(args.model_dir):
        return _error(f"MODEL_DIR: no such folder: {args.model_dir}", EXIT_USAGE)
    if args.weight_update_group is not None:
        from zerospeed.inference.serving.weight_sync import parse_address

        try:
            parse_address(args.weight_update_group)
        except ValueError as e:
            return _error(str(e), EXIT_USAGE)
        if args.tensor_parallel > 1:
            return _error("--weight-update-group: not built with --tensor-parallel > 1 yet", EXIT_USAGE)
    if args.tensor_parallel > 1:
        from zerospeed.inference.serving import tensor_parallel

        return tensor_parallel.main(args, list(sys.argv[1:] if argv is None else argv), sys.modules[__name__])
    return run_server(args)


if __name__ == "__main__":
    sys.exit(main())
