"""How the trainer reaches a rollout engine in another process: the wire, the publication
transport, and :class:`RemoteEngine`, a client with the :class:`~hobson.rollout.engine.RolloutEngine`
interface, so the loop (and every algorithm) cannot tell it from the in-process engine.

The wire is one TCP connection per request: the client sends one JSON line, the server
(:mod:`hobson.rollout.server`) answers one JSON line ``{"ok": true, ...}`` or ``{"ok": false,
"error": ..., "type": ...}``. Floats travel as Python's shortest round-trip repr, so
log-probs arrive bit for bit. Every request has a deadline (connect + answer); a server that
does not answer in time is reported as hung, one that closes the connection as gone, both as
:class:`RolloutEngineError` naming the rollout component, its node and pid.

A publication reaches the engine through a :class:`PublicationTransport`: ``send`` runs in
the trainer after :func:`hobson.rollout.publication.publish` wrote version N, ``receive`` in the
server, which must load it (pause generation, verify the digest, commit, resume) and return
its manifest. The default, :class:`SharedDirTransport`, sends only the path: both components
read the run directory on a shared file system. A faster one (an NCCL broadcast of the tensors
between the components) registers in :data:`TRANSPORTS` under a new name; the loop and the
objectives never see which one runs.

The address file (written atomically by the server) is JSON::

    {"host": "n2", "port": 41234, "pid": 123, "node": "n2", "job_id": "77", "started_utc": ...,
     "secret_file": "runs/x/engine/address-77.secret"}

Every request carries the job's secret, read from ``secret_file`` (mode 0600, beside the address
file, created by the first server of the job): the server refuses any request without it, so a
process elsewhere on the cluster network cannot load a path into the engine or shut it down.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hobson.errors import ConfigError, DigestMismatch, HobsonError, StageError

if TYPE_CHECKING:
    from hobson.rollout import publication
    from hobson.rollout.engine import Completion

# torch-free at import: the sbatch script's readiness check (`jobs.rollout_server --wait`) uses
# only the wire functions, and should not pay for importing torch

COMPONENT = "rollout component (het group 1)"


class RolloutEngineError(StageError):
    """The remote rollout engine is gone, hung, or answered something unreadable."""


# Errors the server reports by type name are raised again here with their own class, so a
# refused publication reads the same with a remote engine as with the in-process one.
def _error_class(name: str) -> type[HobsonError]:
    if name == "PublicationError":
        from hobson.rollout.publication import PublicationError

        return PublicationError
    return {"DigestMismatch": DigestMismatch, "ConfigError": ConfigError, "AuthError": AuthError}.get(
        name, RolloutEngineError)


class AuthError(HobsonError):
    """A request did not carry the job's secret; the server refused it and changed nothing."""


SECRET_BYTES = 32


def default_secret_file(address_file: str | os.PathLike) -> Path:
    """The secret's place beside an address file: ``address-77.json`` -> ``address-77.secret``."""
    return Path(address_file).with_suffix(".secret")


