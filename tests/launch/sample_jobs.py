"""A small real job for backend tests: writes what it was given and what it saw of its environment."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from hobson.io import atomic_write, write_json_atomic


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shard", type=int, default=None)
    p.add_argument("--fail-shard", type=int, default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--terminated-while-writing", action="store_true",
                   help="SIGTERM this process halfway through writing --out (as scancel would)")
    a = p.parse_args(argv)
    if a.terminated_while_writing:
        with atomic_write(a.out) as f:
            f.write('{"half": ')
            f.flush()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # the handler raises before this ends
    time.sleep(a.sleep)
    if a.shard is not None and a.shard == a.fail_shard and not os.path.exists(a.out + ".allow"):
        print(f"injected failure in shard {a.shard}", file=sys.stderr)
        return 7
    import torch

    write_json_atomic(a.out, {
        "shard": a.shard, "task": os.environ.get("HOBSON_ARRAY_TASK"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "omp": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
        "triton_autotune_cache": os.environ.get("TRITON_CACHE_AUTOTUNING"),
        "slurm_leak": sorted(k for k in os.environ if k.startswith("SLURM_") and k != "SLURM_CONF"),
        "t": time.time(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
