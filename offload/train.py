"""The main job as a plain function: `train(args_or_config) -> report dict` (the CLI is thin on top).

The run of `offload train`, once offload.recipe has resolved its settings and built its model and data:
the training loop, the loss on --eval-data (Evaluator), checkpoints every --save-every steps and --resume
(offload.train_checkpoints), and the stop on SIGTERM or SIGINT (a partial report; with checkpoints, SIGTERM saves first).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import torch

import offload
from offload.answers import Answers
from offload.checkpoint.background import BackgroundSaveError
from offload.data import BatchSampler
from offload.kernels.cpu_adam import kernel_backend
from offload.lora import check_mergeable, save_dtype
from offload.models import loss_of
from offload.plan.config import Config
from offload.recipe import (
    RankSlice,
    as_namespace,
    build,
    data_sampler,
    resolve,
)
from offload.signals import SIGNALS, Stopped, stop_on_signals
from offload.state.ranks import reduced
from offload.train_checkpoints import Checkpoints, SaveFailed, resume_point
from offload.watchdog import LauncherWatch, SignalWatchdog

PER_STEP = ("losses", "step_seconds", "lrs", "grad_norms", "stall_seconds")  # history: one entry per step


def train(args_or_config=None) -> dict:
    """Runs the job and returns its report (also written to --out). See the module docstring.

    SIGTERM or SIGINT ([Note: signals] in offload/signals.py) stop it: the engine closes (its swap files
    go), the partial report is written and printed, one line on stderr says so, and offload.Stopped is
    raised with the report as its `.report` (the CLI exits with 128 + the signal number). Under torchrun, a
    rank whose launcher is gone (torchrun killed with SIGKILL) stops as if the launcher had sent it SIGTERM
    ([Note: a rank whose launcher is gone] in offload/watchdog.py)."""
    args = as_namespace(args_or_config)
    cfg, run = resolve(args)
    with LauncherWatch(label=f"offload train (rank {os.environ.get('RANK', 0)})") as watch:
        return _train(args, cfg, run, watch)


def _train(args: argparse.Namespace, cfg: Config, run: dict, watch: LauncherWatch) -> dict:
    """train() once its settings are resolved."""
    from offload import report as rep

    rank, world = _join_torchrun(cfg.collective_timeout_s)
    if args.out is None:  # over ranks, one directory: rank 0's start time (the ranks agree on the earliest)
        started = reduced([time.time()], "min")[0] if world > 1 else time.time()
        args.out = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S", time.localtime(started)))
    if rank:  # one voice: rank 0 prints; the others write their reports under <out>/.rank<r>
        args.quiet_rank, args.no_progress = True, True
        args.out = os.path.join(args.out, f".rank{rank}")
    if world > 1:
        run = {**run, "ranks": world}  # each step trains ranks x batch_size sequences; losses are their mean
    model, weights, info = build(run, cfg)
    if args.save_merged and run["lora"] is not None:
        check_mergeable(model)  # before training, not after it
    sampler = RankSlice(data_sampler("--data", run["data"], info["tokenizer"], run, cfg.seed), rank, world)
    evaluator = Evaluator.from_run(run, cfg, info["tokenizer"])  # every rank: the same batches, the same loss
    answers = Answers.from_run(run, info["tokenizer"], sampler.sampler.shape)  # every rank: the same forwards
    checkpoints = Checkpoints.from_args(args, run, cfg, model, info)
    resume = resume_point(args, run, cfg)
    out_dir = args.out
    made = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)  # before training: an unwritable --out fails now, not after the run
    history = {**{k: [] for k in PER_STEP}, "eval_losses": [], "samples": [], "answers": []}
    engine, init_s = None, None
    t0 = time.perf_counter()
    with SignalWatchdog(label=f"offload train (rank {rank})" if world > 1 else "offload train"), \
            stop_on_signals((signal.SIGINT,) if checkpoints else SIGNALS) as check_stop:  # SIGTERM: saved first
        try:
            kernel_backend()  # build/load the CPU Adam kernel now, not inside the first timed step
            with offload.initialize(model, cfg, weights=weights) as engine:
                cfg = engine.cfg  # its precision as resolved for this host ("auto": offload.plan.precision)
                if resume is not None:
                    engine.load_checkpoint(resume[0])
                    run = {**run, "start_step": resume[1], "resumed_from": resume[0]}
                init_s = time.perf_counter() - t0
                quiet = args.json or getattr(args, "quiet_rank", False)
                rep.print_header(run, cfg, info, engine, quiet=quiet)
                if answers is not None:  # before the first step (a resumed run's: after its checkpoint's step)
                    history["answers"] += answers.answer(engine, run.get("start_step", 0))
                    rep.print_answers(history["answers"], quiet=quiet)
                if args.trace:
                    engine.start_trace()
                _loop(engine, sampler, run, cfg, history, check_stop, progress=not args.no_progress,
                      checkpoints=checkpoints, evaluator=evaluator)
                if args.trace:
                    engine.save_trace(args.trace)
                    rep.plot_timeline(engine.rt.telemetry.chrome_trace(), args.trace + ".png")
                if answers is not None:
                    history["answers"] += answers.answer(engine, run["steps"])
                final = engine.stats()
                saved = save(engine, info, args.save, run["lora"], dtype=run["save_dtype"]) if args.save else None
                merged = (save(engine, info, args.save_merged, run["lora"], merged=True, dtype=run["save_dtype"])
                          if args.save_merged else None)
            check_stop()
        except Stopped as stop:  # the engine is closed: its swap files are gone
            watch.stand_down()  # stopping already (its SIGTERM handler gone): the report is written, not cut off
            stop.report = _stopped(stop, args, run, cfg, info, history, engine, init_s, out_dir)
            raise
        except SaveFailed as failed:  # the steps done are reported; the last good checkpoint is untouched
            failed.report = _save_failed(failed, args, run, cfg, info, history, engine, init_s, out_dir)
            raise
        except BaseException:  # a failed run leaves no empty run directory behind
            if made and os.path.isdir(out_dir) and not os.listdir(out_dir):
                os.rmdir(out_dir)
            raise
        finally:
            if weights is not None:
                weights.close()
    report = rep.build_report(run, cfg, info, history, final, init_s, out_dir, saved)
    report["saved_merged"] = merged
    for key, adapter in (("saved", run["lora"] is not None), ("saved_merged", False)):  # what each holds
        dtype = save_dtype(info, run["save_dtype"], adapter) if report[key] else None
        report[f"{key}_dtype"] = str(dtype).removeprefix("torch.") if dtype else None
    _publish(report, args)
    return report


def _join_torchrun(timeout_s: float) -> tuple[int, int]:
    """Under torchrun (WORLD_SIZE > 1 in the environment): joins the default process group from its
    environment (gloo on CPUs, NCCL on GPUs; its collectives time out after `timeout_s`, as the engine's
    own do: [Note: collective order] in offload.state.ranks) and returns (rank, world size); (0, 1) otherwise.
    The engine then trains over the ranks (zero_stage 0, or 1-3 with states and weights partitioned) or
    refuses what is not built yet; never N copies."""
    import datetime

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _mean_over_ranks(x: float) -> float:
    import torch.distributed as dist

    return reduced([x])[0] / dist.get_world_size()


def _publish(report: dict, args) -> None:
    from offload import report as rep

    rep.write(report, report["out_dir"])
    if getattr(args, "quiet_rank", False):  # not rank 0 under torchrun: its report is written, not printed
        return
    print(rep.summary_table(report), flush=True)
    if args.json:
        print(json.dumps(report), flush=True)


def _stopped(stop: Stopped, args, run: dict, cfg: Config, info: dict, history: dict, engine, init_s,
             out_dir: str) -> dict | None:
    """After a signal: the partial report (none when training had not started) and the one-line message."""
    from offload import report as rep
    from offload.swap import list_runs

    done = min(len(history[k]) for k in PER_STEP)  # the signal may split a step's appends
    for k in PER_STEP:
        del history[k][done:]
    report = None
    if engine is not None:
        stats = history.get("stats") or engine.stats()  # closed now: its swap file is gone
        report = rep.build_report(run, cfg, info, history, stats, init_s, out_dir, None)
        report["stopped"] = {"signal": stop.name, "steps_done": done}
        _publish(report, args)
    left = [str(r.path) for r in list_runs(cfg.swap_dir(getattr(engine, "rank", 0)))
            if r.pid == os.getpid()] if cfg.nvme_path else []
    if left:  # not closed (stopped while the engine was being built): atexit still removes them
        files = f"swap files still in {', '.join(left)}"
    elif "nvme" in (cfg.offload_param.device, cfg.offload_optimizer.device):
        files = "swap files removed"
    else:
        files = "no swap files"
    where = "after" if engine is not None else "while setting up, before"
    print(f"offload train: stopped by {stop.name} {where} step {done} of {run['steps']}; {files}"
          + (f"; partial report in {out_dir}" if report else ""), file=sys.stderr, flush=True)
    return report


def _save_failed(failed: "SaveFailed", args, run: dict, cfg: Config, info: dict, history: dict, engine, init_s,
                 out_dir: str) -> dict:
    """After a checkpoint save failed: the report of the steps done, with what failed."""
    from offload import report as rep

    report = rep.build_report(run, cfg, info, history, engine.stats(), init_s, out_dir, None)
    report["failed"] = {"checkpoint": failed.path, "step": failed.step, "error": str(failed.cause),
                        "last_good_checkpoint": failed.last_good}
    _publish(report, args)
    failed.out_dir = out_dir
    return report


def _loop(engine, sampler: BatchSampler, run: dict, cfg: Config, history: dict, check_stop, progress: bool,
          checkpoints: "Checkpoints | None" = None, evaluator: "Evaluator | None" = None) -> None:
    """Trains from run["start_step"] (0, or where --resume continues) to run["steps"], appending to
    `history` as each step ends (a stopped run keeps what it has); check_stop() after each step raises a
    signal's Stopped that something swallowed (offload/signals.py). With checkpoints, a SIGTERM is held
    until the step ends, the checkpoint is saved, and then the run stops as for any signal. The evaluator's
    loss (when due) is taken after the step's timing, so step times and stalls are training's alone; a run
    that starts at step 0 is also evaluated before its first step (a resumed run is not: the run it continues
    evaluated what its schedule asked for, and its checkpoint's step may be one of those)."""
    from offload.report import Progress, Sampler
    from offload.report import tokens_per_step as run_tokens

    gas = cfg.gradient_accumulation_steps
    tokens_per_step = run_tokens(run, cfg)
    start = run.get("start_step", 0)
    engine.train()
    with Sampler(engine) as samples, Progress(run["steps"] - start, tokens_per_step, enabled=progress) as bar, \
            _SaveOnSigterm(checkpoints is not None) as sigterm:
        history["samples"] = samples.rows
        if evaluator is not None and start == 0:  # the loss before training, the first point of the fall
            history["eval_losses"].append({"step": 0, "loss": evaluator.loss(engine)})
            bar.eval_loss = history["eval_losses"][-1]["loss"]
        for step in range(start, run["steps"]):
            t = time.perf_counter()
            stall0 = engine.rt.telemetry.stall_seconds  # not stats(): that lists the swap directory
            lr, loss_sum = engine.lr, 0.0
            for micro in range(gas):
                ids, labels = sampler.batch(step * gas + micro)
                loss = loss_of(engine(ids.to(engine.device), labels=labels.to(engine.device)))
                engine.backward(loss)
                loss_sum += loss.item()
            failed = None
            try:
                engine.step()
            except BackgroundSaveError as e:  # the step is done (and recorded below); the checkpoint before it failed
                failed = checkpoints.failed(e)
            if getattr(engine, "world", 1) > 1:  # the global batch's loss (the d2h thread is idle now)
                loss_sum = _mean_over_ranks(loss_sum)
            seconds = time.perf_counter() - t
            engine.rt.telemetry.span("step", f"step {step + 1}", t, t + seconds)
            stats = history["stats"] = engine.stats()  # the last one also serves a stopped run's report
            history["losses"].append(loss_sum / gas)
            history["step_seconds"].append(seconds)
            history["lrs"].append(lr)
            history["grad_norms"].append(getattr(engine, "last_grad_norm", None))
            history["stall_seconds"].append(stats["stall_seconds"] - stall0)
            if evaluator is not None and evaluator.due(step + 1):
                history["eval_losses"].append({"step": step + 1, "loss": evaluator.loss(engine)})
                bar.eval_loss = history["eval_losses"][-1]["loss"]
            bar.update(loss_sum / gas, seconds, stats, stats["stall_seconds"] - stall0)
            if failed is not None:
                raise failed
            preempted = sigterm.agreed(getattr(engine, "world", 1))
            if checkpoints is not None and (checkpoints.due(step + 1) or preempted):
                path = checkpoints.save(engine, step + 1, blocking=preempted)
                if preempted:
                    print(f"offload train: SIGTERM: saved {path} after step {step + 1}; continue with --resume",
                          file=sys.stderr, flush=True)
                    raise Stopped(signal.SIGTERM)
            check_stop()
        if checkpoints is not None:
            checkpoints.finish()
            history["checkpoints"] = checkpoints.summary()


class Evaluator:
    """The loss on --eval-data: the mean over the same `batches` batches at every evaluation (batch i of a
    sampler over the eval tokens, seeded as training's), forward only, through the engine under no_grad
    with the model in eval mode."""

    def __init__(self, sampler: BatchSampler, every: int | None, batches: int, last_step: int):
        self.sampler, self.every, self.batches, self.last_step = sampler, every, batches, last_step

    @classmethod
    def from_run(cls, run: dict, cfg: Config, tokenizer) -> "Evaluator | None":
        ev = run["eval"]
        if ev is None:
            return None
        if not os.path.isfile(ev["data"]):
            raise FileNotFoundError(2, "eval data file not found; pass --eval-data with a local .txt, .jsonl or .json file",
                                    ev["data"])
        sampler = data_sampler("--eval-data", ev["data"], tokenizer, run, cfg.seed)
        return cls(sampler, ev["every"], ev["batches"], run["steps"])

    def due(self, step: int) -> bool:
        return step == self.last_step or (self.every is not None and step % self.every == 0)

    @torch.no_grad()
    def loss(self, engine) -> float:
        engine.eval()
        try:
            total = 0.0
            for i in range(self.batches):
                ids, labels = self.sampler.batch(i)
                total += loss_of(engine(ids.to(engine.device), labels=labels.to(engine.device))).item()
            return total / self.batches
        finally:
            engine.train()


# --- checkpoints ---------------------------------------------------------------------------------------


class _SaveOnSigterm:
    """With checkpoints on, SIGTERM (a preempted job) makes the loop save after the step it is in and stop."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received = False

    def _handle(self, signum, frame) -> None:
        self.received = True

    def agreed(self, world: int) -> bool:
        """Whether to save and stop after this step. Over several ranks a SIGTERM may reach them during
        different steps (or reach one alone): the ranks agree, so they all save the same step together
        (a save is a collective) and stop, however many received it."""
        if not self.enabled or world == 1:
            return self.received
        return bool(reduced([float(self.received)], "max")[0])

    def __enter__(self) -> "_SaveOnSigterm":
        if self.enabled:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)


def save(engine, info: dict, directory: str, lora: dict | None = None, merged: bool = False,
         dtype: str = "auto") -> str:
    """Writes the trained weights as a HF directory (shards + index + config.json) in `--save-dtype dtype` and
    returns it; a LoRA run's adapter, or with `merged` its merged model ([Note: what a LoRA run saves] in
    offload.lora)."""
    from offload import lora as lo

    engine.flush()  # delayed_update: the last step's update is still pending
    if lora is not None and merged:
        return lo.save_merged(engine, info, lora, directory, save_dtype(info, dtype))
    if lora is not None:
        return lo.save_adapter(engine, engine.module, info, lora, directory, dtype)
    return lo.write_run_directory(engine, engine.state_items(), info, directory, save_dtype(info, dtype))