def make_secret(path: str | os.PathLike) -> str:
    """The job's secret in ``path``: read if it exists, else created with mode 0600.

    Written to a private temporary and hard-linked into place, so that servers of one job
    starting together agree on one secret and none reads a half-written file."""
    path = Path(path)
    if path.exists():
        return read_secret(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # 0600 from the first byte
    try:
        try:
            os.write(fd, secrets.token_hex(SECRET_BYTES).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another server of this job linked its secret first: use that one
    finally:
        tmp.unlink(missing_ok=True)
    return read_secret(path)


def read_secret(path: str | os.PathLike) -> str:
    """The secret in ``path``; refused if others than its owner may read it."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        raise ConfigError(f"{path}: the rollout server's secret file is missing; "
                          "restart the rollout component") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{path}: the rollout secret is readable by others (mode {stat.S_IMODE(mode):o}); "
                          f"run `chmod 600 {path}` or delete it and restart the rollout component")
    if len(text) != 2 * SECRET_BYTES:
        raise ConfigError(f"{path}: not a rollout secret ({len(text)} characters, expected {2 * SECRET_BYTES}); "
                          "delete it and restart the rollout component")
    return text


def secret_matches(given: Any, secret: str) -> bool:
    """Constant-time comparison, so the answer's timing does not leak the secret."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), secret.encode())


def read_address(path: str | os.PathLike) -> dict[str, Any] | None:
    """The address a server wrote, with its secret (from ``secret_file``) under ``"secret"``, or
    None while the file is absent (the server is starting)."""
    try:
        address = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    if "secret_file" in address:
        address["secret"] = read_secret(address["secret_file"])
    return address


def describe(address: dict[str, Any]) -> str:
    where = f"{address['host']}:{address['port']}"
    return f"{COMPONENT}: server pid {address.get('pid')} on node {address.get('node')} at {where}"


def request(address: dict[str, Any], payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send one request and return the answer; raises :class:`RolloutEngineError` on no answer in
    ``timeout`` seconds, a lost connection or an unreadable answer, and the server's own error
    (its class when known) when it refused the request."""
    op = payload.get("op")
    deadline = time.monotonic() + timeout
    if "secret" in address:
        payload = {**payload, "secret": address["secret"]}
    try:
        with socket.create_connection((address["host"], int(address["port"])), timeout=timeout) as s:
            s.sendall(json.dumps(payload).encode() + b"\n")
            buf = bytearray()
            while not buf.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                s.settimeout(left)
                chunk = s.recv(1 << 20)
                if not chunk:
                    raise ConnectionError("the server closed the connection without answering")
                buf += chunk
    except TimeoutError:
        raise RolloutEngineError(
            f"{describe(address)}: no answer to {op!r} within {timeout:g} s (engine hung?)"
        ) from None
    except OSError as e:
        raise RolloutEngineError(f"{describe(address)}: {op!r} failed: {e} (engine gone?)") from None
    try:
        answer = json.loads(buf)
    except json.JSONDecodeError as e:
        raise RolloutEngineError(f"{describe(address)}: unreadable answer to {op!r}: {e}") from None
    if not answer.get("ok"):
        cls = _error_class(answer.get("type", ""))
        raise cls(f"{answer.get('error')} [{describe(address)}]")
    return answer


def wait_ready(
    address_file: str | os.PathLike, timeout: float, watch_pid: int | None = None, poll_s: float = 0.2
) -> dict[str, Any]:
    """Wait until ``address_file`` exists and its server answers a ping; return the ping answer
    (with ``address``). Fails at the deadline, or as soon as process ``watch_pid`` (the launching
    shell's srun of the server) has exited."""
    end = time.monotonic() + timeout
    last = "the address file does not exist yet"
    while True:
        address = read_address(address_file)
        if address is not None:
            try:
                answer = request(address, {"op": "ping"}, timeout=min(10.0, max(end - time.monotonic(), 0.5)))
                return {**answer, "address": address}
            except RolloutEngineError as e:
                last = str(e)
        if watch_pid is not None and not _alive(watch_pid):
            raise RolloutEngineError(f"{COMPONENT} exited before it was ready (pid {watch_pid}); last: {last}")
        if time.monotonic() > end:
            raise RolloutEngineError(f"{COMPONENT} not ready after {timeout:g} s ({address_file}): {last}")
        time.sleep(poll_s)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (an exited one that its parent has not reaped yet, a
    zombie, counts as exited)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # our child: reap it if it exited
        return done == 0
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


# ---------------------------------------------------------------------------------------------
# Publication transports


class PublicationTransport(Protocol):
    name: str

    def send(self, address: dict[str, Any], pub_dir: Path, timeout: float) -> dict[str, Any]:
        """Trainer side: make version ``pub_dir`` reach the engine and have it committed; returns
        the server's answer (``manifest``)."""
        ...

    def receive(self, engine: Any, message: dict[str, Any]) -> publication.Manifest:
        """Server side: load the publication ``message`` describes into ``engine`` (which pauses
        generation, verifies the digest and commits) and return its manifest."""
        ...


class SharedDirTransport:
    """The run directory is on a file system both components mount: send the path only."""

    name = "shared-dir"

    def send(self, address: dict[str, Any], pub_dir: Path, timeout: float) -> dict[str, Any]:
        payload = {"op": "load_publication", "transport": self.name, "path": str(Path(pub_dir).resolve())}
        return request(address, payload, timeout)

    def receive(self, engine: Any, message: dict[str, Any]) -> publication.Manifest:
        return engine.load_publication(message["path"])


TRANSPORTS: dict[str, PublicationTransport] = {SharedDirTransport.name: SharedDirTransport()}


def get_transport(name: str) -> PublicationTransport:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ConfigError(f"publication transport {name!r}: supported {', '.join(sorted(TRANSPORTS))}") from None


# ---------------------------------------------------------------------------------------------
# The client engine


class RemoteEngine:
    """A :class:`~hobson.rollout.engine.RolloutEngine` served by :mod:`hobson.rollout.server` elsewhere.

    At construction it waits (``ready_timeout``) for the server's address file and a ping, then
    configures it with exactly what the in-process engine would get (dtype, token ids,
    revisions), the trainer's torch thread count and deterministic-algorithms mode, so its
    completions are bit-identical.
    """

    def __init__(
        self,
        address_file: str | os.PathLike,
        *,
        dtype_name: str,
        eos_id: int,
        pad_id: int,
        model_revision: str,
        engine_revision: str,
        torch_threads: int,
        deterministic: bool = False,
        request_timeout: float = 600.0,
        publish_timeout: float = 600.0,
        ready_timeout: float = 600.0,
        transport: str = SharedDirTransport.name,
        shutdown_on_close: bool = True,
    ) -> None:
        self.request_timeout = request_timeout
        self.publish_timeout = publish_timeout
        self.transport = get_transport(transport)
        self.shutdown_on_close = shutdown_on_close
        self.version: int | None = None
        self.digest: str | None = None
        self.ping = wait_ready(address_file, ready_timeout)
        self.address = self.ping["address"]
        self.node = self.address.get("node")
        request(
            self.address,
            {
                "op": "configure",
                "dtype": dtype_name,
                "eos_id": eos_id,
                "pad_id": pad_id,
                "model_revision": model_revision,
                "engine_revision": engine_revision,
                "torch_threads": torch_threads,
                "deterministic": deterministic,
            },
            request_timeout,
        )

    def load_publication(self, pub_dir: str | os.PathLike) -> publication.Manifest:
        from hobson.rollout import publication

        answer = self.transport.send(self.address, Path(pub_dir), self.publish_timeout)
        manifest = publication.Manifest(**answer["manifest"])
        self.version, self.digest = manifest.version, manifest.digest
        return manifest

    def generate(
        self, prompts: list[list[int]], seeds: list[int], temperature: float, max_new_tokens: int
    ) -> list[Completion]:
        from hobson.rollout.engine import Completion

        answer = request(
            self.address,
            {
                "op": "generate",
                "prompts": prompts,
                "seeds": [int(s) for s in seeds],
                "temperature": temperature,
                "max_new_tokens": max_new_tokens,
            },
            self.request_timeout,
        )
        return [Completion(**c) for c in answer["completions"]]

    def close(self) -> None:
        if self.shutdown_on_close:
            try:
                request(self.address, {"op": "shutdown"}, timeout=10.0)
            except HobsonError:
                pass  # already gone: nothing to stop
