"""ZeRO stages 1-3 over 2 ranks on ONE device against one process: bench/gpu_check.py's `ranks` section.

Per case (CASES: stage and offload_param/offload_optimizer) two processes on the same device (cuda:N, or
the CPU with CUDA hidden), each with init_process_group("gloo") (on CUDA: gloo over CUDA tensors), train
tests.engine_util.MLP in fp32 for `steps` optimizer steps of GAS micro-steps, each rank on its slice of
every global batch of tests.engine_util.mlp_batches; then a third process, alone on the same device, trains
the same model at zero_stage 0 on the same slices in rank order (GAS x world micro-steps per step: what
tests/ranks_util.py's single_in_rank_order does), so the two differ only in the fp32 summation order of the
gradients' reduction. The ranks' mean losses and rank 0's full_state_dict() are compared with its losses
and weights within the fp32 tolerance of tests/ranks_util.py's assert_trains_like_one_process (LOSS_RTOL,
WEIGHT_RTOL, WEIGHT_ATOL). Every process runs under DEADLINE_S and is killed after it; a rank that fails
(the engine refusing the stage on CUDA, say) is recorded as the case's error, and the rest still run.

Run as a script it is one such process (the spec as JSON, the output path; RANK / WORLD_SIZE / MASTER_* in
the environment for a rank); gpu_check imports run_case. Ran as 2 gloo ranks on one H200 (bench/RESULTS.md).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # this checkout's offload and tests.engine_util, wherever the script is run from
    sys.path.insert(0, REPO)

CASES = {  # name -> (zero_stage, offload_param, offload_optimizer)
    "stage1 nvme/nvme": (1, "nvme", "nvme"),
    "stage2 nvme/nvme": (2, "nvme", "nvme"),
    "stage3 nvme/nvme": (3, "nvme", "nvme"),
    "stage3 none/nvme": (3, "none", "nvme"),
}
WORLD = 2
GAS = 2  # micro-steps per optimizer step on each rank
# fp32: only the summation order of the reduction over ranks differs (tests/ranks_util.py's
# assert_trains_like_one_process: losses rel 1e-5, weights assert_close rtol 1e-5 atol 1e-5)
LOSS_RTOL, WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-5, 1e-5
DEADLINE_S = 300  # per process; gloo's own timeout (60 s) ends a rank whose peer died sooner
CHUNK_BYTES = 8192  # 2048 elements a window: the MLP's units have 1 to 17 windows each, spread over the ranks


def case_config(case: str, swap_dir: str) -> dict:
    stage, param, optim = CASES[case]
    return {"zero_stage": stage, "precision": "fp32", "offload_param": {"device": param},
            "offload_optimizer": {"device": optim}, "nvme_path": swap_dir, "units": {"min_numel": 512},
            "optimizer": {"lr": 1e-2}, "chunk_bytes": CHUNK_BYTES, "gradient_accumulation_steps": GAS,
            "gradient_clipping": 0.5}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train(spec: dict, rank: int, world: int) -> tuple[dict, dict]:
    """One rank's training (spec["reference"]: the one process, every slice in rank order at zero_stage 0);
    returns what it measured and the full state dict (a collective: every rank calls it)."""
    import offload
    from tests.engine_util import MLP, mlp_batches

    reference, steps = spec["reference"], spec["steps"]
    cfg = dict(spec["cfg"], nvme_path=os.path.join(spec["cfg"]["nvme_path"], "ref" if reference else f"rank{rank}"))
    if reference:
        cfg.update(zero_stage=0, gradient_accumulation_steps=GAS * world)
    torch.manual_seed(0)
    losses, step_s = [], []
    with offload.initialize(MLP(), cfg) as eng:
        dev = eng.device
        if dev.type != torch.device(spec["device"]).type:
            raise RuntimeError(f"the engine runs on {dev}, not {spec['device']}")
        _sync(dev)
        t0 = time.perf_counter()
        for x, y in mlp_batches(steps * GAS):
            n, parts = x.shape[0] // world, []
            for r in range(world) if reference else [rank]:
                loss = eng(x[r * n:(r + 1) * n].to(dev), y[r * n:(r + 1) * n].to(dev))
                eng.backward(loss)
                eng.step()
                parts.append(loss.item())
            losses.append(sum(parts) / len(parts))  # the reference: the mean over the slices, as the ranks' mean
            if eng.micro_step == 0:  # an optimizer step ended
                _sync(dev)
                step_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
        stats = eng.stats()
        sd = {k: v.detach().cpu() for k, v in eng.full_state_dict().items()}
    return {"losses": losses, "step_s": step_s, "collectives": stats["collectives"], "device": str(dev)}, sd


def worker_main() -> None:
    spec, out = json.loads(sys.argv[1]), sys.argv[2]
    reference = spec["reference"]
    rank, world = (0, spec["world"]) if reference else (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    name = "ref" if reference else f"rank{rank}"
    try:
        if spec["device"].startswith("cuda"):  # every process on this one device
            torch.cuda.set_device(torch.device(spec["device"]))
        if not reference:
            import torch.distributed as dist

            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        result, sd = train(spec, rank, world)
        if rank == 0:
            torch.save(sd, f"{out}.{name}.pt")
    except Exception as e:  # recorded as the case's error by run_case
        result = {"error": f"{type(e).__name__}: {e}"}
    finally:
        if not reference:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    with open(f"{out}.{name}.json", "w") as f:
        json.dump(result, f)
    sys.exit(1 if "error" in result else 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(spec: dict, out: str, ranks: list[dict | None]) -> list[str]:
    """One process per entry of `ranks` (its extra environment; None: the reference), under DEADLINE_S; once
    one has failed the others get 15 s, then every one still running is killed. Returns each one's log tail."""
    cores = os.cpu_count() or 1
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": str(max(1, cores // WORLD))}
    if spec["device"] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU backend even where a GPU is visible
    logs = [f"{out}.{i}.log" for i in range(len(ranks))]
    procs = []
    for extra, log in zip(ranks, logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), json.dumps(spec), out],
                                          env={**env, **(extra or {})}, stdout=f, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + DEADLINE_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + 15)
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [open(log).read()[-2000:] for log in logs]


