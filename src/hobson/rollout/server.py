"""The rollout server: a :class:`~hobson.rollout.engine.NativeEngine` behind a TCP port, for the
rollout component of a heterogeneous Slurm job (``python -m jobs.rollout_server``).

It binds a port on the address it advertises (not every interface), makes or reads the job's
secret (mode 0600, beside the address file), writes ``{"host", "port", "pid", "node",
"secret_file", ...}`` atomically to the address file, and answers one JSON-line request per
connection (:mod:`hobson.rollout.transport`). A request without the secret is refused before it
is read further: it changes nothing and learns nothing but the refusal.

    ping               readiness: node, pid, whether configured, the committed (version, digest)
    configure          dtype, token ids, revisions, torch threads: what the trainer's in-process
                       engine would have been built with, so the completions are the same bits
    load_publication   through the named transport: the engine pauses generation (its lock),
                       recomputes and checks the digest, commits, resumes
    join_weights       (--transport dist) join the trainer's weight group: its store, rank, backend
    prepare_weights    (dist) the next version's manifest, config and bucket layout, checked first
    receive_weights    (dist) receive the prepared version's buckets, check the digest, commit
    generate           prompts + one seed per request; every completion carries this node's name
    shutdown           answer, remove the address file, exit 0

The engine itself is built at the first publication, from the publication's own config.json
(the provider is chosen by its ``model_type``), so the server needs no model flags. Reading a
request has a timeout (a stalled client cannot hold a handler); the trainer puts its own
deadline on every answer, which is how a hung engine is found.
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import sys
import threading
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from hobson.devices import check_device
from hobson.errors import ConfigError
from hobson.io import write_json_atomic
from hobson.records import utc_now
from hobson.rollout import publication
from hobson.rollout.transport import (
    AuthError,
    default_secret_file,
    gpu_uuid,
    make_secret,
    node_name,
    secret_matches,
    transport_class,
    weight_group,
)
from hobson.threads import set_threads

READ_TIMEOUT_S = 60.0


def identity(device: str) -> dict[str, Any]:
    """What completions depend on besides the settings (:data:`hobson.rollout.transport.IDENTITY`)."""
    dev = torch.device(device)
    out: dict[str, Any] = {"device": dev.type, "torch": torch.__version__, "cuda": torch.version.cuda,
                           "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if dev.type == "cuda" and torch.cuda.is_available():
        out["device_name"] = torch.cuda.get_device_name(dev)
        out["capability"] = list(torch.cuda.get_device_capability(dev))
        out["cudnn"] = torch.backends.cudnn.version()  # cuBLAS ships with the CUDA version above
    return out


class RolloutService:
    """The state behind the socket: settings, the engine, and request dispatch (no I/O)."""

    def __init__(self, device: str = "cpu", secret: str | None = None) -> None:
        self.device = device
        self.secret = secret
        self.settings: dict[str, Any] | None = None
        self.engine: Any = None
        self.node = node_name()
        self.stop = threading.Event()
        self._build_lock = threading.Lock()
        self._group: Future[Any] | None = None
        self._prepared: dict[str, Any] | None = None

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.secret is not None and not secret_matches(msg.get("secret"), self.secret):
            raise AuthError("refused: the request does not carry this job's rollout secret "
                            "(the secret_file named in the server's address file)")
        op = msg.get("op")
        if op == "ping":
            return {
                "node": self.node,
                "pid": os.getpid(),
                "configured": self.settings is not None,
                "version": getattr(self.engine, "version", None),
                "digest": getattr(self.engine, "digest", None),
                "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(),
                "identity": identity(self.device),
                "gpu_uuid": gpu_uuid(self.device),  # not identity: servers differ in it by design
            }
        if op == "configure":
            return self._configure(msg)
        if op == "load_publication" or op == "receive_weights":
            manifest = transport_class(msg.get("transport", "shared-dir")).receive(self, msg)
            return {"manifest": manifest.to_dict()}
        if op == "join_weights":
            return self._join_weights(msg)
        if op == "prepare_weights":
            self.engine_for(msg)  # a refusal (not configured, unknown model) before any byte moves
            self._prepared = msg
            return {}
        if op == "generate":
            if self.engine is None:
                raise publication.PublicationError("no publication loaded: load one before generating")
            outs = self.engine.generate(msg["prompts"], msg["seeds"], msg["temperature"], msg["max_new_tokens"])
            return {
                "completions": [
                    {
                        "tokens": c.tokens,
                        "logprobs": c.logprobs,
                        "version": c.version,
                        "digest": c.digest,
                        "trace": c.trace,
                        "node": self.node,
                    }
                    for c in outs
                ]
            }
        if op == "shutdown":
            self.stop.set()
            return {}
        raise ConfigError(f"unknown request {op!r}: ping, configure, load_publication, join_weights, "
                          "prepare_weights, receive_weights, generate, shutdown")

    def _join_weights(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's weight group in the background: forming it blocks until the trainer,
        which waits for this answer first, joins too."""
        fut: Future[Any] = Future()

        def join() -> None:
            try:
                import datetime

                import torch.distributed as dist

                timeout = float(msg["timeout"])
                store = dist.TCPStore(msg["store_host"], int(msg["store_port"]), int(msg["world"]), False,
                                      timeout=datetime.timedelta(seconds=timeout))
                fut.set_result(weight_group(msg["backend"], store, int(msg["rank"]), int(msg["world"]), timeout,
                                            self.secret or ""))
            except BaseException as e:  # noqa: BLE001 (handed to the request that needs the group)
                fut.set_exception(e)

        self._group = fut
        threading.Thread(target=join, name="weight-group-join", daemon=True).start()
        return {}

    def weights_group(self) -> Any:
        if self._group is None:
            raise ConfigError("no weight group: the trainer sends join_weights first")
        return self._group.result()

    def prepared_weights(self, version: int) -> dict[str, Any]:
        prepared = self._prepared
        if prepared is None or prepared["manifest"]["version"] != version:
            raise ConfigError(f"version {version} was not prepared: the trainer sends prepare_weights first")
        return prepared

    def _configure(self, msg: dict[str, Any]) -> dict[str, Any]:
        keys = ("dtype", "eos_id", "pad_id", "model_revision", "engine_revision", "torch_threads", "deterministic")
        settings = {k: msg.get(k, False) if k == "deterministic" else msg[k] for k in keys}
        if self.settings is not None and self.settings != settings:
            # a second trainer (a resumed run against a kept server) must want the same engine
            diffs = [f"{k}: {self.settings[k]!r} vs {settings[k]!r}" for k in keys if self.settings[k] != settings[k]]
            raise ConfigError("server already configured differently: " + "; ".join(diffs))
        # intra-op reductions split by thread count: use the trainer's, as its in-process engine would
        set_threads(int(settings["torch_threads"]))
        if settings["deterministic"]:
            # as the trainer's process runs (hobson.rl.loop: any CUDA device); the engine is built
            # later, at the first publication, so cuBLAS has not read the variable yet
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.settings = settings
        return {"node": self.node}

    def engine_for(self, msg: dict[str, Any]) -> Any:
        if self.settings is None:
            raise ConfigError("not configured: the trainer sends configure first")
        with self._build_lock:
            if self.engine is None:
                from hobson.models import get_provider
                from hobson.rollout.engine import NativeEngine

                s = self.settings
                self.engine = NativeEngine(
                    get_provider(Path(msg["path"])) if "path" in msg else get_provider(msg["config"]),
                    dtype=getattr(torch, s["dtype"]),
                    device=self.device,
                    eos_id=s["eos_id"],
                    pad_id=s["pad_id"],
                    model_revision=s["model_revision"],
                    engine_revision=s["engine_revision"],
                )
        return self.engine


