"""Weight sync: from the end of the optimizer step (the actor's weights in memory) to the engine's
commit of that version, for each transport side by side in one run, against the raw speed of
moving the same bytes.

    python bench/weight_sync.py [--kind nanbeige|huginn_raven] [--size small|tiny|official] [--repeat 3]
                                [--device cpu|cuda] [--dtype float32|float16|bfloat16]
                                [--bucket-mb 256] [--dir DIR] [--json bench/results/weight_sync-DATE.json]

Rows (each the best of ``--repeat``; the version number increases every time, as in a run):
- shared-dir, remote: the trainer writes the publication (export, digest, fsync, rename), the
  rollout server (another process, as in a Slurm job) reads, verifies and commits it;
- dist, remote: the trainer stages the version in memory (export + digest) and broadcasts it over
  the gloo weight group in buckets; the server checks the digest of what it received and commits;
- dist, in-process: the colocated case, a direct hand-off to the engine in the trainer's process;
- limits: one gloo broadcast of the same bytes to the server's process (no digest, no model
  build), and one in-memory copy of them.
GB/s counts the version's tensor bytes. The server runs on this host, bound to 127.0.0.1.
``--device cuda``: the actor, the in-process engine and the server on the GPU (random weights
drawn there; ``--size official`` is the published configuration); the remote dist row needs
a second GPU (NCCL refuses two ranks on one device) and is left out on one, and the limit rows
are a device-to-device copy and a device-to-host copy.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import best, environment, log, sync, write_json
from publish import SIZES

from hobson.models import get_provider, tiny_config
from hobson.rollout import publication
from hobson.rollout.engine import NativeEngine
from hobson.rollout.transport import RemoteEngine, broadcast, request, wait_ready, weight_group

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="nanbeige", choices=["nanbeige", "huginn_raven"])
    p.add_argument("--size", default="small", choices=[*sorted(SIZES), "official"])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--bucket-mb", type=float, default=256.0, help="dist bucket size in MiB (default 256)")
    p.add_argument("--dir", default=None, help="where publications are written (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the figures here (bench/results/weight_sync-DATE.json)")
    return p.parse_args()


def start_server(addr: Path, device: str = "cpu") -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    # ``jobs.rollout_server`` from the repository root, as bench/rl_gpu.py runs ``jobs.rl``: it also
    # works from a checkout on PYTHONPATH, where the installed name ``hobson.jobs`` does not exist
    proc = subprocess.Popen([sys.executable, "-m", "jobs.rollout_server", "--address-file", str(addr),
                             "--advertise", "127.0.0.1", "--device", device], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL)
    wait_ready(addr, 120, watch_pid=proc.pid)
    return proc


def remote(addr: Path, transport: str, bucket_bytes: int, dtype: str = "float32") -> RemoteEngine:
    return RemoteEngine(addr, dtype_name=dtype, eos_id=0, pad_id=0, model_revision="bench",
                        engine_revision="bench", torch_threads=torch.get_num_threads(), request_timeout=600,
                        publish_timeout=600, ready_timeout=60, transport=transport, bucket_bytes=bucket_bytes,
                        shutdown_on_close=False)


def main() -> int:
    args = parse_args()
    dtype, dev = getattr(torch, args.dtype), args.device
    if args.size == "official":  # random weights drawn on the device: a CPU init would take minutes
        from rl_gpu import config_for, random_model

        cfg = config_for(args.kind, "official")
        provider = get_provider(cfg)
        actor = random_model(args.kind, cfg, torch.float32, dev)
    else:
        cfg = tiny_config(args.kind, **SIZES[args.size][args.kind])
        provider = get_provider(cfg)
        actor = provider.build_actor(cfg, seed=0).to(dev)
    nbytes = sum(t.numel() * t.element_size() for t in provider.export_state(actor, dtype=dtype)[0].values())
    gb = nbytes / 1e9
    versions = iter(range(1_000_000))
    bucket_bytes = int(args.bucket_mb * 1024**2)
    rows: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        pubs = Path(tmp) / "publications"
        addr = Path(tmp) / "engine" / "address.json"
        server = start_server(addr, dev)
        try:
            log("shared-dir, remote")
            eng = remote(addr, "shared-dir", bucket_bytes, args.dtype)

            def shared() -> None:
                v = next(versions)
                publication.publish(provider, actor, pubs, v, model_revision="bench", engine_revision="bench",
                                    dtype=dtype)
                eng.load_publication(publication.version_dir(pubs, v))

            rows["shared-dir, remote (write + server load)"] = best(shared, args.repeat)
            if dev == "cpu":  # NCCL refuses two ranks on one GPU: the GPU's remote row needs two
                log("dist, remote")
                dist_eng = remote(addr, "dist", bucket_bytes, args.dtype)

                def dist() -> None:
                    dist_eng.load_staged(publication.stage(provider, actor, next(versions), model_revision="bench",
                                                           engine_revision="bench", dtype=dtype))

                rows["dist, remote (stage + broadcast + commit)"] = best(dist, args.repeat)
                dist_eng.close()
                log("raw gloo broadcast of the same bytes")
                rows["limit: gloo broadcast of the bytes, remote"] = raw_broadcast(addr, nbytes, args.repeat)
            request(eng.address, {"op": "shutdown"}, 30)
        finally:
            if server.poll() is None:
                server.kill()
            server.wait(timeout=30)
    log("dist, in-process")
    local = NativeEngine(provider, dtype=dtype, device=dev, eos_id=0, pad_id=0, model_revision="bench",
                         engine_revision="bench")
    rows["dist, in-process (stage + hand-off + commit)"] = best(
        lambda: local.load_staged(publication.stage(provider, actor, next(versions), model_revision="bench",
                                                    engine_revision="bench", dtype=dtype)), args.repeat)
    stage_only = best(lambda: publication.stage(provider, actor, next(versions), model_revision="bench",
                                                engine_revision="bench", dtype=dtype), args.repeat)
    rows["part: stage alone (export + digest)"] = stage_only
    # what stage digests: the tensors where the actor is (device=None); the default export goes to
    # the host for a file, and its digest there is the CPU path (the 1.79 s row of 2026-12-04)
    exported = provider.export_state(actor, dtype=dtype, device=None)[0]
    rows["part: version digest alone (on the tensors' device)"] = best(lambda: publication.tensors_digest(exported),
                                                                      args.repeat)
    staged = publication.stage(provider, actor, next(versions), model_revision="bench", engine_revision="bench",
                               dtype=dtype)

    def build() -> None:  # what load_staged does after the digest: the engine's model from the tensors
        local.serve(provider.load("bench", dtype=dtype, device=dev, tensors=staged.tensors, config=staged.config),
                    staged.manifest.version, staged.manifest.digest)
        sync(dev)

    rows["part: engine build from the tensors (load + serve)"] = best(build, args.repeat)
    exported.clear()  # the copies' memory back before the copy limits below
    staged.tensors.clear()
    state = [p.detach().to(dtype) for p in actor.state_dict().values()]
    rows["limit: in-memory copy of the bytes"] = best(lambda: synced(dev, [t.clone() for t in state]), args.repeat)
    if dev != "cpu":
        rows["limit: device-to-host copy of the bytes"] = best(lambda: synced(dev, [t.cpu() for t in state]),
                                                               args.repeat)
    base = rows["shared-dir, remote (write + server load)"]
    print(f"{args.kind} ({args.size}): {nbytes / 1e6:.1f} MB of {args.dtype} tensors on {dev}, "
          f"bucket {args.bucket_mb:g} MiB, "
          f"{torch.get_num_threads()} threads, best of {args.repeat}\n")
    print("| path | seconds | GB/s | vs shared-dir |")
    print("| --- | ---: | ---: | ---: |")
    for name, t in rows.items():
        print(f"| {name} | {t:.3f} | {gb / t:.2f} | {base / t:.1f}x |")
    if args.json:
        write_json(args.json, {"bench": "weight_sync", "command": sys.argv, "kind": args.kind, "size": args.size,
                               "bytes": nbytes, "bucket_mb": args.bucket_mb, "weight_sync_s": rows,
                               "device": dev, "dtype": args.dtype, "machine": environment(dev),
                               "date": datetime.date.today().isoformat()})
    return 0


def synced(device: str, out: object) -> object:
    """``out``, after the device finished making it (:func:`common.sync`)."""
    sync(device)
    return out


def raw_broadcast(addr: Path, nbytes: int, repeat: int) -> float:
    """One gloo broadcast of ``nbytes`` into a helper process: the bytes-on-the-wire limit."""
    import datetime as dt

    import torch.distributed as tdist

    store = tdist.TCPStore("127.0.0.1", 0, 2, True, timeout=dt.timedelta(seconds=120), wait_for_workers=False)
    code = ("import sys, datetime, torch, torch.distributed as d\n"
            "from hobson.rollout.transport import weight_group, broadcast\n"
            f"s = d.TCPStore('127.0.0.1', {store.port}, 2, False, timeout=datetime.timedelta(seconds=120))\n"
            "g = weight_group('gloo', s, 1, 2, 120, 'bench')\n"
            f"buf = torch.empty({nbytes}, dtype=torch.uint8)\n"
            f"for _ in range({repeat}): broadcast(g, buf)\n")
    peer = subprocess.Popen([sys.executable, "-c", code])
    group = weight_group("gloo", store, 0, 2, 120, "bench")
    buf = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        broadcast(group, buf)
        times.append(time.perf_counter() - t0)
    peer.wait(timeout=120)
    return min(times)


if __name__ == "__main__":
    sys.exit(main())
