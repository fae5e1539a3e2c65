"""`offload doctor [--json]`: the host measured, each failed probe one line with its fix (offload/doctor.py)."""

from __future__ import annotations

import json

from offload.recipe import DEFAULT_SWAP_DIR


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="check and measure this host: versions, devices, matmul GFLOP/s, memory and swap bandwidth, "
                       "libaio, O_DIRECT, the CPU Adam kernel, the precision auto picks",
        description="Measures this host in about 10 s: what `offload train` and the benches run on. Each check "
                    "that needs attention says what to do on the same line. The exit code is 0 whatever it finds.")
    p.add_argument("--nvme-path", default=DEFAULT_SWAP_DIR, metavar="DIR",
                   help="the swap directory to probe (O_DIRECT, a short swap write/read; default %(default)s)")
    p.add_argument("--build", action="store_true",
                   help="build the CPU Adam kernel if it is not cached yet (about 25 s once) and report its build time")
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last line")
    p.set_defaults(func=run)


def run(args) -> int:
    from offload import doctor

    report = doctor.run(args.nvme_path, build=args.build)
    print(doctor.table(report), flush=True)
    if args.json:
        print(json.dumps(report), flush=True)
    return 0
