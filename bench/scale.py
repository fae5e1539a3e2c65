"""A model larger than memory, weights and optimizer states on nvme: ours, and DeepSpeed beside it.

Ours runs in a subprocess: the model is built on the meta device (offload.recipe.build: a preset, or a
Hugging Face directory whose weights stream from its safetensors), offload.initialize is timed (init_s),
and it trains --steps steps of --batch x --seq tokens, reporting each step's time, loss and bytes per link
(engine.stats()["last_step"]["links"]). DeepSpeed ZeRO-3 with NVMe offload of both then trains the same
model and batches (bench/ds_e2e.py --zero-init in the DeepSpeed venv, found as bench/e2e.py finds it:
--ds-python, else $OFFLOAD_DS_PYTHON, else /work/dsvenv/bin/python); it may crash, and the report says
what it did: steps completed, the error line, peak RSS. DeepSpeed builds the model inside zero.Init, its
way for a model larger than memory, so its weights are its own draw (a HF directory: from config.json,
which needs transformers in the DeepSpeed venv); both train on the same byte-id batches.

Peak RSS is sampled by this process every 0.2 s over the worker and its children (DeepSpeed's JIT
builds count, on a first run before its op cache is warm). The I/O bound of a step is
bench/iobound.py's: the step's nvme bytes over the swap bandwidth `offload bench nvme` measures in
the same --dir, before and after ours' run (the mean of the two: the drive's speed drifts on a shared host;
both are reported). That probe moves a few GB just written, at rates a drive may not hold over a step's
tens of GB: after its last step ours also sends that step's swap requests again with nothing else running
(io_replay_s, bench/iobound.py's replay; --no-replay skips it), the step's I/O bound on this drive as it is
then. Everything goes into one new directory under --dir, removed at the end.
Ours and DeepSpeed run at --precision (default auto: what the engine picks on this host); beside io_bound_s
the JSON has precision, matmul_gflops (that dtype's F.linear speed measured in this run) and
compute_floor_s = 6 x params x tokens / matmul_gflops (bench/limits.py), next to compute_bound_s (the same
model's forward+backward in memory plus CPU Adam, measured). Each of ours' steps has a profile from its
timeline (profile(): forward, backward, compute stalls, CPU Adam, the drive idle) and the CPU time the
process used in it (cpu_s, every thread: a step near cpu_count() x its time is CPU-bound); --trace saves the last
step's timeline.

python bench/scale.py [--model 3b|PRESET|smollm2|HF_DIR] [--steps 20] [--batch 1] [--seq 256] --dir DIR
                      [--io-size 2G] [--precision auto|bf16|fp16|fp32] [--ds-python PATH] [--no-deepspeed]
                      [--trace PATH] [--no-replay] [--json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import iobound  # bench/, this script's directory, is first on sys.path
import limits
from e2e import REPO, add_engine_config_argument, default_ds_python, worker_env
from offload.report import Periodic



def worker(args) -> None:
    """In the subprocess: a JSON line after initialize, one per step, one at the end, as they happen."""
    import offload
    from offload.plan.config import load_config
    from offload.kernels.cpu_adam import kernel_backend
    from offload.data import BatchSampler, load_tokens
    from offload.models import loss_of
    from offload.recipe import build

    cfg = load_config({"precision": args.precision, "offload_param": {"device": "nvme"},
                       "offload_optimizer": {"device": "nvme"}, "nvme_path": args.dir,
                       "optimizer": {"lr": 1e-4}, **json.loads(args.engine_config)})
    model, weights, info = build({"model": args.model, "batch_size": args.batch, "seq_len": args.seq}, cfg)
    # Byte ids, as bench/ds_e2e.py draws them: the same batches for both (a HF directory's vocabulary
    # holds them; its own tokenizer would change the data, not the work of a step).
    sampler = BatchSampler(load_tokens(), args.batch, args.seq, seed=0)
    kernel_backend()  # build/load the CPU Adam kernel first: init_s is offload.initialize alone
    t0 = time.perf_counter()
    with offload.initialize(model, cfg, weights=weights) as engine:
        _emit({"params": info["params"], "init_s": time.perf_counter() - t0})
        recorder = iobound.SwapRecorder(engine.store) if args.replay and engine.store is not None else None
        for i in range(args.steps):
            ids, labels = (t.to(engine.device) for t in sampler.batch(i))
            engine.start_trace()  # each step's own timeline: its profile (and with --trace, the last one saved)
            last = i == args.steps - 1
            with recorder if last and recorder else contextlib.nullcontext():
                cpu0, t0 = _cpu_s(), time.perf_counter()
                loss = loss_of(engine(ids, labels=labels))  # by name: a HF model's second argument is the mask
                engine.backward(loss)
                engine.step()
                t1 = time.perf_counter()
            _emit({"step": i, "step_s": t1 - t0, "loss": loss.item(), "links": engine.stats()["last_step"]["links"],
                   "profile": {**profile(engine.rt.telemetry.spans(), t0, t1), "cpu_s": _cpu_s() - cpu0}})
            if args.trace and last:
                engine.save_trace(args.trace)
        _emit({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})  # the steps'
        if recorder:  # the last step's requests again, nothing else running (its data is garbage after)
            _emit({"replay_starts": True})
            _emit({"io_replay": iobound.replay(engine.store, recorder.ops)})
    if weights is not None:
        weights.close()


def _cpu_s() -> float:
    """CPU seconds this process has used, every thread, user and system."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def profile(spans: list, t0: float, t1: float) -> dict:
    """Where one step's time went, from its timeline (offload.scheduler.telemetry): forward (to the backward's
    start), backward and the rest (step(), the deferred units' steps before it); compute_stall_s the compute
    thread waited for fetches; cpu_adam_s CPU Adam ran; drive_idle_s no nvme transfer was in flight (a
    transfer counts from its submission to its observed completion, so idle is a gap in the pipeline)."""
    back = [(a, b) for track, name, a, b in spans if track == "compute" and name == "backward"]
    b0, b1 = back[-1] if back else (t1, t1)
    return {"forward_s": b0 - t0, "backward_s": b1 - b0, "after_backward_s": t1 - b1,
            "compute_stall_s": sum(b - a for track, name, a, b in spans
                                   if track == "compute" and name.startswith("stall")),
            "cpu_adam_s": _union([(a, b) for track, _, a, b in spans if track == "cpu_adam"], t0, t1),
            "drive_idle_s": (t1 - t0) - _union([(a, b) for track, _, a, b in spans if track == "nvme"], t0, t1)}


