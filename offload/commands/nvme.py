"""`offload bench nvme`, `offload tune nvme` and `offload clean`: the NVMe swap, measured, listed and tidied."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from offload.flags import size_arg
from offload.recipe import DEFAULT_SWAP_DIR
from offload.swap import clean, list_runs
from offload.swap.backends import BACKENDS
from offload.swap.measure import aio_section, format_table, measure, parse_size, ring_bytes, sweep, sweep_configs
from offload.swap.store import DEFAULT_BLOCK_BYTES, DEFAULT_CHECKSUM, DEFAULT_QUEUE_DEPTH, DEFAULT_THREADS


def _nested(subparsers, name: str, help: str):
    """The sub-subcommand group `offload <name> ...`, created once and shared by modules."""
    parser = subparsers.choices.get(name)
    if parser is None:
        parser = subparsers.add_parser(name, help=help)
        parser._offload_targets = parser.add_subparsers(dest="target", metavar="TARGET",
                                                        parser_class=type(parser))
        parser._offload_targets.required = True
    return parser._offload_targets


def _checksum_flags(p) -> None:
    p.add_argument("--checksum", dest="checksum", action="store_true", default=DEFAULT_CHECKSUM,
                   help=f"checksum per block, verified on read (default: {'on' if DEFAULT_CHECKSUM else 'off'})")
    p.add_argument("--no-checksum", dest="checksum", action="store_false", help="skip the checksum")


def register(subparsers) -> None:
    bench = _nested(subparsers, "bench", "measure how fast an NVMe drive swaps").add_parser(
        "nvme", help="swap write/read bandwidth through the swap store (page cache bypassed)",
        description="Writes --size bytes into --dir through the swap store, then reads them back, and prints GB/s. "
                    "The bytes move through a ring of host memory of two keys of one full I/O queue each "
                    "(block bytes x queue depth, at most 256 MiB per key), not --size of RAM. Columns: `task` "
                    "runs from the first request submitted to the last completed (the drive through our I/O "
                    "queue: what the I/O bound of a training step uses); `e2e` adds opening the store (run "
                    "directory, O_DIRECT probe, engine start, the warm-up write) before the write and closing it "
                    "(removing the files) after the read.")
    bench.add_argument("--dir", default=DEFAULT_SWAP_DIR,
                       help="directory on the drive to measure (a run subdirectory is created in it and removed "
                            "afterwards; default %(default)s, where `offload train` swaps)")
    bench.add_argument("--size", default="1G", help="bytes to write then read, e.g. 4G (default 1G)")
    bench.add_argument("--engine", choices=BACKENDS, default="auto")
    bench.add_argument("--block-bytes", type=size_arg, default=DEFAULT_BLOCK_BYTES, metavar="SIZE",
                       help=f"bytes per I/O request (default {DEFAULT_BLOCK_BYTES >> 20}M, as training's aio.block_bytes)")
    bench.add_argument("--queue-depth", type=int, default=DEFAULT_QUEUE_DEPTH)
    bench.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    _checksum_flags(bench)
    bench.add_argument("--no-warmup", dest="warmup", action="store_false",
                       help="time the first write into fresh blocks instead of the rewrite in place")
    bench.add_argument("--json", action="store_true", help="also print one JSON object as the last line")
    bench.set_defaults(func=run_bench)

    tune = _nested(subparsers, "tune", "find the best I/O settings for an NVMe drive").add_parser(
        "nvme", help="sweep block size x queue depth x threads for both engines; print the best `aio` section")
    tune.add_argument("--dir", default=DEFAULT_SWAP_DIR,
                      help="directory on the drive to measure (default %(default)s, where `offload train` swaps)")
    tune.add_argument("--size", default="512M", help="bytes per configuration (default 512M)")
    tune.add_argument("--engines", default="libaio,threads", help="comma-separated (default libaio,threads)")
    tune.add_argument("--plot", default="offload-tune-nvme.png", help="PNG of the sweep (default %(default)s)")
    _checksum_flags(tune)
    tune.add_argument("--json", action="store_true")
    tune.set_defaults(func=run_tune)

    cl = subparsers.add_parser(
        "clean", help="list swap runs, or remove the run directories of processes that are gone",
        description="A run's swap data file has no name (it does not show in ls or du, and its bytes go when "
                    "its process ends, however it ends); its run directory keeps owner.json (pid, bytes) so "
                    "you can see what is running. `--list` shows the runs and their bytes; without it, the "
                    "directories of ended processes (and the named data.bin files of earlier versions) are "
                    "removed.")
    cl.add_argument("dir", nargs="?", default=DEFAULT_SWAP_DIR,
                    help="the swap directory (nvme_path; default %(default)s, where `offload train` swaps)")
    cl.add_argument("--list", action="store_true", help="show live and stale runs with their bytes; remove nothing")
    cl.add_argument("--force", action="store_true", help="also remove runs whose process is still alive")
    cl.add_argument("--dry-run", action="store_true", help="list what would be removed")
    cl.add_argument("--json", action="store_true")
    cl.set_defaults(func=run_clean)


def _log_to_stderr() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


def run_bench(args: argparse.Namespace) -> int:
    _log_to_stderr()
    size = parse_size(args.size)
    _check_host_memory(ring_bytes(size, args.block_bytes, args.queue_depth, args.threads), "--block-bytes/--queue-depth")
    r = measure(args.dir, size, engine=args.engine, block_bytes=args.block_bytes,
                queue_depth=args.queue_depth, threads=args.threads, checksum=args.checksum, warmup=args.warmup)
    print(format_table(r))
    if args.json:
        print(json.dumps(r))
    return 0


def _check_host_memory(nbytes: int, knobs: str) -> None:
    """The bench's ring of host memory ([Note: bounded host memory] in swap/measure.py) must fit in RAM."""
    from offload.swap import hostmem

    avail = hostmem.available()
    if nbytes > avail // 2:
        raise ValueError(f"{knobs}: the bench would hold {nbytes / 2**20:.0f} MiB of host memory, more than half "
                         f"of the {avail / 2**20:.0f} MiB available; use smaller blocks or a lower queue depth")


