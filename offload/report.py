"""What `offload train` shows: the header, the progress bar, the memory/link sampler, and the run report
(report.json, a PNG of per-tier memory and link bandwidth over the run, a summary table)."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

from offload.plan.memory import TIERS

LINKS = ("nvme_to_dram", "dram_to_hbm", "hbm_to_dram", "dram_to_nvme")
SAMPLE_COLUMNS = ("seconds", *(f"{t}_used_bytes" for t in TIERS), *(f"{l}_bytes" for l in LINKS), "stall_seconds")
REPORT_FILE, PLOT_FILE = "report.json", "memory_and_links.png"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}M" if n < 2**30 else f"{n / 2**30:.2f}G"


def tokens_per_step(run: dict, cfg) -> int:
    """Tokens one optimizer step trains on, over every rank (run["ranks"] under torchrun)."""
    return run["batch_size"] * run["seq_len"] * cfg.gradient_accumulation_steps * run.get("ranks", 1)


def _resumed(run: dict) -> str:
    if "resumed_from" not in run:
        return ""
    return f" (resumed from {run['resumed_from']} after step {run['start_step']})"


def print_header(run: dict, cfg, info: dict, engine, quiet: bool = False) -> None:
    if quiet:
        return
    where = f" under {engine.placement.swap_dir}" if engine.placement.uses_nvme else ""
    ranks = f" over {run['ranks']} ranks" if run.get("ranks", 1) > 1 else ""
    lora = run.get("lora")
    trained = (f", {info['trainable_params'] / 1e6:.2f}M trained: LoRA r {lora['r']} alpha {lora['alpha']:g} on "
               f"{','.join(lora['targets'])}" if lora else "")
    print(f"offload train: {run['model']} ({info['params'] / 1e6:.1f}M params{trained}, {len(engine.units)} units), "
          f"{cfg.precision}, weights {cfg.offload_param.device}, optimizer states {cfg.offload_optimizer.device}"
          f"{where}; {run['steps']} steps x {tokens_per_step(run, cfg)} tokens{ranks}{_resumed(run)}", flush=True)


class Progress:
    """A tqdm bar: loss (and the latest evaluation loss, once there is one), tokens/s, per-tier used bytes at
    the end of the step, stall share of the step."""

    def __init__(self, steps: int, tokens_per_step: int, enabled: bool = True):
        from tqdm import tqdm

        self.tokens_per_step = tokens_per_step
        self.eval_loss = None  # set by the loop after an evaluation
        self.bar = tqdm(total=steps, disable=not enabled, unit="step", dynamic_ncols=True)

    def update(self, loss: float, seconds: float, stats: dict, stall_seconds: float) -> None:
        used = " ".join(f"{t} {_mib(stats['tiers'][t]['used_bytes'])}" for t in TIERS)
        evaluated = f" | eval {self.eval_loss:.3f}" if self.eval_loss is not None else ""
        self.bar.set_postfix_str(f"loss {loss:.3f}{evaluated} | {self.tokens_per_step / seconds:,.0f} tok/s | "
                                 f"{used} | stall {100 * stall_seconds / seconds:.0f}%", refresh=False)
        self.bar.update(1)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


class Periodic:
    """Calls `sample()` on a daemon thread every `interval_s` inside a `with` block, and once on entry and
    on exit (a sampler of anything: engine stats here, a process tree's RSS in bench/scale.py)."""

    def __init__(self, interval_s: float, name: str):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self):
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


class Sampler(Periodic):
    """Samples engine.stats() on a thread every `interval_s`: per-tier used bytes and cumulative link bytes
    over wall time (the step-end values miss what is fetched and released inside a step)."""

    def __init__(self, engine, interval_s: float = 0.1):
        super().__init__(interval_s, "offload-report-sampler")
        self.engine = engine
        self.rows: list[list[float]] = []
        self._t0 = time.perf_counter()

    def sample(self) -> None:
        try:
            s = self.engine.stats()
        except OSError:  # a swap file vanished between listing and stat: skip this sample
            return
        self.rows.append([round(time.perf_counter() - self._t0, 4), *(s["tiers"][t]["used_bytes"] for t in TIERS),
                          *(s["links"][l]["bytes"] for l in LINKS), round(s["stall_seconds"], 6)])

    def __enter__(self) -> "Sampler":
        self._t0 = time.perf_counter()
        return super().__enter__()


# --- the report -------------------------------------------------------------------------------------


