"""RL checkpoint write: what ``hobson.rl.checkpoint`` writes now against the plain way a user would
write the same state, against what hobson wrote before (session 15), and against a raw copy.

    python bench/checkpoint.py [--kind nanbeige|huginn_raven] [--size tiny|small|official]
                               [--device cpu|cuda] [--critic] [--repeat 3] [--dir D] [--json F]

Every row writes the same content: the actor's weights (and with ``--critic`` a critic of the
same shape, as PPO has) and a trainer state holding an Adam optimizer's two fp32 moments per
parameter (the bulk of DeepSpeed's fp32 masters and moments). Every write is fsynced.

- plain: ``safetensors.torch.save_file`` per model and ``torch.save`` of the state (CRC-32 on,
  torch's default) and no manifest: what a user would otherwise write.
- before: hobson until session 15: the same two writers (each GPU tensor first copied whole to
  pageable host memory), CRC-32 off, then one SHA-256 per file on one core for the manifest.
- now: ``save_checkpoint``: every tensor (the state's too) through ``hobson.tensorfile`` threads,
  GPU pieces through pinned staging, the manifest hashed as 256 MiB chunks on all cores.
- background: what the RL loop does by default: the update waits only for ``capture`` (a copy
  on the training device), then a thread writes it; the second row is capture to fsynced rename.
- load: what a resume does with the last "before" and "now" checkpoints: verify every byte
  against the manifest, then read the state (its tensors back on ``--device``) and the weights.

Each figure is the best of ``--repeat``; outputs are removed (untimed) between writes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import commit, environment, log, write_json
from publish import SIZES
from rl_gpu import config_for, random_model
from safetensors.torch import load_file, save_file

from hobson import rng
from hobson.io import atomic_dir, fsync_files, sha256_file
from hobson.models import get_provider, tiny_config
from hobson.rl import checkpoint as ckpt


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="nanbeige", choices=["nanbeige", "huginn_raven"])
    p.add_argument("--size", default="small", choices=[*sorted(SIZES), "official"])
    p.add_argument("--device", default="cpu", help="where the model and optimizer live (cpu, cuda)")
    p.add_argument("--critic", action="store_true", help="a critic of the actor's shape too (PPO)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the table here as JSON")
    return p.parse_args()


def build(kind: str, size: str, device: str) -> torch.nn.Module:
    if size == "official":  # random weights drawn on the device, as the RL bench draws them
        return random_model(kind, config_for(kind, "official"), torch.float32, device)
    small = tiny_config(kind, **SIZES[size][kind])
    return get_provider(small).build_actor(small, seed=0).to(device)


def adam_state(model: torch.nn.Module) -> dict:
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for q in model.parameters():
        q.grad = torch.ones_like(q)
    opt.step()
    for q in model.parameters():
        q.grad = None
    return opt.state_dict()


def main() -> None:
    args = parse_args()
    actor = build(args.kind, args.size, args.device)
    critic = build(args.kind, args.size, args.device) if args.critic else None
    state = {"actor_trainer": adam_state(actor), "data_cursor": 0, "version": 1, "digest": "bench"}
    if critic is not None:
        state["critic_trainer"] = adam_state(critic)
    log(f"built on {args.device}")

    def models() -> dict[str, torch.nn.Module]:
        return {"actor": actor, **({"critic": critic} if critic is not None else {})}

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:

        def plain(d: str) -> None:
            os.makedirs(d)
            for name, m in models().items():
                save_file({k: v.detach().cpu().contiguous() for k, v in m.state_dict().items()},
                          os.path.join(d, f"{name}.safetensors"))
            torch.save({**state, "rng": rng.capture()}, os.path.join(d, "state.pt"))
            fsync_files(d)

        def before(d: str) -> None:
            with atomic_dir(d) as t:
                for name, m in models().items():
                    save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in m.state_dict().items()},
                              str(t / f"{name}.safetensors"))
                with ckpt._without_crc32():
                    torch.save({**state, "rng": rng.capture(), "format": 2}, t / "state.pt")
                files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(t.iterdir())}
                (t / "manifest.json").write_text(json.dumps({"files": files}))

        def now(d: str) -> None:
            ckpt.save_checkpoint(d, 1, actor=actor, critic=critic, state=state)

        waits: list[float] = []

        def background(d: str) -> None:
            t0 = time.perf_counter()
            writer = ckpt.CheckpointWriter(d)
            writer.submit(1, ckpt.capture(1, actor=actor, critic=critic, state=state))
            waits.append(time.perf_counter() - t0)
            writer.wait()

        def copy(d: str) -> None:
            os.makedirs(d)
            for f in os.listdir(src):
                shutil.copyfile(os.path.join(src, f), os.path.join(d, f))
            fsync_files(d)

        def timed(fn, keep: bool = False) -> tuple[float, int]:
            times, nbytes = [], 0
            for i in range(args.repeat):
                d = os.path.join(tmp, f"{fn.__name__}-{i}")
                t0 = time.perf_counter()
                fn(d)
                times.append(time.perf_counter() - t0)
                nbytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
                if not (keep and i == args.repeat - 1):
                    shutil.rmtree(d)
            log(f"{fn.__name__}: {min(times):.2f} s")
            return min(times), nbytes

        def load_before(d: str) -> None:
            """The resume's read as before: one SHA-256 per file on one core, then torch.load."""
            files = json.loads((Path(d) / "manifest.json").read_text())["files"]
            for name, want in files.items():
                assert sha256_file(os.path.join(d, name)) == want["sha256"], name
            torch.load(os.path.join(d, "state.pt"), weights_only=False)
            for name in models():
                load_file(os.path.join(d, f"{name}.safetensors"))

        def loaded(fn, d: str) -> float:
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                fn(d)
                times.append(time.perf_counter() - t0)
            log(f"{fn.__name__}: {min(times):.2f} s")
            return min(times)

        torch.serialization.set_crc32_options(True)  # torch's default, for the plain way
        t_plain, plain_bytes = timed(plain, keep=True)
        src = os.path.join(tmp, f"plain-{args.repeat - 1}")
        t_before, before_bytes = timed(before, keep=True)
        t_load_before = loaded(load_before, os.path.join(tmp, f"before-{args.repeat - 1}"))
        shutil.rmtree(os.path.join(tmp, f"before-{args.repeat - 1}"))
        t_now, now_bytes = timed(now, keep=True)
        def load_now(d: str) -> None:
            ckpt.load_checkpoint(ckpt.checkpoint_dir(d, 1))

        t_load_now = loaded(load_now, os.path.join(tmp, f"now-{args.repeat - 1}"))
        shutil.rmtree(os.path.join(tmp, f"now-{args.repeat - 1}"))
        t_bg, _ = timed(background)
        t_copy, _ = timed(copy)
    params = sum(t.numel() for t in actor.parameters())
    print(f"{args.kind} ({args.size}, {args.device}{', critic' if critic is not None else ''}): "
          f"{params:,} parameters per model, Adam state, best of {args.repeat}")
    print(f"{'write':<44}{'MB':>9}{'seconds':>10}{'GB/s':>8}{'x plain':>9}{'x before':>10}")
    rows = []
    for name, t, b in (
        ("plain: save_file + torch.save (CRC-32)", t_plain, plain_bytes),
        ("before: + no CRC-32, serial sha256", t_before, before_bytes),
        ("now: threaded tensorfile, chunked sha256", t_now, now_bytes),
        ("background: the update waits (capture)", min(waits), now_bytes),
        ("background: capture + write in a thread", t_bg, now_bytes),
        ("raw copy + fsync of the plain bytes", t_copy, plain_bytes),
    ):
        print(f"{name:<44}{b / 1e6:>9.1f}{t:>10.3f}{b / 1e9 / t:>8.3f}{t_plain / t:>9.2f}{t_before / t:>10.2f}")
        rows.append({"write": name, "bytes": b, "seconds": t, "x_plain": t_plain / t, "x_before": t_before / t})
    # the resume's side: verify every byte against the manifest, then read (from the page cache)
    print(f"{'load (verify + read, page cache)':<44}{'MB':>9}{'seconds':>10}{'GB/s':>8}{'':>9}{'x before':>10}")
    for name, t, b in (
        ("load before: serial sha256 + torch.load", t_load_before, before_bytes),
        ("load now: chunked verify + safetensors", t_load_now, now_bytes),
    ):
        print(f"{name:<44}{b / 1e6:>9.1f}{t:>10.3f}{b / 1e9 / t:>8.3f}{'':>9}{t_load_before / t:>10.2f}")
        rows.append({"load": name, "bytes": b, "seconds": t, "x_before": t_load_before / t})
    if args.json:
        write_json(args.json, {"args": vars(args), "commit": commit(), "environment": environment(args.device),
                               "parameters": params, "rows": rows})


if __name__ == "__main__":
    main()
