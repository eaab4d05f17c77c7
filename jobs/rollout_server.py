"""The rollout server of an RL run: component 1 of the heterogeneous job (see sbatch/rl_common.sh).

    python -m jobs.rollout_server --address-file runs/x/engine/address-77.json --device cuda:0
    python -m jobs.rollout_server --wait --address-file F --timeout 600 --watch-pid 1234
    python -m jobs.rollout_server --ping --address-file F

Serving: listens on the address its advertised host resolves to, makes (or reads) the job's secret
(mode 0600, --secret-file), writes its address atomically to --address-file, serves ping / configure /
load_publication / generate / shutdown (hobson.rollout.server) until the trainer (python -m jobs.rl
--engine-address-file F) sends shutdown. --wait: return once the address file exists and the
server answers a real ping (not a sleep), failing after --timeout seconds or as soon as process
--watch-pid has exited. --ping: one readiness request, exit 0 if answered. Every request carries
the secret named in the address file; the server refuses one without it.

Exit codes: 0 served and shut down / ready / answered, 1 not ready, no answer or bad flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hobson.errors import HobsonError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jobs.rollout_server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--address-file", required=True,
                   help="JSON file the server writes its address to; {index} in it: the server's index "
                        "(--index, else $SLURM_PROCID)")
    p.add_argument("--index", type=int, default=None,
                   help="this server's index among the job's (default $SLURM_PROCID, else 0)")
    p.add_argument("--servers", type=int, default=1, help="--wait/--ping: how many servers {index} counts (default 1)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--wait", action="store_true", help="wait for the server to be ready instead of serving")
    mode.add_argument("--ping", action="store_true", help="send one readiness request instead of serving")
    p.add_argument("--device", default="cpu", help="rollout device when serving (cpu, cuda, cuda:1); default cpu")
    p.add_argument("--bind", default=None,
                   help="address to listen on when serving (default: the address the advertised host resolves to)")
    p.add_argument("--port", type=int, default=0, help="port to listen on (default 0: any free port)")
    p.add_argument("--advertise", default=None,
                   help="host name written to the address file (default $SLURMD_NODENAME, else the host name)")
    p.add_argument("--secret-file", default=None,
                   help="the job's secret (mode 0600; made if absent); default: the address file with suffix .secret")
    p.add_argument("--timeout", type=float, default=600.0, help="--wait/--ping deadline in seconds (default 600)")
    p.add_argument("--watch-pid", type=int, default=None,
                   help="--wait fails as soon as this process (the server's srun) has exited")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.wait or args.ping:
            from hobson.rollout.transport import address_files, wait_ready

            for f in address_files(args.address_file, args.servers):
                answer = wait_ready(f, args.timeout, None if args.ping else args.watch_pid)
                print(json.dumps({k: answer[k] for k in ("node", "pid", "configured", "version")}), flush=True)
            return 0
        from hobson.rollout.server import serve

        code = serve(args.address_file, device=args.device, bind=args.bind, port=args.port,
                     advertise=args.advertise, secret_file=args.secret_file, index=args.index)
        # Everything is done (answered, address file removed). Leave without the interpreter's
        # teardown: a daemon thread (a request handler, torch's pools) still running while the
        # runtime is destroyed ends the process in "terminate called without an active
        # exception" (SIGABRT) now and then, and the job would see a failed server.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    except HobsonError as e:
        print(f"rollout_server: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