def build_report(run: dict, cfg, info: dict, history: dict, final: dict, init_s: float, out_dir: str,
                 saved: str | None) -> dict:
    steps = len(history["losses"])
    tokens = tokens_per_step(run, cfg)
    train_s = sum(history["step_seconds"])
    steady = history["step_seconds"][1:] or history["step_seconds"]  # step 1 also records the fetch trace
    tail = history["losses"][-min(10, steps):] if steps else []  # none: a run stopped before its first step
    return {
        "model": run["model"], "params": info["params"], "data": run["data"] or "bundled", "steps": steps,
        "precision": cfg.precision,  # the engine's: "auto" resolved for this host (offload.plan.precision)
        "tokenizer": "bytes" if info["tokenizer"] is None else type(info["tokenizer"]).__name__,
        "tokens_per_step": tokens, "tokens": steps * tokens,
        "first_loss": history["losses"][0] if steps else None, "final_loss": tail[-1] if tail else None,
        "final_loss_mean10": sum(tail) / len(tail) if tail else None,
        "tokens_per_s": len(steady) * tokens / sum(steady) if steady else 0.0, "init_seconds": init_s,
        "train_seconds": train_s, "stall_share": sum(history["stall_seconds"]) / train_s if train_s else 0.0,
        **{k: history[k] for k in ("losses", "step_seconds", "lrs", "grad_norms", "stall_seconds")},
        "eval_losses": history.get("eval_losses", []),  # [{"step", "loss"}]: --eval-data, every --eval-every steps
        "checkpoints": history.get("checkpoints"),  # --save-every: offload.train_checkpoints.Checkpoints.summary()
        "answers": history.get("answers", []),  # [{"step", "prompt", "answer"}]: --sample-prompts, before and after
        "stats": final, "config": cfg.to_dict(), "run": run,
        "samples": {"columns": list(SAMPLE_COLUMNS), "rows": history["samples"]},
        "out_dir": out_dir, "saved": saved,
        "files": {"report": os.path.join(out_dir, REPORT_FILE), "plot": os.path.join(out_dir, PLOT_FILE)},
    }


def write(report: dict, out_dir: str) -> None:
    """report.json and the PNG, each written under a temporary name and renamed when complete."""
    path = report["files"]["report"]
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    plot(report, report["files"]["plot"])


def _rates(rows: list[list[float]], column: int, window_s: float) -> tuple[list[float], list[float]]:
    """GB/s of a cumulative byte counter over sliding windows of about window_s."""
    xs, ys, j = [], [], 0
    for i in range(1, len(rows)):
        while rows[i][0] - rows[j][0] > window_s and j < i - 1:
            j += 1
        dt = rows[i][0] - rows[j][0]
        if dt > 0:
            xs.append(rows[i][0])
            ys.append((rows[i][column] - rows[j][column]) / dt / 1e9)
    return xs, ys


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["samples"]["rows"]
    t = [r[0] for r in rows]
    fig, (ax_mem, ax_bw, ax_loss) = plt.subplots(3, 1, figsize=(9, 9), constrained_layout=True)
    for i, tier in enumerate(TIERS, start=1):
        ax_mem.plot(t, [r[i] / 2**20 for r in rows], label=tier)
    ax_mem.set(title=f"offload train: {report['model']}, per-tier memory in use", xlabel="seconds",
               ylabel="MiB")
    ax_mem.legend()
    window = max(1.0, 2 * (t[-1] - t[0]) / len(rows)) if rows else 1.0
    for i, link in enumerate(LINKS, start=1 + len(TIERS)):
        xs, ys = _rates(rows, i, window)
        ax_bw.plot(xs, ys, label=link)
    ax_bw.set(title=f"link bandwidth (bytes moved per {window:.1f} s window)", xlabel="seconds", ylabel="GB/s")
    ax_bw.legend()
    ax_loss.plot(range(1, len(report["losses"]) + 1), report["losses"], label="training")
    if report["eval_losses"]:
        ax_loss.plot([e["step"] for e in report["eval_losses"]], [e["loss"] for e in report["eval_losses"]], "o-",
                     label="evaluation")
        ax_loss.legend()
    ax_loss.set(title="loss", xlabel="step", ylabel="loss")
    fig.savefig(path + ".tmp.png", dpi=90)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)


