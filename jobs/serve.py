"""Serve a decider checkpoint over HTTP (JSON), batched under a token cap, until SIGTERM or Ctrl-C.

    python -m jobs.serve runs/R/calibrated [--host 127.0.0.1] [--port 8000] [--max-batch-tokens 8192]
    curl -s localhost:8000/v1/decide -d '{"state": "x = 3; y = 5", "instructions": "Which is larger?",
        "options": [["x", ""], ["y", ""]], "kind": "choice"}'

Endpoints: POST /v1/decide (one question, or {"questions": [...]}: each answer holds the
calibrated probability of every option in the order given, the chosen option and the
temperature used), GET /healthz (503 "loading" until the checkpoint verified and loaded, then
200 "ready"), GET /v1/model (checkpoint, config digest, temperatures, torso, head).

Questions from concurrent requests share forwards, grouped by length, never more than
--max-batch-tokens padded tokens per forward; a question longer than that alone is refused (400).
The server binds 127.0.0.1 unless --host says otherwise (--host node: this node's name, as a
Slurm job advertises it); --token-file FILE or $HOBSON_SERVE_TOKEN sets a bearer token that
/v1/* then require. --address-file PATH gets {"url", "host", "port", "node", "pid", ...} once the
port is bound (--port 0 picks a free one). SIGTERM: the requests in flight are answered, then
exit 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path

from hobson.errors import ConfigError, HobsonError, internal_error

TOKEN_ENV = "HOBSON_SERVE_TOKEN"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT", help="decider checkpoint directory (trained, calibrated, souped)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; 'node': this node's name, as Slurm names it)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--max-batch-tokens", type=_positive(int), default=8192,
                   help="padded tokens (rows x longest) per forward at most (default 8192)")
    p.add_argument("--device", default="cpu", help="torch device: cpu or cuda (default cpu)")
    p.add_argument("--base-model", help="torso directory replacing the one recorded in the checkpoint")
    p.add_argument("--max-queue", type=_positive(int), default=1024,
                   help="questions held (queued or in the forward) before requests get 429 (default 1024)")
    p.add_argument("--max-questions", type=_positive(int), default=256,
                   help="questions per request at most (default 256)")
    p.add_argument("--max-body-bytes", type=_positive(int), default=1 << 20,
                   help="request body size limit (default 1 MiB)")
    p.add_argument("--request-timeout", type=_positive(float), default=60.0,
                   help="seconds a request may take to arrive or to be answered (default 60)")
    p.add_argument("--batch-wait-ms", type=float, default=2.0,
                   help="after a question arrives, wait this long for concurrent ones to share its forward")
    p.add_argument("--token-file", help=f"bearer token file guarding /v1/* (or ${TOKEN_ENV})")
    p.add_argument("--address-file", help="write the bound address here as JSON")
    p.add_argument("--threads", type=_positive(int), default=None, help="torch CPU threads")
    return p


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        try:
            token = Path(args.token_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(f"--token-file {args.token_file}: {e.strerror}") from None
        if not token:
            raise ConfigError(f"--token-file {args.token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def _listen(host: str, port: int) -> tuple[socket.socket, str]:
    """The bound, listening socket and the name clients reach it by."""
    from hobson.rollout.server import bind_address, node_name

    if host == "node":
        advertise = node_name()
        bind = bind_address(advertise)
    else:
        advertise = socket.gethostname() if host in ("0.0.0.0", "") else host
        bind = host
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP,
    # and without it every keep-alive response waits ~40 ms for the client's delayed ACK (Nagle)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {bind}:{port}: {e.strerror}; pass another --port (0: any free one) "
                          "or --host") from None
    sock.listen(2048)
    return sock, advertise


def _check(args: argparse.Namespace) -> None:
    if args.max_questions > args.max_queue:
        raise ConfigError(f"--max-questions {args.max_questions} is larger than --max-queue {args.max_queue}: "
                          "such a request could never be queued")
    if args.batch_wait_ms < 0:
        raise ConfigError(f"--batch-wait-ms must be >= 0, got {args.batch_wait_ms}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be 0..65535, got {args.port}")
    if not Path(args.checkpoint).is_dir():
        raise ConfigError(f"{args.checkpoint}: no such checkpoint directory")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _serve(args)
    except HobsonError as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # a bug: one message, the traceback in a file
        return internal_error(e, "serve")


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from hobson.io import write_json_atomic
    from hobson.records import utc_now
    from hobson.rollout.server import node_name
    from hobson.serve.app import ServeSettings, Service, build_app
    from hobson.threads import set_threads

    _check(args)
    token = _token(args)
    set_threads(args.threads)
    if args.device.startswith("cuda"):
        from hobson.devices import check_device

        check_device(args.device, "--device")
    sock, advertise = _listen(args.host, args.port)
    port = sock.getsockname()[1]
    url = f"http://{advertise}:{port}"
    if args.host not in LOOPBACK and token is None:
        print(f"serve: warning: listening on {args.host} without a token: anyone who reaches {url} can ask it "
              f"(--token-file FILE or ${TOKEN_ENV} guards it)", file=sys.stderr, flush=True)
    settings = ServeSettings(
        checkpoint=args.checkpoint, device=args.device, base_model=args.base_model,
        max_batch_tokens=args.max_batch_tokens, max_queue=args.max_queue, max_questions=args.max_questions,
        max_body_bytes=args.max_body_bytes, request_timeout_s=args.request_timeout,
        batch_wait_ms=args.batch_wait_ms, token=token)

    def failed(exc: BaseException) -> None:  # the checkpoint did not load: say why and stop serving
        print(f"serve: error: {args.checkpoint}: {exc}", file=sys.stderr, flush=True)
        server.should_exit = True

    service = Service(settings, on_failure=failed)
    config = uvicorn.Config(build_app(service), log_level="warning", access_log=False, timeout_keep_alive=5,
                            timeout_graceful_shutdown=None, lifespan="on")
    server = uvicorn.Server(config)
    address = {"url": url, "host": advertise, "port": port, "pid": os.getpid(), "node": node_name(),
               "job_id": os.environ.get("SLURM_JOB_ID"), "checkpoint": str(Path(args.checkpoint).resolve()),
               "token_file": str(Path(args.token_file).resolve()) if args.token_file else None,
               "started_utc": utc_now()}
    if args.address_file:
        write_json_atomic(args.address_file, address)
    print(f"serve: listening on {url} ({sock.getsockname()[0]}:{port}); loading {args.checkpoint} on "
          f"{args.device}; max {args.max_batch_tokens} tokens per forward", flush=True)

    # uvicorn answers SIGTERM/SIGINT by finishing the requests in flight, then re-raises the
    # signal under the handler found before it ran: this one, so a clean shutdown exits 0
    # (under hobson.stagerun its own handler is passed the signal, and the record says so).
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    received: list[int] = []
    for sig in previous:
        signal.signal(sig, lambda s, f: received.append(s))
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
        if args.address_file:
            _remove_own(Path(args.address_file))
    if service.error is not None:
        return 1
    print(f"serve: stopped ({service.batcher.stats.questions if service.batcher else 0} questions answered)",
          flush=True)
    for sig in received:  # e.g. hobson.stagerun's: its record then says the stage was stopped
        handler = previous[sig]
        if callable(handler) and handler is not signal.default_int_handler:
            handler(sig, None)
    return 0


def _remove_own(path: Path) -> None:
    import json

    try:
        if json.loads(path.read_text(encoding="utf-8")).get("pid") == os.getpid():
            path.unlink()  # a later server may already have written its own
    except (FileNotFoundError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