def run_tune(args: argparse.Namespace) -> int:
    _log_to_stderr()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ("libaio", "threads"):
            raise ValueError(f"--engines={args.engines}: unknown engine {e!r}; use libaio and/or threads")
    size = parse_size(args.size)
    print(f"{'engine':8} {'block':>9} {'qd':>4} {'thr':>4} {'write GB/s':>11} {'read GB/s':>10}")

    def progress(_, r):
        print(f"{r['engine']:8} {r['block_bytes']:9d} {r['queue_depth']:4d} {r['threads']:4d} "
              f"{r['write_gbps']:11.2f} {r['read_gbps']:10.2f}", flush=True)

    results, best = sweep(args.dir, size, sweep_configs(engines), checksum=args.checksum, progress=progress)
    plot = _plot(results, args.plot)
    section = aio_section(best)
    print(f"best (shortest write + read): write {best['write_gbps']:.2f} GB/s, read {best['read_gbps']:.2f} GB/s")
    print(json.dumps({"aio": section}, indent=2))
    if plot:
        print(f"plot: {plot}")
    if args.json:
        print(json.dumps({"aio": section, "write_gbps": best["write_gbps"], "read_gbps": best["read_gbps"],
                          "size_bytes": size, "plot": plot, "results": results}))
    return 0


def _plot(results: list[dict], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.getLogger("swap").warning("tune: matplotlib missing, no plot (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, op in zip(axes, ("write", "read")):
        series: dict[str, list] = {}
        for r in results:
            knob = f"qd {r['queue_depth']}" if r["engine"] == "libaio" else f"{r['threads']} threads"
            series.setdefault(f"{r['engine']}, {knob}", []).append((r["block_bytes"] >> 10, r[f"{op}_gbps"]))
        for label, pts in series.items():
            ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (KiB)")
        ax.set_title(f"{op}")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s (1e9 B/s)")
    axes[1].legend(fontsize=7)
    fig.suptitle("offload tune nvme")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _mib(nbytes: int | None) -> str:
    return "?" if nbytes is None else f"{nbytes / 2**20:.1f} MiB"


def list_swap_runs(args: argparse.Namespace) -> int:
    """`offload clean --list`: each run with its state, pid and bytes (owner.json's figure for a live
    run's unlinked file; what named files an earlier version left)."""
    runs = list_runs(args.dir)
    for r in runs:
        state = "live" if r.alive else "stale"
        held = f"swap {_mib(r.swap_bytes)}" if r.alive else "swap freed"
        named = f", named files {_mib(r.named_bytes)}" if r.named_bytes else ""
        print(f"{state:5} pid {r.pid} host {r.host}  {held}{named}  {r.path}")
    if not runs:
        print(f"no swap run directories in {args.dir}")
    live = sum(r.swap_bytes or 0 for r in runs if r.alive)
    print(f"live runs: {sum(r.alive for r in runs)}, holding {_mib(live)} of swap in {args.dir}")
    if args.json:
        print(json.dumps({"runs": [{"path": str(r.path), "pid": r.pid, "host": r.host, "alive": r.alive,
                                    "swap_bytes": r.swap_bytes, "named_bytes": r.named_bytes} for r in runs]}))
    return 0


def run_clean(args: argparse.Namespace) -> int:
    if args.list:
        return list_swap_runs(args)
    runs = list_runs(args.dir)
    if args.dry_run:
        targets = [r for r in runs if r.stale or args.force]
        removed = []
    else:
        targets = removed = clean(args.dir, force=args.force)
    for r in runs:
        state = "stale" if r.stale else "live"
        verb = ("would remove" if args.dry_run else "removed") if r in targets else "kept"
        print(f"{verb:12} {state:5} pid {r.pid} host {r.host}  {r.path}")
    if not runs:
        print(f"no swap run directories in {args.dir}")
    if args.json:
        print(json.dumps({"removed": [str(r.path) for r in removed], "would_remove": [str(r.path) for r in targets]
                          if args.dry_run else [], "kept": [str(r.path) for r in runs if r not in targets]}))
    return 0