def _union(intervals: list, t0: float, t1: float) -> float:
    """Seconds of [t0, t1] covered by at least one of `intervals`."""
    total, end = 0.0, t0
    for a, b in sorted((max(a, t0), min(b, t1)) for a, b in intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def compute_worker(args) -> None:
    """In a subprocess: the step's compute floor on this host, measured now. The same model and batch
    shape, weights and gradients in --precision in memory (no offload, no optimizer): the median forward+backward
    of two after a warm-up; plus CPU Adam over every trainable parameter, timed on a 64M-element window
    of our kernel (its rate times the parameter count). Both need the CPU the step's compute runs on;
    the swap I/O does not, so a step can at best overlap I/O under this floor."""
    import torch

    from offload.kernels.cpu_adam import adam_step
    from offload.data import BatchSampler, load_tokens
    from offload.models import build_model, loss_of
    from offload.plan.precision import DTYPES

    model = build_model(args.model, device="meta").to_empty(device="cpu").to(DTYPES[args.precision])
    with torch.no_grad():
        for p in model.parameters():  # values do not matter, but garbage may hold denormals or NaNs
            p.normal_(0.0, 0.02)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ids, labels = BatchSampler(load_tokens(), args.batch, args.seq, seed=0).batch(0)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        loss_of(model(ids, labels=labels)).backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    del model
    n = 64 << 20
    master, grad, m, v = (torch.randn(n) * 0.01 for _ in range(4))
    out = torch.empty(n, dtype=DTYPES[args.precision]) if args.precision != "fp32" else None  # fp32: no copy out
    adam = []
    for step in range(1, 4):
        t0 = time.perf_counter()
        adam_step(master, grad, m, v, step=step, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, out=out)
        adam.append(time.perf_counter() - t0)
    fwd_bwd, adam_s = sorted(times[1:])[0], sorted(adam)[1] * params / n
    _emit({"fwd_bwd_s": fwd_bwd, "adam_s": adam_s, "compute_bound_s": fwd_bwd + adam_s})


def _emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


class PeakRss(Periodic):
    """The largest RSS summed over a process and its descendants, sampled every interval_s on a thread."""

    def __init__(self, pid: int, interval_s: float = 0.2):
        super().__init__(interval_s, "scale-rss")
        self.pid, self.peak, self.frozen = pid, 0, False

    def sample(self) -> None:
        import psutil

        if self.frozen:  # the worker's measured part is over (its I/O replay's buffers are not the step's)
            return

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:  # a child that ended between listing and reading
                pass
        self.peak = max(self.peak, total)


def run_sampled(cmd: list[str], label: str, on_pause=None) -> dict:
    """Runs a worker, echoing its stderr and a line per step, sampling its RSS. Returns what it reported
    (its once-per-run keys: params, init_s, deepspeed_version, ...; per-step lists), steps_completed, peak_rss_bytes (sampled,
    until a line {"replay_starts": ...}), ru_maxrss_bytes (the worker's own peak, if it got to say it) and error: its last stderr line, or null when it succeeded.
    on_pause: a worker that prints {"pause": i} waits for a line on its stdin; on_pause() runs first (while
    the worker holds still: a reference measured between its steps), and its results are out["pauses"]."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(),
                            stdin=subprocess.PIPE if on_pause else None)
    tail: collections.deque = collections.deque(maxlen=20)
    tee = threading.Thread(target=_tee, args=(proc.stderr, tail), daemon=True)
    tee.start()
    out: dict = {"params": None, "init_s": None, "step_s": [], "losses": [], "links": []}
    try:
        with PeakRss(proc.pid) as rss:
            for line in proc.stdout:
                if on_pause and line.startswith('{"pause"'):
                    out.setdefault("pauses", []).append(on_pause())
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                    continue
                if line.startswith('{"replay_starts"'):
                    rss.frozen = True
                    continue
                _take(out, line, label)
            proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: leave no worker writing into the directory being removed
            proc.kill()
            proc.wait()
    tee.join()
    out["steps_completed"], out["peak_rss_bytes"] = len(out["step_s"]), rss.peak
    out["error"] = _error_line(proc.returncode, tail) if proc.returncode else None
    return out


def _tee(stream, tail: collections.deque) -> None:
    for line in stream:
        sys.stderr.write(line)
        if line.strip():
            tail.append(line.rstrip())


def _take(out: dict, line: str, label: str) -> None:
    """One line of a worker's stdout into its result; lines that are not our JSON are passed on."""
    try:
        event = json.loads(line) if line.startswith("{") else None
    except ValueError:
        event = None
    if not isinstance(event, dict):
        sys.stderr.write(line)
    elif "step" in event:
        out["step_s"].append(event["step_s"])
        out["losses"].append(event["loss"])
        out["links"].append(event.get("links"))
        for k in set(event) - {"step", "step_s", "loss", "links"}:  # a bench's own per-step figures
            out.setdefault(k, []).append(event[k])
        print(f"{label} step {event['step'] + 1}: {event['step_s']:.2f} s, loss {event['loss']:.4f}",
              file=sys.stderr, flush=True)
    else:
        # once per run; a summary's own step_s / losses (DeepSpeed's: one number) never replace the steps'
        out.update({k: v for k, v in event.items() if k not in ("peak_rss_bytes", "step_s", "losses")})
        if "init_s" in event:
            print(f"{label} initialized in {event['init_s']:.1f} s", file=sys.stderr, flush=True)
        if "peak_rss_bytes" in event:  # the worker's own, exact peak (ru_maxrss): beside the sampled one
            out["ru_maxrss_bytes"] = event["peak_rss_bytes"]


def _error_line(returncode: int, tail: collections.deque) -> str:
    if returncode < 0:  # killed: the kernel's OOM killer sends SIGKILL and leaves no traceback
        return f"killed by signal {-returncode}" + (" (out of memory?)" if returncode == -9 else "")
    return tail[-1] if tail else f"exit {returncode}"


def steady(values: list[float]) -> float | None:
    """The median after the first step (which also records the fetch trace, or builds DeepSpeed's buffers)."""
    rest = sorted(values[1:] or values)
    return rest[len(rest) // 2] if rest else None


def _compute_bound(args, shape: list[str]) -> dict | None:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--compute-worker", "--model", args.model,
                           "--dir", args.dir] + shape, capture_output=True, text=True, env=worker_env())
    if proc.returncode:
        print(f"compute bound not measured: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bracketed(before: dict, after: dict) -> dict:
    """The swap bandwidths measured before and after ours' run, and their means (what the bound uses)."""
    out = dict(before)
    for k in ("swap_read_gbps", "swap_write_gbps"):
        out[k + "_before"], out[k + "_after"], out[k] = before[k], after[k], (before[k] + after[k]) / 2
    return out


def _ours_report(ours: dict, bw: dict | None, compute: dict | None = None) -> dict:
    """Ours' figures with the I/O bound (links per link as a list over steps, bound per step and its
    median) and the compute floor measured beside it: the step against the larger of the two."""
    links = [l for l in ours.pop("links") if l]
    report = {**ours, "links": {k: [l[k]["bytes"] for l in links] for k in (links[0] if links else {})},
              "io_bound_s": None, "io_bound_per_step_s": None, "step_vs_io_bound": None,
              **(compute or {"fwd_bwd_s": None, "adam_s": None, "compute_bound_s": None}), "step_vs_bound": None}
    if bw and links:
        bounds = [iobound.io_bound_s(iobound.step_nvme_bytes(l), bw) for l in links]
        report.update(io_bound_per_step_s=bounds, io_bound_s=steady(bounds),
                      step_vs_io_bound=steady(ours["step_s"]) / steady(bounds),
                      io_line=iobound.describe(iobound.step_nvme_bytes(links[-1]), bw, ours["params"]))
        if compute:
            report["step_vs_bound"] = steady(ours["step_s"]) / max(steady(bounds), compute["compute_bound_s"])
    replayed = ours.get("io_replay")
    report["io_replay_s"] = replayed["replay_s"] if replayed else None
    report["last_step_vs_io_replay"] = ours["step_s"][-1] / replayed["replay_s"] if replayed else None
    return report


def _print_summary(report: dict) -> None:
    print(f"model {report['model']}: {(report['params'] or 0) / 1e6:.0f}M params, batch {report['batch']} x "
          f"{report['seq']}; swap read {report['swap_read_gbps'] or float('nan'):.2f} GB/s, write "
          f"{report['swap_write_gbps'] or float('nan'):.2f} GB/s (offload bench nvme in --dir, the mean of before "
          f"and after ours: read {report['swap_read_gbps_before'] or float('nan'):.2f} / "
          f"{report['swap_read_gbps_after'] or float('nan'):.2f}, write {report['swap_write_gbps_before'] or float('nan'):.2f} / "
          f"{report['swap_write_gbps_after'] or float('nan'):.2f})")
    print(f"{'':10} {'init s':>7} {'steps':>6} {'step s':>8} {'peak RSS GB':>12}  loss first -> last")
    for name, r in (("ours", report), ("deepspeed", report["deepspeed"])):
        if r is None:
            continue
        step, losses = steady(r["step_s"]), r["losses"]
        print(f"{name:10} {r.get('init_s') or float('nan'):7.1f} {r['steps_completed']:6d} "
              f"{step if step is not None else float('nan'):8.2f} {r['peak_rss_bytes'] / 1e9:12.2f}  "
              + (f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-")
              + (f"  FAILED: {r['error']}" if r["error"] else ""))
    if report["compute_floor_s"] is not None:
        print(limits.describe(report["precision"], report["matmul_gflops"], report["compute_floor_s"],
                              report["io_bound_s"]))
    if report["io_bound_s"] is not None:
        print(report["io_line"])
        print(f"ours step / io bound = {report['step_vs_io_bound']:.2f} (step s: median after the first step)")
    if report["io_replay_s"] is not None:
        r = report["io_replay"]
        print(f"io replay {report['io_replay_s']:.2f} s = the last step's {r['requests']} swap requests again, nothing "
              f"else running ({r['read_bytes'] / 1e9:.2f} GB read, {r['written_bytes'] / 1e9:.2f} GB written: "
              f"{(r['read_bytes'] + r['written_bytes']) / 1e9 / report['io_replay_s']:.2f} GB/s); ours last step / io "
              f"replay = {report['last_step_vs_io_replay']:.2f}")
    if report["compute_bound_s"] is not None:
        print(f"compute floor {report['compute_bound_s']:.2f} s = forward+backward in memory {report['fwd_bwd_s']:.2f} s "
              f"+ CPU Adam over every parameter {report['adam_s']:.2f} s (measured in this run)")
    if report["step_vs_bound"] is not None:
        print(f"ours step / max(io bound, compute floor) = {report['step_vs_bound']:.2f}")
    for i, p in enumerate(report.get("profile") or []):
        print(f"ours step {i + 1} profile: forward {p['forward_s']:.2f} s, backward {p['backward_s']:.2f} s, after "
              f"{p['after_backward_s']:.2f} s; compute stalled {p['compute_stall_s']:.2f} s, CPU Adam "
              f"{p['cpu_adam_s']:.2f} s, drive idle {p['drive_idle_s']:.2f} s; CPU time {p['cpu_s']:.2f} s "
              f"({p['cpu_s'] / (p['forward_s'] + p['backward_s'] + p['after_backward_s']) / os.cpu_count():.0%} of "
              f"{os.cpu_count()} cores)")


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="3b", metavar="PRESET|PACKAGED|HF_DIR")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dir", required=True, help="a directory on the drive; the run's swap goes in a new "
                    "subdirectory, removed at the end")
    iobound.add_io_arguments(ap)
    add_engine_config_argument(ap)
    limits.add_precision_argument(ap)
    ap.add_argument("--ds-python", default=default_ds_python(), help="python of a venv with DeepSpeed")
    ap.add_argument("--no-deepspeed", action="store_true", help="ours only, even where DeepSpeed is found")
    ap.add_argument("--ds-sub-group-size", type=int, default=int(1e9),
                    help="DeepSpeed's ZeRO-3 sub_group_size (its default 1e9; see bench/ds_e2e.py)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace", default=None, metavar="PATH",
                    help="write ours' last step's timeline here (Chrome/Perfetto JSON; ui.perfetto.dev)")
    ap.add_argument("--no-compute-bound", action="store_true",
                    help="skip measuring the compute floor (an in-memory forward+backward of the same model "
                         "at --precision: needs 4-8 B per parameter of RAM) and CPU Adam's rate")
    ap.add_argument("--no-replay", dest="replay", action="store_false",
                    help="skip timing ours' last step's swap requests again with nothing else running (the io "
                         "replay: the step's I/O bound on this drive, measured after it; bench/iobound.py)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal: train ours here
    ap.add_argument("--compute-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.precision = limits.resolve(args.precision)  # ours, the compute floor and DeepSpeed at the one that runs
    if args.worker or args.compute_worker:
        return args
    if args.steps < 1 or args.batch < 1 or args.seq < 2:
        ap.error(f"--steps={args.steps} --batch={args.batch} --seq={args.seq}: need >= 1, >= 1, >= 2")
    if not os.path.isdir(args.dir):
        ap.error(f"--dir={args.dir}: not a directory; create it or pass an existing one")
    from offload.models import PRESETS
    from offload.pretrained import PACKAGED, resolve_model

    args.model = resolve_model(args.model)  # a packaged model (smollm2): its cached directory, for every worker
    if args.model not in PRESETS and not os.path.isdir(args.model):
        ap.error(f"--model={args.model}: neither a preset ({', '.join(PRESETS)}), a packaged model "
                 f"({', '.join(PACKAGED)}) nor a Hugging Face directory")
    return args


def main() -> None:
    bench_main(_parse_args(), "scale-", _run, _print_summary, worker, compute_worker)


def bench_main(args, prefix: str, run, print_summary, worker, compute_worker) -> None:
    """A bench's main (scale.py, lora.py): --worker / --compute-worker run that worker (in the subprocess);
    else run(args, work) in a new directory under --dir, removed at the end (ours alone: created here,
    gigabytes of swap), its summary, the JSON with --json, exit 1 when ours failed."""
    if args.worker:
        return worker(args)
    if args.compute_worker:
        return compute_worker(args)
    work = tempfile.mkdtemp(prefix=prefix, dir=args.dir)
    try:
        report = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_summary(report)
    if args.json:
        print(json.dumps(report))
    if report.get("error"):
        sys.exit(1)


def _run(args, work: str) -> dict:
    """The swap bandwidth, ours, then DeepSpeed, all in `work`; the report (API.md, Benchmarks)."""
    bw = iobound.measure_swap(work, args.io_size, json.loads(args.engine_config)) if args.io_size else None
    shape = ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
             "--precision", args.precision]
    ours_dir = os.path.join(work, "ours")
    os.makedirs(ours_dir)
    trace = ["--trace", os.path.abspath(args.trace)] if args.trace else []
    ours = run_sampled([sys.executable, os.path.abspath(__file__), "--worker", "--model", args.model,
                        "--engine-config", args.engine_config, "--dir", ours_dir] + shape + trace + ([] if args.replay else ["--no-replay"]), "ours")
    shutil.rmtree(ours_dir, ignore_errors=True)  # a killed run's swap would crowd DeepSpeed's off the drive
    if bw:  # the drive's speed drifts on a shared host: measured again after ours, the bound uses the mean
        bw = bracketed(bw, iobound.measure_swap(work, args.io_size, json.loads(args.engine_config)))
    compute = None if args.no_compute_bound else _compute_bound(args, shape)
    gflops = limits.matmul_gflops(args.precision)
    ds = None
    if args.ds_python and not args.no_deepspeed:
        ds = run_sampled([args.ds_python, os.path.join(REPO, "bench", "ds_e2e.py"), "--preset", args.model,
                          "--warmup", "0", "--zero-init", "--sub-group-size", str(args.ds_sub_group_size),
                          "--dir", work] + shape, "deepspeed")
        ds.pop("links")  # DeepSpeed has no link counters
    floor = limits.compute_floor_s(ours["params"], args.batch * args.seq, gflops) if ours["params"] else None
    return {"model": args.model, "batch": args.batch, "seq": args.seq, "precision": args.precision,
            "matmul_gflops": gflops, "compute_floor_s": floor, **_ours_report(ours, bw, compute),
            "swap_read_gbps": bw["swap_read_gbps"] if bw else None,
            "swap_write_gbps": bw["swap_write_gbps"] if bw else None,
            **{k: bw.get(k) if bw else None for k in ("swap_read_gbps_before", "swap_read_gbps_after",
                                                      "swap_write_gbps_before", "swap_write_gbps_after")},
            "engine_config": json.loads(args.engine_config), "deepspeed": ds}


if __name__ == "__main__":
    main()
