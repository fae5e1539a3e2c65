"""One rank of tests/test_zero.py: trains the MLP on its slice of each global batch and writes what it
saw as JSON (and, rank 0, the final fp32 weights). Run by the test with RANK / WORLD_SIZE / MASTER_* set."""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import offload  # noqa: E402
from tests.engine_util import MLP, mlp_batches  # noqa: E402


def main() -> None:
    cfg, out, steps, gas = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    model_kwargs = cfg.pop("_model", {})  # tests.engine_util.MLP's arguments (frozen, ckpt)
    poison = cfg.pop("_poison", None)      # this micro-step's input on rank 0 is infinite (fp16 overflow there)
    save_at = cfg.pop("_save_at", None)    # save a checkpoint to <out>.ckpt after this many steps
    load = cfg.pop("_load", None)          # resume from this checkpoint (its step count says where)
    dcp_save = cfg.pop("_dcp_save", None)  # at the end, torch.distributed.checkpoint.save of the sharded state dict
    dcp_load = cfg.pop("_dcp_load", None)  # at the start, the sharded state dict loaded from there (weights only)
    per_rank = cfg.pop("_rank_cfg", {})    # rank -> config keys that differ on that rank
    events = [] if cfg.pop("_trace_gathers", False) else None  # the gathers' threads and the fetch order
    evaluate = cfg.pop("_eval", False)     # after each step, a forward under no_grad on the same batch
    keep = cfg.pop("_keep", False)         # at the end close(keep_weights=True): the plain model against the engine
    background = cfg.pop("_save_background", False)  # the _save_at checkpoint in the background: when it publishes
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {**cfg, **per_rank.get(str(rank), {})}
    if events is not None:
        trace_gathers(events)
    if isinstance(cfg["nvme_path"], str):  # a list: one directory per rank already (Config.swap_dir)
        cfg["nvme_path"] = os.path.join(cfg["nvme_path"], f"rank{rank}")
    torch.manual_seed(0)
    losses, evals, kept, handle, published = [], [], None, None, None
    model = MLP(**model_kwargs)
    try:
        with offload.initialize(model, cfg) as eng:
            if load is not None:
                eng.load_checkpoint(load)
            if dcp_load is not None:
                sharded = eng.state_dict(sharded=True)
                dcp.load(sharded, checkpoint_id=dcp_load)
                eng.load_state_dict(sharded)
            for i, (x, y) in enumerate(mlp_batches(steps * gas)):
                if i < eng.step_count * gas:  # resumed: these were trained before the checkpoint
                    continue
                n = x.shape[0] // world
                x = x[rank * n:(rank + 1) * n] * (float("inf") if i == poison and rank == 0 else 1.0)
                loss = eng(x, y[rank * n:(rank + 1) * n])
                eng.backward(loss)
                eng.step()
                losses.append(loss.item())
                if events is not None:
                    events.append(["stepped"])
                if evaluate and eng.micro_step == 0:
                    with torch.no_grad():
                        evals.append(eng(x, y[rank * n:(rank + 1) * n]).item())
                if handle is not None and published is None and handle.done():
                    published = {"published_at": eng.step_count}
                if save_at is not None and eng.step_count == save_at and eng.micro_step == 0:
                    handle = eng.save_checkpoint(out + ".ckpt", background=background)
                    handle = handle if background else None
            ahead_bytes, stats = settled_stats(eng)
            sd = eng.full_state_dict()  # every rank: with zero_stage 1-3 it gathers each window from its owner
            if rank == 0:
                torch.save(sd, out + ".pt")
            shard_numel = sharded_equal = None
            if dcp_save is not None:
                sharded = eng.state_dict(sharded=True)
                shard_numel = sum(v.to_local().numel() for k, v in sharded.items() if k in sd)
                sharded_equal = all(torch.equal(sharded[k].full_tensor(), sd[k]) for k in sd)
                dcp.save(sharded, checkpoint_id=dcp_save)
            state_bytes, weight_bytes = state_bytes_of(eng), weight_bytes_of(eng)
            partitioned = sum(w.unit.numel for w in eng.weights if w.partitioned)
            partitioned_trainable = sum(w.unit.trainable_numel for w in eng.weights if w.partitioned)
            if keep:
                kept = kept_weights(eng, model, mlp_batches(1, seed=7)[0])
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump({"losses": losses, "collectives": stats["collectives"], "state_bytes": state_bytes,
                       "weight_bytes": weight_bytes, "partitioned_numel": partitioned,
                       "partitioned_trainable": partitioned_trainable, "swap_dir": eng.placement.swap_dir,
                       "chunk_numel": eng.chunk_numel, "shard_numel": shard_numel, "sharded_equal": sharded_equal,
                       "skipped_steps": eng.skipped_steps, "loss_scale": eng.loss_scale,
                       "trainable": sum(u.trainable_numel for u in eng.units),
                       "params": sum(p.numel() for p in MLP().parameters()), "events": events, "evals": evals, "ahead_bytes": ahead_bytes,
                       "activations": stats["activations"], "kept": kept, "background": published}, f)
    finally:
        dist.destroy_process_group()