def _read(out: str, name: str, log: str) -> dict:
    try:
        with open(f"{out}.{name}.json") as f:
            return json.load(f)
    except FileNotFoundError:  # killed at the deadline, or died before writing it
        return {"error": f"{name}: no result (killed after {DEADLINE_S} s, or crashed); its output ends:\n{log[-800:]}"}


def run_case(case: str, device: str, steps: int, root: str) -> dict:
    """The case's 2 ranks, then the reference, on `device`; the comparison, or the first error met."""
    os.makedirs(root, exist_ok=True)
    spec = {"cfg": case_config(case, os.path.join(root, "swap")), "steps": steps, "device": device,
            "world": WORLD, "reference": False}
    out = os.path.join(root, "out")
    port = str(_free_port())
    logs = _launch(spec, out, [{"RANK": str(r), "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": port} for r in range(WORLD)])
    ranks = [_read(out, f"rank{r}", log) for r, log in enumerate(logs)]
    stage, param, optim = CASES[case]
    result = {"zero_stage": stage, "offload_param": param, "offload_optimizer": optim, "steps": steps, "gas": GAS}
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {**result, "error": errors[0], "ok": False}
    [log] = _launch({**spec, "reference": True}, out, [None])
    ref = _read(out, "ref", log)
    if "error" in ref:
        return {**result, "error": f"reference: {ref['error']}", "ok": False}
    return {**result, **compare(ranks, ref, torch.load(f"{out}.rank0.pt"), torch.load(f"{out}.ref.pt"))}


def compare(ranks: list[dict], ref: dict, sd: dict, ref_sd: dict) -> dict:
    """The ranks' mean losses and rank 0's weights against the reference's, within the stated tolerance."""
    losses = [sum(r["losses"][k] for r in ranks) / len(ranks) for k in range(len(ref["losses"]))]
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref["losses"])]
    loss_diff = float("nan") if any(d != d for d in diffs) else max(diffs)  # a NaN loss fails the case
    weight_diff, worst, close = 0.0, None, sd.keys() == ref_sd.keys()
    for name, want in ref_sd.items():
        got = sd.get(name, torch.full_like(want, float("nan")))
        d = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else float("inf")
        close = close and got.shape == want.shape and torch.allclose(got, want, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
        if not d <= weight_diff:  # NaN counts as the worst
            weight_diff, worst = d, name
    median = lambda xs: sorted(xs[1:] or xs)[len(xs[1:] or xs) // 2]  # noqa: E731 - after the first step
    return {"losses": losses, "ref_losses": ref["losses"], "max_rel_loss_diff": loss_diff,
            "max_weight_diff": weight_diff, "worst_weight": worst, "weights_close": close,
            "step_s": [median(r["step_s"]) for r in ranks], "ref_step_s": median(ref["step_s"]),
            "collectives": [r["collectives"] for r in ranks],
            "all_gather_exposed_s": [r["collectives"].get("all_gather", {}).get("exposed_s") for r in ranks],
            "device": ranks[0]["device"], "ok": loss_diff <= LOSS_RTOL and close}


if __name__ == "__main__":
    worker_main()