class _Handler(socketserver.StreamRequestHandler):
    timeout = READ_TIMEOUT_S  # reading the request line; a client that stalls loses its handler
    server: _Server

    def handle(self) -> None:
        try:
            line = self.rfile.readline()
        except (TimeoutError, OSError):
            return
        if not line:
            return
        try:
            answer = {"ok": True, **self.server.service.handle(json.loads(line))}
        except Exception as e:  # every failure goes back to the trainer, which decides
            answer = {"ok": False, "type": type(e).__name__, "error": str(e) or repr(e)}
            if not isinstance(e, (ConfigError, AuthError, publication.PublicationError)):
                traceback.print_exc(file=sys.stderr)
        try:
            self.wfile.write(json.dumps(answer).encode() + b"\n")
            self.wfile.flush()
        except OSError:
            pass  # the trainer gave up on this request (its deadline); nothing to tell
        if self.server.service.stop.is_set():
            threading.Thread(target=self.server.shutdown, daemon=True).start()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], service: RolloutService) -> None:
        super().__init__(addr, _Handler)
        self.service = service


def bind_address(host: str) -> str:
    """The IPv4 address ``host`` resolves to: the one interface the server listens on, so that it
    is reachable exactly where it says it is and nowhere else."""
    try:
        return socket.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve {host!r}, the host this rollout server advertises ({e.strerror}): "
                          "pass --advertise NAME_OR_IP, or --bind ADDRESS") from None


def serve(address_file: str | os.PathLike, *, device: str = "cpu", bind: str | None = None, port: int = 0,
          advertise: str | None = None, secret_file: str | os.PathLike | None = None, index: int | None = None) -> int:
    """Serve until a shutdown request; returns the exit code (0). ``bind`` defaults to the address
    the advertised host resolves to; ``secret_file`` to the address file's ``.secret`` sibling."""
    check_device(device, "--device", "ENGINE_DEVICE in the sbatch scripts")  # before the address exists
    host = advertise or node_name()
    # several servers of one job (`srun --ntasks=N`): {index} is this one's, its SLURM_PROCID;
    # they share the job's one secret, named without the index
    index = os.environ.get("SLURM_PROCID", "0") if index is None else str(index)
    template = str(address_file)
    address_file = template.replace("{index}", index)
    secret_path = (Path(secret_file) if secret_file is not None
                   else default_secret_file(template.replace("-{index}", "").replace("{index}", "")))
    service = RolloutService(device=device, secret=make_secret(secret_path))
    try:
        srv = _Server((bind or bind_address(host), port), service)
    except OSError as e:
        raise ConfigError(f"cannot listen on {bind or host}:{port}: {e.strerror}; pass --bind ADDRESS "
                          "or --port PORT") from None
    address = {
        "host": host,
        "port": srv.server_address[1],
        "pid": os.getpid(),
        "node": service.node,
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "started_utc": utc_now(),
        "index": int(index),
        "secret_file": str(secret_path.resolve()),
    }
    path = Path(address_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, address)
    print(f"rollout server: listening on {srv.server_address[0]}:{address['port']} as {host} (node {service.node}, "
          f"pid {os.getpid()}); address in {path}", flush=True)
    try:
        srv.serve_forever(poll_interval=0.2)
    finally:
        srv.server_close()
        try:
            if json.loads(path.read_text(encoding="utf-8")).get("pid") == os.getpid():
                path.unlink()  # a later server may already have written its own
        except (FileNotFoundError, json.JSONDecodeError):
            pass
    print("rollout server: shut down on request", flush=True)
    return 0