def kept_weights(eng, model, batch) -> dict:
    """close(keep_weights=True) after a forward under no_grad: whether the plain model then gives that forward's
    loss bit for bit, with every parameter whole in the compute dtype."""
    with torch.no_grad():
        before = eng(*batch)
    eng.close(keep_weights=True)
    with torch.no_grad():  # in the compute dtype, as the engine casts them
        after = model(*(t.to(eng.dtype) for t in batch))
    shapes = all(p.dtype == eng.dtype and p.numel() > 0 for p in model.parameters())
    return {"equal": bool(torch.equal(before, after)), "loss": after.item(), "whole": shapes}


def settled_stats(eng) -> tuple[int, dict]:
    """After training: (the bytes of the units the policy holds: those the last step() fetched ahead of a next
    forward when training ended with a step, the engine's stats once those fetches settled). zero_stage 3
    gathers them after each step (offload.step.prefetch ahead_of_step), so whether the last ones are counted would
    depend on timing: they settle first."""
    ahead = sum(eng.weights[u].nbytes for u in eng.prefetcher.policy.resident)
    eng.prefetcher.release_all()
    return ahead, eng.stats()


def trace_gathers(events: list) -> None:
    """Records, in order: ["use", unit] when a unit is fetched for use, ["issue", unit] when a partitioned
    unit's fetch starts (its gather is decided then), ["gather", unit, thread name] as its gather runs;
    the training loop adds ["stepped"] after each engine.step()."""
    import threading

    from offload.state.gather import ShardGather
    from offload.state.residency import R, WeightHandle
    from offload.step.prefetch import Prefetcher

    use, fetch, gather = Prefetcher.fetch_for_use, WeightHandle.fetch, ShardGather.run

    def traced_use(self, unit, backward=False):
        events.append(["use", unit.name])
        return use(self, unit, backward)

    def traced_fetch(self):
        if self.partitioned and self.state in (R.NVME, R.DRAM):
            events.append(["issue", self.unit.name])
        return fetch(self)

    def traced_gather(self, group):
        events.append(["gather", self.name, threading.current_thread().name])
        return gather(self, group)

    Prefetcher.fetch_for_use, WeightHandle.fetch, ShardGather.run = traced_use, traced_fetch, traced_gather


def state_bytes_of(eng) -> int:
    """The optimizer-state bytes this rank holds (master, moments and gradient accumulator), wherever they live:
    resident flats, or swap chunks under the units' state keys."""
    resident = sum(t.numel() * t.element_size() for st in eng.states if st is not None for t in st.t.values())
    kinds = ("/master/", "/exp_avg/", "/exp_avg_sq/", "/grad/")
    swapped = sum(eng.store.nbytes(k) for k in eng.store.keys() if any(x in k for x in kinds)) if eng.store else 0
    return resident + swapped


def weight_bytes_of(eng) -> int:
    """The home bytes of the fetched units' weights this rank holds (dram flats, or swap chunks)."""
    dram = sum(w.dram.numel() * w.dram.element_size() for w in eng.weights if w.dram is not None)
    swapped = sum(eng.store.nbytes(k) for k in eng.store.keys() if "/weight." in k) if eng.store else 0
    return dram + swapped


if __name__ == "__main__":
    main()
