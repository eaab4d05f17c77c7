"""RL checkpoint write: what ``hobson.rl.checkpoint.save_checkpoint`` writes now against the plain
way (the actor to its own safetensors file, the trainer state through a default ``torch.save``,
which computes a CRC-32 of every record), and against a raw copy of the same bytes.

    python bench/checkpoint.py [--kind nanbeige|huginn_raven] [--size small|tiny] [--repeat 3] [--dir D]

The trainer state is an Adam optimizer's (two fp32 tensors per parameter, like DeepSpeed's fp32
masters and moments), so the state is about twice the actor. "now" writes no actor file: the
actor's bytes are the publication of the same version, which the RL loop writes anyway. Every
write is fsynced. Each figure is the best of ``--repeat`` runs.

"background" is what the RL loop does by default: the update waits only while ``capture`` copies
the checkpoint (on the training device), and a thread writes the copy while the next update runs.
Its first row is that wait; its second is the whole write, from the capture to the fsynced rename.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch
from publish import SIZES, parse_args
from safetensors.torch import save_file

from hobson import rng
from hobson.io import fsync_files
from hobson.models import get_provider, tiny_config
from hobson.rl import checkpoint as ckpt


def main() -> None:
    args = parse_args(__doc__)
    cfg = tiny_config(args.kind, **SIZES[args.size][args.kind])
    actor = get_provider(cfg).build_actor(cfg, seed=0)
    opt = torch.optim.Adam(actor.parameters(), lr=1e-4)
    for q in actor.parameters():
        q.grad = torch.ones_like(q)
    opt.step()
    state = {"actor_trainer": opt.state_dict(), "data_cursor": 0, "version": 1, "digest": "bench"}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:

        def plain(d: str) -> None:
            os.makedirs(d)
            save_file(ckpt.module_tensors(actor), os.path.join(d, "actor.safetensors"))
            torch.save({**state, "rng": rng.capture()}, os.path.join(d, "state.pt"))
            fsync_files(d)

        def now(d: str) -> None:
            ckpt.save_checkpoint(d, 1, actor=actor, critic=None, state=state,
                                 actor_publication="publications/v000001")

        waits: list[float] = []

        def background(d: str) -> None:
            t0 = time.perf_counter()
            writer = ckpt.CheckpointWriter(d)
            writer.submit(1, ckpt.capture(1, actor=actor, critic=None, state=state,
                                          actor_publication="publications/v000001"))
            waits.append(time.perf_counter() - t0)
            writer.wait()

        def copy(d: str) -> None:
            os.makedirs(d)
            for f in os.listdir(src):
                shutil.copyfile(os.path.join(src, f), os.path.join(d, f))
            fsync_files(d)

        def timed(fn, keep: bool = False) -> tuple[float, int]:
            """Best seconds of ``--repeat`` writes, and the bytes written; each output is removed
            (untimed) before the next, so the page cache and disk see one copy at a time."""
            times, nbytes = [], 0
            for i in range(args.repeat):
                d = os.path.join(tmp, f"{fn.__name__}-{i}")
                t0 = time.perf_counter()
                fn(d)
                times.append(time.perf_counter() - t0)
                nbytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
                if not (keep and i == args.repeat - 1):
                    shutil.rmtree(d)
            return min(times), nbytes

        torch.serialization.set_crc32_options(True)  # torch's default, for the plain way
        t_plain, plain_bytes = timed(plain, keep=True)
        src = os.path.join(tmp, f"plain-{args.repeat - 1}")
        t_now, now_bytes = timed(now)
        t_bg, _ = timed(background)
        t_copy, _ = timed(copy)
    print(f"{args.kind} ({args.size}): {sum(t.numel() for t in actor.parameters()):,} parameters, "
          f"Adam state, best of {args.repeat}")
    print(f"{'write':<44}{'MB':>9}{'seconds':>10}{'GB/s':>8}{'x plain':>9}")
    for name, t, b in (
        ("plain: actor file + torch.save (CRC-32)", t_plain, plain_bytes),
        ("now: actor in publication, no CRC-32", t_now, now_bytes),
        ("background: the update waits (capture)", min(waits), now_bytes),
        ("background: capture + write in a thread", t_bg, now_bytes),
        ("raw copy + fsync of the plain bytes", t_copy, plain_bytes),
    ):
        print(f"{name:<44}{b / 1e6:>9.1f}{t:>10.3f}{b / 1e9 / t:>8.3f}{t_plain / t:>9.2f}")


if __name__ == "__main__":
    main()
