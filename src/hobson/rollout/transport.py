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

import contextlib
import hmac
import json
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable
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


def node_name() -> str:
    """``$SLURMD_NODENAME`` inside a Slurm step (every node of the local cluster shares one
    hostname), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def gpu_uuid(device: Any) -> str | None:
    """The UUID of ``device``'s GPU (what NCCL tells GPUs apart by), ``None`` for a CPU."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(dev).uuid)


def check_own_gpus(trainer: tuple[str, str | None], pings: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """NCCL puts one rank on one GPU: refuse a weight group in which a rollout server shares a GPU
    with the trainer or with another server, before the group is formed (NCCL would fail or hang
    there with a message that names neither). ``trainer``: its (node, GPU UUID); ``pings``: each
    server's (address, ping answer)."""
    node, uuid = trainer
    seen = {(node, uuid): "the trainer (weight group rank 0)"} if uuid else {}
    for i, (address, ping) in enumerate(pings):
        key = (ping.get("node"), ping.get("gpu_uuid"))
        if key[1] is None:
            continue
        if key in seen:
            raise ConfigError(
                f"--transport dist: rollout server {i} ({describe(address)}) is on the same GPU as {seen[key]} "
                f"({key[1]} on {key[0]}); NCCL needs one GPU per rank: give each rollout server a GPU of its own, "
                "use --transport shared-dir, or --colocated (the engine in the trainer's process, handed over on "
                "the GPU)")
        seen[key] = f"rollout server {i}"


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
    return exchange(address, payload, timeout)


def exchange(address: dict[str, Any], payload: dict[str, Any], timeout: float,
             between: Callable[[], None] | None = None) -> dict[str, Any]:
    """:func:`request`, running ``between()`` after the request line is sent and before the answer
    is read: the weight broadcast of :class:`DistTransport` runs there, while the server's handler
    receives it."""
    return exchange_many([address], payload, timeout, between)[0]


def exchange_many(addresses: list[dict[str, Any]], payload: dict[str, Any], timeout: float,
                  between: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """:func:`exchange` with every server at once: the request goes to each, ``between()`` runs
    once, then each answer is read (all within ``timeout``)."""
    op = payload.get("op")
    deadline = time.monotonic() + timeout
    socks: list[socket.socket] = []
    try:
        for address in addresses:
            line = {**payload, "secret": address["secret"]} if "secret" in address else payload
            try:
                s = socket.create_connection((address["host"], int(address["port"])), timeout=timeout)
                socks.append(s)
                s.sendall(json.dumps(line).encode() + b"\n")
            except TimeoutError:
                raise RolloutEngineError(f"{describe(address)}: no answer to {op!r} within {timeout:g} s "
                                         "(engine hung?)") from None
            except OSError as e:
                raise RolloutEngineError(f"{describe(address)}: {op!r} failed: {e} (engine gone?)") from None
        if between is not None:
            between()
        return [_answer(address, s, op, timeout, deadline) for address, s in zip(addresses, socks, strict=True)]
    finally:
        for s in socks:
            s.close()


def _answer(address: dict[str, Any], s: socket.socket, op: Any, timeout: float, deadline: float) -> dict[str, Any]:
    buf = bytearray()
    try:
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
    """How version N reaches a remote engine. ``writes_files``: the trainer writes the publication
    first and :meth:`send` gets its directory; else :meth:`send` gets the version in memory
    (:class:`~hobson.rollout.publication.Staged`) and no file is written on the critical path."""

    name: str
    writes_files: bool

    def send(self, addresses: list[dict[str, Any]], version: Any, timeout: float) -> list[dict[str, Any]]:
        """Trainer side: make ``version`` reach every server's engine and have it committed;
        returns each server's answer (``manifest``)."""
        ...

    def close(self) -> None:
        """Trainer side: release what :meth:`send` set up (a process group)."""
        ...


class SharedDirTransport:
    """The run directory is on a file system both components mount: send the path only."""

    name = "shared-dir"
    writes_files = True

    def __init__(self, **_: Any) -> None:
        pass

    def send(self, addresses: list[dict[str, Any]], version: Any, timeout: float) -> list[dict[str, Any]]:
        payload = {"op": "load_publication", "transport": self.name, "path": str(Path(version).resolve())}
        return exchange_many(addresses, payload, timeout)  # the servers load in parallel

    def close(self) -> None:
        pass

    @staticmethod
    def receive(service: Any, message: dict[str, Any]) -> publication.Manifest:
        """Server side: the engine loads, verifies and commits the directory."""
        return service.engine_for(message).load_publication(message["path"])


# The dist transport lays a version's tensors (name order, the publication's names and dtypes) out
# in buckets of at most ``bucket_bytes``; each tensor starts at a multiple of ALIGN so that the
# receiver's views of the bucket are aligned for every dtype (no copy out of the bucket).
ALIGN = 64


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def tensor_meta(tensors: dict[str, Any]) -> list[list[Any]]:
    """``[name, dtype, shape, nbytes]`` of each tensor, in name order (the digest's order)."""
    return [[n, str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size()]
            for n, t in sorted(tensors.items())]


def bucket_layout(meta: list[list[Any]], bucket_bytes: int) -> list[list[int]]:
    """``[first, end, bytes]`` slices of ``meta``: consecutive tensors whose aligned sizes add up
    to at most ``bucket_bytes``; a larger tensor travels alone."""
    buckets: list[list[int]] = []
    lo, size = 0, 0
    for i, m in enumerate(meta):
        n = _aligned(m[3])
        if i > lo and size + n > bucket_bytes:
            buckets.append([lo, i, size])
            lo, size = i, 0
        size += n
    if meta:
        buckets.append([lo, len(meta), size])
    return buckets


def _pack(tensors: dict[str, Any], meta: list[list[Any]], bucket: list[int], device: Any) -> Any:
    import torch

    lo, hi, size = bucket
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    off = 0
    for name, _, _, nbytes in meta[lo:hi]:
        if nbytes:
            buf[off : off + nbytes].copy_(tensors[name].reshape(-1).view(torch.uint8))
        off += _aligned(nbytes)
    return buf


def _unpack(buf: Any, meta: list[list[Any]], bucket: list[int], out: dict[str, Any]) -> None:
    import torch

    off = 0
    for name, dtype, shape, nbytes in meta[bucket[0] : bucket[1]]:
        out[name] = buf[off : off + nbytes].view(getattr(torch, dtype)).reshape(shape)
        off += _aligned(nbytes)


def weight_group(backend: str, store: Any, rank: int, world: int, timeout_s: float, secret: str) -> Any:
    """A process group of its own (not the trainer's DeepSpeed or DDP group) between training rank
    0 (rank 0) and the rollout servers. Its rendezvous keys live under a prefix derived from the
    job's secret: a process without the secret cannot take a rank."""
    import datetime
    import hashlib

    import torch.distributed as dist

    prefix = "hobson-weights-" + hashlib.sha256(secret.encode()).hexdigest()[:32] + "/"
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def broadcast(group: Any, buf: Any) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buf], opts).wait()


