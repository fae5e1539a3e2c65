"""offload train's checkpoints (--save-every, --resume): when and where it saves, in the background unless
told (offload.checkpoint.background), what a failed save stops and says (SaveFailed), and where a resumed run
continues. The loop that calls them: offload.train."""

from __future__ import annotations

import errno
import os
import sys
import time

from offload.lora import base_name, transposed_layers
from offload.models import hf_name
from offload.plan.config import Config
from offload.recipe import DEFAULT_CHECKPOINT_DIR, DEFAULT_KEEP_CHECKPOINTS


def _identity(run: dict, cfg: Config) -> dict:
    """What fixes the batch sequence: a resumed run must have the same."""
    return {"model": run["model"], "data": run["data"], "batch_size": run["batch_size"], "seq_len": run["seq_len"],
            "seed": cfg.seed, "grad_accum": cfg.gradient_accumulation_steps, "lora": run.get("lora")}


class Checkpoints:
    """offload train's checkpoints: every `every` steps and at the last one, in `directory`, the newest
    `keep` kept. Each holds the data position (the next step: batch i depends only on (seed, i)), what
    fixes the batch sequence, and for a preset its Hugging Face config and names (for export)."""

    def __init__(self, directory: str, every: int, keep: int, steps: int, extra: dict, blocking: bool = False):
        self.directory, self.every, self.keep, self.steps, self.extra = directory, every, keep, steps, extra
        self.blocking = blocking  # --save-blocking; else written in the background (engine.save_checkpoint)
        self.saved: list[dict] = []  # {"step", "path", "background", "seconds", "exposed_s"} of each save
        self._flight = None  # (handle, its row in saved) of the background save not finished yet

    @classmethod
    def from_args(cls, args, run: dict, cfg: Config, model, info: dict) -> "Checkpoints | None":
        for flag in ("save_every", "keep_checkpoints"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be a positive integer")
        if args.save_every is None:
            return None
        extra = {"train": {"run": _identity(run, cfg)}}
        if info["kind"] == "hf":  # export: the config as the directory had it, and its tokenizer files
            extra["hf_config"], extra["hf_source"] = info["hf_config"], info["source"]
        if info["kind"] == "preset":  # a LoRA run's export merges the adapters (offload.lora.merged_items)
            extra["hf_config"] = info["hf_config"]
            names = [base_name(n) for n, _ in model.named_parameters(remove_duplicate=False) if ".lora_" not in n]
            extra["hf_names"] = {n: hf_name(n) for n in names}
        if run.get("lora") is not None:  # export merges as --save-merged: weights stored [in, out] transposed
            extra["lora"] = {**run["lora"], "transposed": transposed_layers(model)}
        keep = DEFAULT_KEEP_CHECKPOINTS if args.keep_checkpoints is None else args.keep_checkpoints
        return cls(args.checkpoint_dir or DEFAULT_CHECKPOINT_DIR, args.save_every, keep, run["steps"], extra,
                   blocking=getattr(args, "save_blocking", False))

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.steps

    def save(self, engine, step: int, blocking: bool = False) -> str:
        """Saves after `step`, in the background unless --save-blocking or `blocking` (a SIGTERM's save, before
        the run stops); returns its path. A save that fails (a full disk) raises SaveFailed naming the path and
        step: a blocking one here, a background one at the next step (failed()) or at finish()."""
        from offload.checkpoint.format import CheckpointError

        extra = {**self.extra, "train": {**self.extra["train"], "step": step}}
        name, again = f"step{step:08d}", 0
        while os.path.lexists(os.path.join(self.directory, name)):  # resumed from an earlier one: never overwrite
            again += 1
            name = f"step{step:08d}-{again}"
        # delayed_update's pending update is saved as it is, which the next step changes: blocking
        path, background = os.path.join(self.directory, name), not (self.blocking or blocking or engine.cfg.delayed_update)
        row = {"step": step, "path": path, "background": background, "seconds": None, "exposed_s": None}
        t = time.perf_counter()
        try:
            self._settle()  # the one in flight first (engine.save_checkpoint would wait for it too)
            handle = engine.save_checkpoint(self.directory, name=name, keep=self.keep, extra=extra, background=background)
        except (OSError, CheckpointError) as e:  # saves are atomic: the previous checkpoints are as they were
            raise SaveFailed(path, step, e, self.last_good()) from e
        self.saved.append(row)
        if background:
            self._flight = (handle, row)
        else:
            row["seconds"] = row["exposed_s"] = time.perf_counter() - t
        return path

    def failed(self, error: BaseException) -> "SaveFailed":
        """The SaveFailed of the background save in flight, which failed with `error`."""
        _, row = self._flight
        self._flight = None
        return SaveFailed(row["path"], row["step"], getattr(error, "cause", error), self.last_good())

    def finish(self) -> None:
        """Waits for the background save in flight (the run's last checkpoint); SaveFailed if it failed."""
        from offload.checkpoint.format import CheckpointError

        try:
            self._settle()
        except CheckpointError as e:
            raise self.failed(e) from e

    def _settle(self) -> None:
        if self._flight is not None:
            handle, row = self._flight
            handle.wait()
            row.update(handle.stats())
            self._flight = None

    def summary(self) -> dict:
        """What the run's report says of its checkpoints: how many, the seconds they took and the seconds of
        it training waited for (exposed: a blocking save's whole time), the rest hidden behind the steps."""
        done = [r for r in self.saved if r["seconds"] is not None]
        seconds, exposed = sum(r["seconds"] for r in done), sum(r["exposed_s"] for r in done)
        return {"saved": len(self.saved), "background": sum(r["background"] for r in self.saved),
                "seconds": seconds, "exposed_s": exposed, "hidden_s": seconds - exposed, "rows": self.saved}

    def last_good(self) -> str | None:
        from offload.checkpoint import format as fmt

        try:
            return fmt.resolve(self.directory) if os.path.isfile(os.path.join(self.directory, fmt.LATEST)) else None
        except (OSError, ValueError):
            return None


class SaveFailed(OSError):
    """A checkpoint `offload train` could not save (ENOSPC on --checkpoint-dir): training stops after that
    step, the report of the steps done is written, the last good checkpoint stays as it was; the CLI
    prints this one line and exits 2."""

    def __init__(self, path: str, step: int, cause: BaseException | str, last_good: str | None):
        super().__init__(getattr(cause, "errno", None) or errno.EIO, str(cause), path)
        self.path, self.step, self.cause, self.last_good = path, step, cause, last_good
        self.out_dir: str | None = None  # set once the report is written
        self.report: dict | None = None

    def __str__(self) -> str:
        resume = (f"the last good checkpoint is {self.last_good} (continue from it with --resume)"
                  if self.last_good else "no checkpoint was saved before it")
        report = f"; report in {self.out_dir}" if self.out_dir else ""
        return (f"saving the checkpoint {self.path} after step {self.step} failed ({self.cause}); training stopped "
                f"there and {resume}{report}; free space on --checkpoint-dir or point it elsewhere")


def resume_point(args, run: dict, cfg: Config) -> tuple[str, int] | None:
    """(checkpoint path, the step to continue at) for --resume, checked against this run before anything
    is built; None without --resume, or for `latest` when the directory holds no checkpoint yet."""
    from offload.checkpoint import format as fmt

    if args.resume is None:
        return None
    path = args.resume
    if path == "latest":
        path = args.checkpoint_dir or DEFAULT_CHECKPOINT_DIR
        if not os.path.isfile(os.path.join(path, fmt.LATEST)):
            print(f"offload train: no checkpoint in {path} yet; starting at step 0", file=sys.stderr, flush=True)
            return None
    ckpt = fmt.resolve(path)
    position = fmt.read_manifest(ckpt)["extra"].get("train")
    if position is None:
        raise ValueError(f"--resume={args.resume}: {ckpt} was not saved by offload train (it has no data position); "
                         "load it with engine.load_checkpoint() in your own loop")
    ours = _identity(run, cfg)
    differ = [k for k in ours if position["run"].get(k) != ours[k]]
    if differ:
        raise ValueError(f"--resume={args.resume}: {ckpt} was trained with " + ", ".join(
            f"{k}={position['run'].get(k)!r}" for k in differ) + " (here " + ", ".join(f"{k}={ours[k]!r}" for k in differ)
            + "), so the batches would not continue its sequence; resume with the same settings")
    if position["step"] >= run["steps"]:
        raise ValueError(f"--steps={run['steps']}: {ckpt} is at step {position['step']}, nothing is left to train; "
                         "raise --steps")
    return ckpt, position["step"]