def summary_table(report: dict) -> str:
    st = report["stats"]
    stopped = report.get("stopped")
    first = report["run"].get("start_step", 0) + 1  # a resumed run's first step
    lines = [f"offload train: {report['model']}, {report['steps']} steps x {report['tokens_per_step']} tokens"
             + (f" (stopped by {stopped['signal']} after step {stopped['steps_done']} of {report['run']['steps']})"
                if stopped else "") + _resumed(report["run"])]
    if report["steps"]:
        lines += [
            f"  loss        {report['first_loss']:.3f} (step {first}) -> {report['final_loss']:.3f} (step "
            f"{first + report['steps'] - 1}), "
            f"{report['final_loss_mean10']:.3f} (mean of the last {min(10, report['steps'])})",
            f"  step time   {statistics.mean(report['step_seconds']):.2f} s mean, "
            f"{statistics.median(report['step_seconds']):.2f} s median; {report['tokens_per_s']:,.0f} tokens/s; "
            f"set-up {report['init_seconds'] or 0.0:.1f} s",
            f"  stall       {100 * report['stall_share']:.1f}% of step time waiting on transfers",
        ]
    evals = report["eval_losses"]
    if evals:
        first, last = evals[0], evals[-1]
        trend = f"{first['loss']:.3f} (step {first['step']}) -> " if len(evals) > 1 else ""
        ev = report["run"]["eval"]
        lines.append(f"  eval loss   {trend}{last['loss']:.3f} (step {last['step']}); {ev['batches']} batches of {ev['data']}")
    ck = report.get("checkpoints")
    if ck and ck["saved"]:
        how = f"{ck['background']} in the background" if ck["background"] else "blocking"
        lines.append(f"  checkpoints {ck['saved']} saved ({how}): {ck['seconds']:.1f} s writing, {ck['exposed_s']:.1f} s "
                     f"of it exposed to training, {ck['hidden_s']:.1f} s hidden")
    lines += answer_lines(report.get("answers", []))
    lines.append(f"  {'tier':6s} {'used':>10s} {'peak':>10s} {'budget':>10s}")
    for tier in TIERS:
        s = st["tiers"][tier]
        lines.append(f"  {tier:6s} {_mib(s['used_bytes']):>10s} {_mib(s['peak_bytes']):>10s} "
                     f"{_mib(s['budget_bytes']):>10s}")
    lines.append(f"  {'link':13s} {'moved':>10s} {'busy s':>8s} {'GB/s':>7s}")
    for link in LINKS:
        s = st["links"][link]
        rate = f"{s['bytes'] / s['seconds'] / 1e9:.2f}" if s["seconds"] > 0 else "-"
        lines.append(f"  {link:13s} {_mib(s['bytes']):>10s} {s['seconds']:8.2f} {rate:>7s}")
    act = st.get("activations", {})
    if act.get("where") in ("dram", "nvme"):  # the checkpoints' kept inputs in a tier (offload.state.activation_tier)
        nvme = f"{_mib(act['nvme_peak_bytes'])} nvme, " if act["where"] == "nvme" else ""
        lines.append(f"  activations kept inputs in {act['where']}: {_mib(act['moved_out_bytes'])} out of hbm, "
                     f"{_mib(act['moved_in_bytes'])} back; peak {nvme}{_mib(act['dram_peak_bytes'])} dram, "
                     f"{_mib(act['inputs_peak_bytes'])} hbm; backward waited {act['unpack_wait_s']:.2f} s for them")
    lines.append(f"  report      {report['files']['report']}, {report['files']['plot']}")
    for key, label in (("saved", "saved"), ("saved_merged", "merged")):  # --save, --save-merged
        if report.get(key):
            what = "peft LoRA adapter" if key == "saved" and report["run"].get("lora") else "Hugging Face directory"
            lines.append(f"  {label:11s} {report[key]} ({what}, {report[key + '_dtype']})")
    return "\n".join(lines)


def answer_lines(answers: list[dict]) -> list[str]:
    """The answers to --sample-prompts, by prompt, each on one line after its step."""
    if not answers:
        return []
    width = max(len(str(a["step"])) for a in answers)
    lines = ["  answers     greedy, to --sample-prompts:"]
    for prompt in dict.fromkeys(a["prompt"] for a in answers):
        lines.append(f"    {prompt}")
        lines += [f"      step {a['step']:<{width}}  {' '.join(a['answer'].split()) or '(nothing)'}"
                  for a in answers if a["prompt"] == prompt]
    return lines


def print_answers(answers: list[dict], quiet: bool = False) -> None:
    """The answers before training, printed as soon as they are made (the summary repeats them beside the after)."""
    if not quiet:
        print("\n".join(answer_lines(answers)), flush=True)


def plot_timeline(trace: dict, path: str) -> None:
    """One step's timeline from a Chrome trace (the last span on the "step" track): a row per track."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    steps = [e for e in spans if e["cat"] == "step"]
    if not steps:
        raise ValueError("trace: no step spans; record at least one training step")
    t0, t1 = steps[-1]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    tracks = ["compute", "h2d", "d2h", "nvme", "cpu_adam"]
    colors = {"compute": "tab:blue", "h2d": "tab:green", "d2h": "tab:orange", "nvme": "tab:red", "cpu_adam": "tab:purple"}
    fig, ax = plt.subplots(figsize=(12, 3.2))
    for row, track in enumerate(tracks):
        work, stall = [], []
        for e in spans:
            if e["cat"] != track or e["ts"] >= t1 or e["ts"] + e["dur"] <= t0:
                continue
            start, end = max(e["ts"], t0), min(e["ts"] + e["dur"], t1)
            (stall if e["name"].startswith("stall") else work).append(((start - t0) / 1e3, (end - start) / 1e3))
        ax.broken_barh(work, (row - 0.4, 0.8), color=colors[track])
        ax.broken_barh(stall, (row - 0.4, 0.8), color="black")
    ax.set_yticks(range(len(tracks)), tracks)
    ax.invert_yaxis()
    ax.set_xlabel(f"ms into {steps[-1]['name']} (black: compute stalled on a transfer)")
    ax.set_xlim(0, (t1 - t0) / 1e3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