def _local_ip_towards(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (no packet is sent): where the server can
    reach the trainer's store."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


class DistTransport:
    """Training rank 0 broadcasts each version's tensors into the engine over a process group of
    its own (gloo on CPU, NCCL on GPU), in buckets, while the engine is paused: no publication file
    on the critical path. Two requests per version: ``prepare_weights`` (the manifest, config and
    layout; the server checks them and builds its engine, so a refusal comes back before any byte
    moves), then ``receive_weights``, whose handler receives the buckets, recomputes the digest and
    commits. A peer that dies or stalls mid-broadcast fails the send within ``timeout`` (the
    group's own), named; the group is then aborted."""

    name = "dist"
    writes_files = False

    def __init__(self, bucket_bytes: int = 256 * 1024**2, backend: str | None = None, **_: Any) -> None:
        self.bucket_bytes = int(bucket_bytes)
        self.backend = backend
        self.group: Any = None
        self._store: Any = None
        self.device: Any = "cpu"  # where rank 0's tensors are (its GPU joins the NCCL group)

    def _join(self, addresses: list[dict[str, Any]], backend: str, timeout: float) -> None:
        """Form the group: this process rank 0 (and its store), server i rank i + 1."""
        import datetime

        import torch.distributed as dist

        world = len(addresses) + 1
        if backend == "nccl":
            check_own_gpus((node_name(), gpu_uuid(self.device)),
                           [(a, request(a, {"op": "ping"}, timeout)) for a in addresses])
        host = _local_ip_towards(addresses[0]["host"], int(addresses[0]["port"]))
        self._store = dist.TCPStore(host, 0, world, True, timeout=datetime.timedelta(seconds=timeout),
                                    wait_for_workers=False)
        for rank, address in enumerate(addresses, start=1):
            request(address, {"op": "join_weights", "store_host": host, "store_port": self._store.port,
                              "rank": rank, "world": world, "backend": backend, "timeout": timeout}, timeout)
        try:
            self.group = weight_group(backend, self._store, 0, world, timeout, addresses[0].get("secret", ""))
        except RuntimeError as e:
            raise RolloutEngineError(f"{COMPONENT}: the weight group of {world - 1} server(s) did not form within "
                                     f"{timeout:g} s: {e}") from None

    def send(self, addresses: list[dict[str, Any]], version: Any, timeout: float) -> list[dict[str, Any]]:
        from hobson import faults

        staged = version
        tensors = staged.tensors
        device = next(iter(tensors.values())).device if tensors else "cpu"
        backend = self.backend or ("nccl" if getattr(device, "type", "cpu") == "cuda" else "gloo")
        if self.group is None:
            self.device = device
            self._join(addresses, backend, timeout)
        meta = tensor_meta(tensors)
        buckets = bucket_layout(meta, self.bucket_bytes)
        v = staged.manifest.version
        exchange_many(addresses, {"op": "prepare_weights", "transport": self.name,
                                  "manifest": staged.manifest.to_dict(), "config": staged.config, "tensors": meta,
                                  "buckets": buckets}, timeout)
        who = describe(addresses[0]) if len(addresses) == 1 else f"{COMPONENT}: one of {len(addresses)} servers"

        def push() -> None:
            for b, bucket in enumerate(buckets):
                buf = _pack(tensors, meta, bucket, device)
                if b == 0 and faults.fire_once(f"corrupt-weights-v{v}"):
                    buf[0] ^= 0xFF  # TEST: one bucket damaged in flight, after the digest was taken
                try:
                    broadcast(self.group, buf)
                except RuntimeError as e:  # gloo/NCCL: peer gone, or the group's timeout
                    self.abort()
                    raise RolloutEngineError(f"{who}: weight broadcast of version {v} failed at "
                                             f"bucket {b + 1}/{len(buckets)}: {e}") from None

        return exchange_many(addresses, {"op": "receive_weights", "transport": self.name, "version": v}, timeout,
                             push)

    def abort(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(Exception):
                group.abort()

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(Exception):
                group.shutdown()

    @staticmethod
    def receive(service: Any, message: dict[str, Any]) -> publication.Manifest:
        """Server side of ``receive_weights``: the buckets of the prepared version, then the
        engine's digest check and commit (a refusal keeps the previous version serving)."""
        from hobson import faults
        from hobson.rollout import publication

        prepared = service.prepared_weights(message["version"])
        group = service.weights_group()
        meta, buckets = prepared["tensors"], prepared["buckets"]
        engine = service.engine_for(prepared)
        device = engine.device if getattr(group, "name", lambda: "")() == "nccl" else "cpu"
        import torch

        out: dict[str, Any] = {}
        for b, bucket in enumerate(buckets):
            buf = torch.empty(bucket[2], dtype=torch.uint8, device=device)
            broadcast(group, buf)
            _unpack(buf, meta, bucket, out)
            faults.hold(f"receive-weights-v{message['version']}-bucket-{b + 1}")
        staged = publication.Staged(publication.Manifest(**prepared["manifest"]), prepared["config"], out)
        return engine.load_staged(staged, source="the weight group")


TRANSPORTS: dict[str, Any] = {SharedDirTransport.name: SharedDirTransport, DistTransport.name: DistTransport}


def get_transport(name: str, **options: Any) -> PublicationTransport:
    return transport_class(name)(**options)


def transport_class(name: str) -> Any:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ConfigError(f"publication transport {name!r}: supported {', '.join(sorted(TRANSPORTS))}") from None


# ---------------------------------------------------------------------------------------------
# The client engine


def address_files(template: str | os.PathLike, servers: int) -> list[Path]:
    """The address file of each of ``servers`` rollout servers: ``{index}`` in ``template`` is the
    server's index (its ``SLURM_PROCID`` in a Slurm job); one server may use a plain path."""
    t = str(template)
    if "{index}" not in t:
        if servers == 1:
            return [Path(t)]
        raise ConfigError(f"engine_address_file {t!r}: with {servers} rollout servers it needs {{index}} "
                          "(e.g. runs/x/engine/address-77-{index}.json)")
    return [Path(t.replace("{index}", str(i))) for i in range(servers)]


# What a server's arithmetic depends on besides its settings: completions are identical across
# servers only where these agree (the trainer refuses a server that differs from the first)
IDENTITY = ("device", "device_name", "capability", "torch", "cuda", "cudnn", "cpu_capability")


def check_same_servers(pings: list[dict[str, Any]]) -> None:
    first = pings[0]
    for i, ping in enumerate(pings[1:], start=1):
        diffs = [f"{k} {ping.get('identity', {}).get(k)!r} (server 0: {first.get('identity', {}).get(k)!r})"
                 for k in IDENTITY if ping.get("identity", {}).get(k) != first.get("identity", {}).get(k)]
        if diffs:
            raise ConfigError(
                f"rollout server {i} ({describe(ping['address'])}) differs from server 0: {'; '.join(diffs)}; "
                "completions would then depend on which server ran them: give every server the same kind of "
                "device and software")


class RemoteEngine:
    """A :class:`~hobson.rollout.engine.RolloutEngine` served by ``servers`` rollout servers
    (:mod:`hobson.rollout.server`) elsewhere.

    At construction it waits (``ready_timeout``) for each server's address file and a ping,
    refuses servers that differ (:data:`IDENTITY`), then configures each with exactly what the
    in-process engine would get (dtype, token ids, revisions), the trainer's torch thread count
    and deterministic-algorithms mode, so its completions are bit-identical. Every version goes to
    every server; :meth:`generate_units` gives unit k to server k mod N, each unit one generate
    call, so no completion depends on N or on which server ran it.
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
        bucket_bytes: int = 256 * 1024**2,
        servers: int = 1,
        shutdown_on_close: bool = True,
    ) -> None:
        self.request_timeout = request_timeout
        self.publish_timeout = publish_timeout
        self.transport = get_transport(transport, bucket_bytes=bucket_bytes)
        self.shutdown_on_close = shutdown_on_close
        self.resent: list[int] = []  # versions that arrived damaged and were sent again
        self.version: int | None = None
        self.digest: str | None = None
        end = time.monotonic() + ready_timeout
        self.pings = [wait_ready(f, max(end - time.monotonic(), 1.0)) for f in address_files(address_file, servers)]
        self.addresses = [p["address"] for p in self.pings]
        self.address = self.addresses[0]
        self.node = self.address.get("node")
        check_same_servers(self.pings)
        exchange_many(
            self.addresses,
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

    def _committed(self, answers: list[dict[str, Any]]) -> publication.Manifest:
        from hobson.rollout import publication

        manifests = [publication.Manifest(**a["manifest"]) for a in answers]
        for i, m in enumerate(manifests[1:], start=1):
            if m.digest != manifests[0].digest:  # cannot happen unless a server is broken
                raise DigestMismatch(f"{describe(self.addresses[i])}: committed {m.digest}, "
                                     f"server 0 {manifests[0].digest}")
        self.version, self.digest = manifests[0].version, manifests[0].digest
        return manifests[0]

    def load_publication(self, pub_dir: str | os.PathLike) -> publication.Manifest:
        if not self.transport.writes_files:
            raise ConfigError(f"transport {self.transport.name} sends versions from memory: use load_staged")
        return self._committed(self.transport.send(self.addresses, Path(pub_dir), self.publish_timeout))

    def load_staged(self, staged: publication.Staged) -> publication.Manifest:
        """Send a version from memory (``--transport dist``). A version a server received damaged
        (its digest differs from the trainer's: that engine committed nothing and still serves the
        previous one) is sent once more to all; a second failure is the error."""
        if self.transport.writes_files:
            raise ConfigError(f"transport {self.transport.name} sends publication directories: use load_publication")
        try:
            answers = self.transport.send(self.addresses, staged, self.publish_timeout)
        except DigestMismatch as e:
            print(f"rl: warning: version {staged.manifest.version} arrived damaged ({e}); sending it again",
                  flush=True)
            self.resent.append(staged.manifest.version)
            answers = self.transport.send(self.addresses, staged, self.publish_timeout)
        return self._committed(answers)

    def generate(
        self, prompts: list[list[int]], seeds: list[int], temperature: float, max_new_tokens: int
    ) -> list[Completion]:
        return self.generate_units([(prompts, seeds)], temperature, max_new_tokens)[0]

    def generate_units(
        self, units: list[tuple[list[list[int]], list[int]]], temperature: float, max_new_tokens: int
    ) -> list[list[Completion]]:
        """Each unit as one generate call; unit k on server k mod N, the servers in parallel."""
        from concurrent.futures import ThreadPoolExecutor

        from hobson.rollout.engine import Completion

        def run(server: int) -> list[tuple[int, list[Completion]]]:
            address, pid = self.addresses[server], self.pings[server].get("pid")
            done = []
            for k in range(server, len(units), len(self.addresses)):
                prompts, seeds = units[k]
                answer = request(address, {"op": "generate", "prompts": prompts, "seeds": [int(x) for x in seeds],
                                           "temperature": temperature, "max_new_tokens": max_new_tokens},
                                 self.request_timeout)
                done.append((k, [Completion(**c, server=server, pid=pid) for c in answer["completions"]]))
            return done

        n = min(len(self.addresses), len(units))
        out: list[list[Completion]] = [[] for _ in units]
        with ThreadPoolExecutor(max_workers=max(n, 1)) as pool:
            for part in [f.result() for f in [pool.submit(run, i) for i in range(n)]]:
                for k, completions in part:
                    out[k] = completions
        return out

    def close(self) -> None:
        self.transport.close()
        if self.shutdown_on_close:
            for address in self.addresses:
                try:
                    request(address, {"op": "shutdown"}, timeout=10.0)
                except HobsonError:
                    pass  # already gone: nothing to stop
