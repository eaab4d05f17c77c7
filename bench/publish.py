"""Publication throughput: publish a policy version and load it into the native engine, against a
raw file copy of the same bytes.

    python bench/publish.py [--kind nanbeige|huginn_raven] [--size small|tiny] [--repeat 3]

"publish" is everything the trainer does for a version (export under the native names, index,
SHA-256 digest, manifest, fsync, rename); "load" is everything the engine does before it commits
(manifest checks, digest of the bytes read, provider load with its checks, digest of the loaded
tensors); "raw copy" copies the version's safetensors bytes and fsyncs them. GB/s counts the
safetensors bytes. Each figure is the best of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
from common import best

from hobson.models import get_provider, tiny_config
from hobson.rollout import publication
from hobson.rollout.engine import NativeEngine

SIZES = {
    # ~0.4 GB fp32: big enough that disk and hashing dominate, small enough for a CPU box
    "small": {
        "nanbeige": dict(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=32000,
        ),
        "huginn_raven": dict(
            n_embd=1024,
            n_heads=16,
            intermediate_size=2816,
            vocab_size=32000,
            n_layers_in_prelude=2,
            n_layers_in_recurrent_block=4,
            n_layers_in_coda=2,
            block_size=4096,
        ),
    },
    "tiny": {"nanbeige": {}, "huginn_raven": {}},
}


def parse_args(doc: str) -> argparse.Namespace:
    """The options of the disk benchmarks (this one and bench/checkpoint.py)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", default="nanbeige", choices=["nanbeige", "huginn_raven"])
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    return p.parse_args()


def main() -> None:
    args = parse_args(__doc__)
    cfg = tiny_config(args.kind, **SIZES[args.size][args.kind])
    provider = get_provider(cfg)
    actor = provider.build_actor(cfg, seed=0)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = os.path.join(tmp, "publications")
        version = iter(range(1_000_000))

        def do_publish() -> None:
            publication.publish(
                provider,
                actor,
                root,
                next(version),
                model_revision="bench",
                engine_revision="bench",
                dtype=torch.float32,
            )

        t_pub = best(do_publish, args.repeat)
        last = publication.version_dir(root, 0)
        nbytes = sum(os.path.getsize(os.path.join(last, f)) for f in os.listdir(last) if f.endswith(".safetensors"))
        engine = NativeEngine(
            provider,
            dtype=torch.float32,
            device="cpu",
            eos_id=0,
            pad_id=0,
            model_revision="bench",
            engine_revision="bench",
        )
        t_load = best(lambda: engine.load_publication(last), args.repeat)

        def do_copy() -> None:
            dst = os.path.join(tmp, f"copy-{time.perf_counter_ns()}")
            os.makedirs(dst)
            for f in os.listdir(last):
                if f.endswith(".safetensors"):
                    shutil.copyfile(os.path.join(last, f), os.path.join(dst, f))
                    with open(os.path.join(dst, f), "rb") as fh:
                        os.fsync(fh.fileno())

        t_copy = best(do_copy, args.repeat)
    gb = nbytes / 1e9
    print(
        f"{args.kind} ({args.size}): {sum(t.numel() for t in actor.parameters()):,} parameters, "
        f"{nbytes / 1e6:.1f} MB of safetensors, best of {args.repeat}"
    )
    print(f"{'operation':<28}{'seconds':>10}{'GB/s':>10}")
    for name, t in (
        ("publish (export+digest)", t_pub),
        ("load (verify+load+digest)", t_load),
        ("raw file copy + fsync", t_copy),
    ):
        print(f"{name:<28}{t:>10.3f}{gb / t:>10.3f}")


if __name__ == "__main__":
    main()
