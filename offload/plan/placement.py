"""Placement and preflight: where each unit's weights and optimizer states live, decided once.

The bytes each tier will hold are computed before anything is allocated and checked against the tier
budgets, the free disk under nvme_path and the RAM available; a model that does not fit fails here,
with the numbers. Budgets left unset are derived with a safety margin (SAFETY) from what the machine has.
"""

from __future__ import annotations

import collections
import errno
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace

import torch

from offload.plan.activation_memory import ActivationModel, activation_model, longest_seq
from offload.plan.chunks import chunk_spans, planned_chunk_bytes, weight_chunks, window_owners
from offload.plan.config import load_config
from offload.plan.settings import fail
from offload.plan.memory import (
    MINIMUM,
    OFFLOAD_TIER,
    state_bytes,
    TIERS,
    Knobs,
    free_holds,
    grad_reserve,
    pool_chunks,
    runtime_parts,
    totals,
    working_set_peak,
)
from offload.plan.modes import every_step_overlapped
from offload.plan.precision import PrecisionChoice, resolve_precision
from offload.plan.units import Unit, forward_order, partition
from offload.swap import hostmem

SAFETY = 0.85  # of the memory available at start, when a budget is not given


class PlacementError(ValueError):
    """The model's training state does not fit the tier budgets (raised before any allocation)."""


@dataclass
class Placement:
    weight_home: dict[int, str]
    state_home: dict[int, str]
    need: dict[str, int]             # bytes each tier will hold (model states + the runtime's parts)
    hbm_budget: int
    dram_budget: int
    nvme_budget: int
    rows: list[tuple] = field(default_factory=list)
    knobs: Knobs = field(default_factory=Knobs)   # the working set's optional parts, shrunk to the budgets
    parts: list[dict] = field(default_factory=list)  # offload.plan.memory.runtime_parts
    notes: list[str] = field(default_factory=list)   # what was shrunk to fit, said once
    pool_chunks: int = 0
    chunk_bytes: int = 0             # chunk_bytes, or less when every unit's largest buffer is smaller
    grad_reserve: int = 0            # hbm bytes the gradients on their way to dram may hold (back-pressure)
    swap_dir: str | None = None      # this rank's directory of nvme_path (Config.swap_dir)
    owners: dict[int, list[int]] = field(default_factory=dict)  # zero_stage 1-3 over ranks: unit -> window owners
    weight_owners: dict[int, list[int]] = field(default_factory=dict)  # zero_stage 3: partitioned units' chunks
    deferred: tuple = ()             # units whose step waits for their next fetch, in forward order ([Note: split step])
    fetched_peak: int = 0            # the peak of fetched weights of shared_sizes in the hbm working set
    shared_sizes: frozenset = frozenset()  # nbytes several fetched units share ([Note: reused host memory for hbm])
    precision: PrecisionChoice | None = None  # what runs and why (offload.plan.precision)
    trainable_numel: int = 0         # parameters trained (weights + optimizer states + gradient)
    frozen_numel: int = 0            # parameters frozen (weights only: no master, moments or gradient I/O)
    quantized: dict = field(default_factory=dict)  # kind (nf4, fp4, int8) -> [parameters, record bytes]
    int8_saving: dict = field(default_factory=dict)  # fp32 states: tier -> bytes int8 moments would spare there
    activations: ActivationModel | None = None  # the model's activations by formula (offload.plan.activation_memory)
    activation_shape: tuple[int, int] | None = None  # (batch, seq) the plan counts activations for; None: none
    base_need: dict = field(default_factory=dict)   # need without activations, at the knobs that run
    least_need: dict = field(default_factory=dict)  # need without activations, at the least working set (MINIMUM)

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in self.weight_home.values() or "nvme" in self.state_home.values()

    @property
    def reuse_bytes(self) -> int:
        return self.knobs.reuse_bytes

    @property
    def read_ahead(self) -> bool:
        return self.knobs.read_ahead

    def describe(self) -> str:
        lines = ["offload placement:", f"  {'unit':40s} {'numel':>12s} {'weights':>8s} {'optimizer':>9s}"]
        for name, numel, w, s in self.rows:
            lines.append(f"  {name[:40]:40s} {numel:12d} {w:>8s} {s:>9s}")
        lines.append(self.summary())
        return "\n".join(lines)

    def summary(self) -> str:
        """Per tier: need of budget, and the runtime's parts with their formulas."""
        lines = [f"  {self.precision.line()}"] if self.precision is not None else []
        if self.frozen_numel:  # a LoRA run: the frozen base apart from the trained adapters
            states = "/".join(sorted(set(self.state_home.values()))) or "-"
            weights = "/".join(sorted(set(self.weight_home.values()) - {"hbm"})) or "hbm"  # the rest unit: hbm
            lines.append(f"  parameters: {self.trainable_numel:,} trained (weights, fp32 states and gradients: states "
                         f"in {states}), {self.frozen_numel:,} frozen (weights only, in {weights})")
        for kind, (numel, nbytes) in sorted(self.quantized.items()):
            lines.append(f"  quantized: {numel:,} of them {kind}, stored and moved as {nbytes / 2**20:.1f} MiB "
                         f"({8 * nbytes / numel:.2f} bits a parameter with their quantization state)")
        for tier in ("hbm", "dram", "nvme"):
            budget = getattr(self, f"{tier}_budget")
            lines.append(f"  {tier}: needs {self.need[tier] / 2**20:.1f} MiB of a {budget / 2**20:.1f} MiB budget")
        for p in self.parts:
            lines.append(f"    {p['tier']} {p['name']}: {p['bytes'] / 2**20:.1f} MiB = {p['formula']}")
        if self.activations is not None:
            lines.append(f"  {self.activations.line(*(self.activation_shape or (None, None)))}")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _default_budgets(device: torch.device) -> tuple[int, int]:
    avail = hostmem.available()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * SAFETY), int(avail * SAFETY)
    return int(avail * SAFETY), int(avail * SAFETY)  # the CPU backend's "hbm" is host memory too


def check_split_master(cfg, precision: PrecisionChoice) -> None:
    """optimizer.master "split" needs bf16 to run: refused, saying what the precision asked for resolved to."""
    if cfg.optimizer.master == "split" and precision.name != "bf16":
        fail("optimizer.master", "split", f"is the bf16 weight plus a 17-bit record, and precision "
             f"{cfg.precision!r} runs as {precision.name} here ({precision.reason})", 'set precision "bf16" or master '
             '"fp32"')


def plan_placement(units: list[Unit], cfg, device: torch.device, check: bool = True,
                   order: list[int] | None = None, world: int = 1, rank: int = 0,
                   precision: PrecisionChoice | None = None, activations: ActivationModel | None = None) -> Placement:
    """Homes per unit and the bytes each tier needs (on `rank` of `world`); `check` runs the preflight
    (raises PlacementError). order: the units of a forward (offload.plan.units.forward_order), for hbm's working
    set (offload.plan.memory). With zero_stage 1-3 over several ranks a rank holds the states of the windows it
    owns (offload.plan.chunks.window_owners) and two more pool chunks (the gradient reduce,
    offload.step.accumulator); with stage 3 also only the weights of its chunks of every unit that is fetched (not
    the persistent ones).
    precision: the engine's choice for cfg.precision on `device`; resolved here when not given ("auto").
    activations: the model's activations by formula, counted for cfg.activations' batch and seq when given
    (offload.plan.activation_memory; the preflight then refuses activations that do not fit, naming the longest
    sequence that would)."""
    precision = precision or resolve_precision(cfg.precision, device)
    check_split_master(cfg, precision)
    cfg = replace(cfg, precision=precision.name)  # the plan follows the precision that runs
    itemsize = cfg.compute_dtype.itemsize
    chunk_bytes = planned_chunk_bytes(cfg.chunk_bytes, max((u.numel for u in units), default=0))
    sharded = world > 1 and cfg.zero_stage in (1, 2, 3)
    owners, weight_owners = {}, {}
    if sharded and cfg.zero_stage == 3:  # every chunk of every unit; a state window is its unit's chunk
        owned = window_owners([len(weight_chunks(u.numel, u.trainable_numel, chunk_bytes // 4)) for u in units], world)
        weight_owners = {u.index: o for u, o in zip(units, owned) if not u.persistent}
        owners = {u.index: o[:len(chunk_spans(u.trainable_numel, chunk_bytes // 4))]
                  for u, o in zip(units, owned) if u.trainable_numel}
    elif sharded:
        trainable_units = [u for u in units if u.trainable_numel]
        owned = window_owners([len(chunk_spans(u.trainable_numel, chunk_bytes // 4)) for u in trainable_units], world)
        owners = {u.index: o for u, o in zip(trainable_units, owned)}
    w_home, s_home = OFFLOAD_TIER[cfg.offload_param.device], OFFLOAD_TIER[cfg.offload_optimizer.device]
    if s_home == "hbm" and w_home != "hbm":
        check_states_in_hbm(units, cfg, device)
    if cfg.optimizer.master == "split" and s_home == "hbm" and device.type != "cpu":
        fail("optimizer.master", "split", f"is stepped by CPU Adam, and offload_optimizer none keeps the states in "
             f"{device.type} memory, stepped there", 'offload the optimizer (offload_optimizer cpu or nvme) or use '
             'master "fp32"')
    weight_home = {u.index: "hbm" if u.persistent else w_home for u in units}
    state_home = {u.index: s_home for u in units if u.trainable_numel}
    states = {"hbm": 0, "dram": 0, "nvme": 0}
    saving = dict(states)
    rows = []
    # An nvme gradient accumulator exists only when the step does not follow each gradient at once.
    grad = not (s_home == "nvme" and every_step_overlapped(cfg, sharded))
    for u in units:
        states[weight_home[u.index]] += owned_numel(weight_chunks(u.numel, u.trainable_numel, chunk_bytes // 4),
                                                    weight_owners.get(u.index), rank) * itemsize
        if u.trainable_numel:
            owned = owned_numel(chunk_spans(u.trainable_numel, chunk_bytes // 4), owners.get(u.index), rank)
            small = small_numel(u) * owned // u.trainable_numel  # over ranks: its share, as an estimate
            o = cfg.optimizer
            states[state_home[u.index]] += state_bytes(owned, o.states, small, grad, o.master)
            if o.states == "fp32":
                saving[state_home[u.index]] += (state_bytes(owned, "fp32", 0, grad, o.master)
                                                - state_bytes(owned, "int8", small, grad, o.master))
        rows.append((u.name, u.numel, weight_home[u.index], state_home.get(u.index, "-")))
    default_hbm, default_dram = _default_budgets(device)
    p = Placement(weight_home, state_home, dict(states), cfg.budgets.hbm_bytes or default_hbm,
                  cfg.budgets.dram_bytes or default_dram, _free_disk(cfg.swap_dir(rank)) if cfg.nvme_path else 0, rows)
    p.swap_dir, p.precision, p.int8_saving = cfg.swap_dir(rank), precision, saving
    p.activations = activations
    if activations is not None and activations.dims is not None and cfg.activations.batch is not None:
        p.activation_shape = (cfg.activations.batch, cfg.activations.seq)
    p.trainable_numel = sum(s.numel for u in units for s in u.slots if s.trainable)
    p.frozen_numel = sum(s.numel if s.record is None else s.record.numel for u in units for s in u.slots
                         if not s.trainable)
    for s in (s for u in units for s in u.slots if s.record is not None):
        counts = p.quantized.setdefault(s.record.kind, [0, 0])
        counts[0] += s.record.numel
        counts[1] += s.record.nbytes
    p.deferred = deferred_units(units, cfg, weight_home, state_home, sharded, order)
    for i in p.deferred:  # their gradient waits on nvme for the next forward, in the compute dtype
        states["nvme"] += units[i].trainable_numel * itemsize
    p.chunk_bytes, p.owners, p.weight_owners = chunk_bytes, owners, weight_owners
    # zero_stage 3 fetches even weights whose home is hbm: their shard lives there, the whole unit is gathered
    fetched = [u.numel for u in units if weight_home[u.index] != "hbm" or u.index in weight_owners]
    trainable = [u.trainable_numel for u in units if u.trainable_numel]
    fetch_home = "dram" if w_home == "hbm" and weight_owners else w_home  # the working set: as from dram
    # new weights of a trained unit resident in hbm (the rest's norms, whatever w_home) pass through a chunk
    hbm_trained = any(weight_home[u.index] == "hbm" and u.trainable_numel for u in units)

    def plan(knobs: Knobs, shape: tuple[int, int] | None = p.activation_shape) -> tuple[list[dict], dict[str, int]]:
        parts = runtime_parts(fetched, trainable, itemsize, fetch_home, s_home, device.type, p.chunk_bytes, knobs,
                              order, [u.numel for u in units], [u.trainable_numel for u in units], hbm_trained,
                              cfg.optimizer.states, cfg.optimizer.master)
        if world > 1 and not sharded and itemsize < 4:  # offload.step.gradients.average_over_ranks
            largest = max((s.numel for u in units for s in u.slots if s.trainable), default=0)
            parts.append({"name": "gradient all-reduce buffer", "tier": "hbm", "bytes": largest * 4,
                          "formula": f"the largest trainable parameter ({largest}) x 4 B, over {world} ranks"})
        if sharded:  # offload.step.accumulator.accumulate over ranks: the window reduced, and the nvme accumulator
            parts.append({"name": "gradient reduce chunks", "tier": "dram", "bytes": 2 * p.chunk_bytes,
                          "formula": f"2 pool chunks x chunk_bytes {p.chunk_bytes} (zero_stage {cfg.zero_stage}, "
                                     f"{world} ranks)"})
        if shape is not None:
            parts += activations.parts(*shape)
        need = totals(parts)
        return parts, {t: states[t] + need[t] for t in states}

    p.knobs, p.notes = _fit(plan, p, cfg)
    p.parts, p.need = plan(p.knobs)
    p.grad_reserve = grad_reserve(trainable, itemsize, p.knobs)
    p.pool_chunks = pool_chunks(fetch_home, s_home, device.type, p.knobs.read_ahead, hbm_trained,
                                bool(trainable), cfg.optimizer.states, chunk_bytes, cfg.optimizer.master)[0] + 2 * sharded
    # reuse_bytes derived from the room the rest leaves; with nothing trainable no backward uses them again
    if cfg.reuse_bytes is None and trainable:
        p.knobs = replace(p.knobs, reuse_bytes=reuse_allowance(fetched, itemsize, p, device))
        p.parts, p.need = plan(p.knobs)
    if fetch_home != "hbm" and order is not None and not weight_owners and p.knobs.reuse_distance >= 0:
        # not over ranks (they would have to agree), nor where the user asked for every unit released after use
        reserve = grad_reserve(trainable, itemsize, p.knobs)
        p.knobs = replace(p.knobs, held=free_holds(order, [u.numel for u in units], [u.trainable_numel for u in units],
                                                   itemsize, p.knobs, reserve))
    if fetch_home != "hbm" and order is not None:  # [Note: reused host memory for hbm] in offload.state.tiers
        sizes = collections.Counter(n * itemsize for n in fetched)
        p.shared_sizes = frozenset(n for n, count in sizes.items() if count > 1)
        shared = [u.numel if u.numel * itemsize in p.shared_sizes and weight_home[u.index] != "hbm" else 0
                  for u in units]
        p.fetched_peak = working_set_peak(order, shared, [0] * len(units), itemsize, p.knobs, 0, bool(trainable))
    p.base_need, p.least_need = plan(p.knobs, None)[1], plan(MINIMUM, None)[1]
    if check:  # the least it can train with: the activations' parts apart (activations_advice)
        preflight(p, device, cfg, p.least_need)
    return p


def engine_plan(model, config=None) -> dict:
    """What the Engine itself plans for `model` in one process: its placement's bytes per tier (its flat,
    padded unit buffers plus staging buffers, hbm working set and the reuse allowance, which is derived
    from this machine's memory unless reuse_bytes is given), computed without allocating anything.
    `model` may live on the meta device. A measured run stays within this plan (tests/test_estimate_engine.py)."""
    cfg = load_config(config)
    units = partition(model, cfg.units.min_numel, cfg.units.classes, itemsize=cfg.compute_dtype.itemsize)
    device = torch.device("cpu")
    activations = activation_model(model, replace(cfg, precision=resolve_precision(cfg.precision, device).name), device)
    need = plan_placement(units, cfg, device, check=False, order=forward_order(model, units),
                          activations=activations).need
    return {f"{t}_bytes": need[t] for t in TIERS}


def check_states_in_hbm(units: list[Unit], cfg, device: torch.device) -> None:
    """offload_optimizer none with offloaded weights: the trained parameters' states stay in hbm (a LoRA run's
    adapters beside a frozen base on nvme). Refused on CUDA, where it has never run, and where those states
    alone exceed the hbm budget given; otherwise the preflight checks the whole plan as for any placement."""
    where = f"offload_optimizer.device=none with offload_param.device={cfg.offload_param.device}"
    if device.type == "cuda":
        raise PlacementError(f"{where}: optimizer states in GPU memory beside offloaded weights have never run on "
                             "CUDA; set offload_optimizer to cpu (the trained parameters' states in host memory)")
    nbytes = sum(state_bytes(u.trainable_numel, cfg.optimizer.states, small_numel(u), master=cfg.optimizer.master)
                 for u in units)
    budget = cfg.budgets.hbm_bytes
    if budget and nbytes > budget:
        trained = sum(s.numel for u in units for s in u.slots if s.trainable)
        raise PlacementError(f"{where}: the states of the {trained:,} trained parameters need {nbytes} bytes "
                             f"({nbytes / 2**30:.2f} GiB: fp32 master, moments and gradient) but budgets.hbm_bytes is "
                             f"{budget}; set offload_optimizer to cpu or nvme, train fewer parameters (a smaller "
                             "--lora rank or fewer --lora-targets), or raise budgets.hbm_bytes")


def small_numel(unit: Unit) -> int:
    """The elements of `unit`'s trainable prefix in parameters under 4096 elements (to the next one's start),
    whose moments stay fp32 with optimizer.states int8 ([Note: int8 optimizer states])."""
    slots = sorted((s for s in unit.slots if s.trainable), key=lambda s: s.offset)
    ends = [s.offset for s in slots[1:]] + [unit.trainable_numel]
    return sum(end - s.offset for s, end in zip(slots, ends) if s.numel < 4096)


def deferred_units(units, cfg, weight_home: dict, state_home: dict, sharded: bool, order) -> tuple:
    """[Note: split step] in offload.step.pipeline: with the overlapped step and optimizer states on nvme, the
    fraction split_step of the trainable units whose weights are fetched, spread evenly over the forward
    order, never the first (its step could overlap nothing before its use): 0.5 defers every other unit
    from the second on, 0.25 every fourth from the fourth on."""
    f = float(cfg.split_step)
    if not (f and every_step_overlapped(cfg, sharded)):
        return ()
    seen = list(dict.fromkeys(order if order is not None else range(len(units))))
    fetched = [i for i in seen if units[i].trainable_numel and state_home.get(i) == "nvme" and weight_home[i] != "hbm"]
    return tuple(i for k, i in enumerate(fetched) if k and int(k * f + 1e-9) > int((k - 1) * f + 1e-9))


def _fit(plan, p: Placement, cfg) -> tuple[Knobs, list[str]]:
    """The default knobs, or the optional parts given up one by one ([Note: shrinking to a budget] in
    offload.plan.memory) until hbm and dram fit their budgets; the minimum if nothing fits (preflight refuses)."""
    knobs = Knobs(prefetch_units=cfg.prefetch_units, reuse_distance=cfg.reuse_distance, reuse_bytes=cfg.reuse_bytes or 0)
    steps = [replace(knobs, prefetch_units=n) for n in range(knobs.prefetch_units - 1, -1, -1)]
    steps = [knobs] + steps
    steps += [replace(steps[-1], read_ahead=False),
              replace(steps[-1], read_ahead=False, grad_units=1, reuse_distance=min(0, knobs.reuse_distance))]
    for k in steps:
        _, need = plan(k)
        if need["hbm"] <= p.hbm_budget and need["dram"] <= p.dram_budget:
            break
    if k == knobs:
        return k, []
    changes = [f"{name} {getattr(knobs, name)} -> {getattr(k, name)}" for name in ("prefetch_units", "read_ahead",
               "grad_units", "reuse_distance") if getattr(knobs, name) != getattr(k, name)]
    return k, [f"the budgets (hbm {p.hbm_budget} B, dram {p.dram_budget} B) are below the default working set: "
               f"{', '.join(changes)} (slower, not different: every number trained is the same)"]


def reuse_allowance(fetched: list[int], itemsize: int, p: Placement, device: torch.device) -> int:
    """Bytes of fetched weights the engine may keep in hbm until their next use in the same step (a
    forward's units until their backward) rather than release and fetch them again: half the hbm room
    the placement leaves (the budget less its need; on the CPU backend, where hbm is host memory too,
    also less the dram need), the other half left to activations, which no accountant sees."""
    room = p.hbm_budget - p.need["hbm"]
    if device.type == "cpu":
        room = min(room, int(hostmem.available() * SAFETY) - p.need["hbm"] - p.need["dram"])
    return max(0, min(sum(fetched) * itemsize, room // 2))


def _free_disk(swap_dir: str) -> int:
    path = os.path.abspath(swap_dir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def check_nvme_path(path: str) -> None:
    """Raises an OSError that names `path` and what is wrong with it as a swap directory: it must be, or be
    creatable as, a directory in which this process can create files. Tried for real (root passes every
    permission check that access() makes, and a read-only or pseudo filesystem only shows when writing)."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, f"nvme_path={path}: exists and is not a directory; pass a "
                                 "directory on a local drive (--nvme-path DIR)")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise type(e)(e.errno, f"nvme_path={path}: cannot create swap files there ({e.strerror or e}); pass a "
                      "writable directory on a local drive (--nvme-path DIR)") from e


def preflight(p: Placement, device: torch.device, cfg, minimum: dict[str, int]) -> None:
    if p.uses_nvme:
        check_nvme_path(p.swap_dir)
    problems = []
    for tier in ("hbm", "dram", "nvme"):
        budget = getattr(p, f"{tier}_budget")
        if p.need[tier] > budget:
            what = "free disk under nvme_path" if tier == "nvme" else f"budget (budgets.{tier}_bytes)"
            kept = f", {p.reuse_bytes} of them reuse_bytes," if tier == "hbm" and p.reuse_bytes else ""
            besides = " besides activations" if p.activation_shape else ""
            least = "" if tier == "nvme" else f"; the least it can train with{besides} is {minimum[tier]} bytes " \
                f"({minimum[tier] / 2**30:.2f} GiB: the largest unit's weights and gradient, one optimizer window)"
            problems.append(f"{tier} needs {p.need[tier]} bytes ({p.need[tier] / 2**30:.2f} GiB){kept} but the "
                            f"{what} is {budget} bytes ({budget / 2**30:.2f} GiB){least}{_int8_hint(p, tier)}")
    in_host = ("dram", "hbm") if device.type == "cpu" else ("dram",)
    host = sum(p.need[t] for t in in_host)
    avail = hostmem.available()
    if host > avail:
        shape = p.activation_shape
        acts = sum(q["bytes"] for q in p.activations.parts(*shape) if q["tier"] in in_host) if shape else 0
        share = (f", {acts} bytes ({acts / 2**30:.2f} GiB) of it the activations of batch {shape[0]} x seq "
                 f"{shape[1]} (a smaller batch or sequence, or activation_checkpointing, lowers them)") if acts else ""
        problems.append(f"host memory: needs {host} bytes ({host / 2**30:.2f} GiB){share} but only {avail} bytes "
                        f"are available ({hostmem.describe()})")
    over = {t for t in TIERS if p.need[t] > getattr(p, f"{t}_budget")}
    if over and p.activation_shape is not None and over & {q["tier"] for q in p.activations.parts(*p.activation_shape)}:
        problems.append(activations_advice(p, *p.activation_shape, p.least_need))
    if problems:
        raise PlacementError("the model does not fit: " + "; ".join(problems) +
                             "; offload more (offload_param / offload_optimizer = nvme), raise the budgets, "
                             "or use smaller units (units.min_numel) or chunks (chunk_bytes)")


def _int8_hint(p: Placement, tier: str) -> str:
    """What `tier` would need with int8 optimizer states, where the run keeps fp32 ones there."""
    saving = p.int8_saving.get(tier, 0)
    if not saving:
        return ""
    need = p.need[tier] - saving
    return (f" (with int8 optimizer states, optimizer.states: int8 or --optimizer-states int8, it needs {need} bytes "
            f"({need / 2**30:.2f} GiB))")


def owned_numel(spans: list[tuple[int, int]], owners: list[int] | None, rank: int) -> int:
    """Elements of a unit's buffer (its windows or chunks `spans`) that `rank` holds: all of them, or those
    of the spans it owns."""
    return sum(e - b for (b, e), r in zip(spans, owners or [rank] * len(spans)) if r == rank)


def fits_with_activations(p: Placement, base: dict[str, int], activations: ActivationModel, batch: int,
                          seq: int) -> bool:
    """Whether `base` (a need without activations) and the activations of batch x seq fit the hbm and dram
    budgets and the free disk."""
    parts = activations.parts(batch, seq)
    return all(base[t] + sum(q["bytes"] for q in parts if q["tier"] == t) <= getattr(p, f"{t}_budget")
               for t in TIERS)


def activations_advice(p: Placement, batch: int, seq: int, base: dict[str, int]) -> str:
    """The refusal's line on activations: what batch x seq needs, the longest sequence that fits at this batch
    beside `base` (the rest of the need), and how far activation_checkpointing and offload_activations would
    take it."""
    act = p.activations
    need = {t: sum(q["bytes"] for q in act.parts(batch, seq) if q["tier"] == t) for t in TIERS}
    held = ", ".join(f"{t} {n} bytes ({n / 2**30:.2f} GiB)" for t, n in need.items() if n)
    line = (f"activations of batch {batch} x seq {seq} need {held}; at batch {batch} the longest sequence that "
            f"fits is {longest_seq(lambda t: fits_with_activations(p, base, act, batch, t), seq)}")
    tries = [] if act.checkpointing else [("activation_checkpointing", replace(act, checkpointing=True))]
    if act.tier == "hbm":
        tries.append(("activation_checkpointing and offload_activations cpu",
                      replace(act, checkpointing=True, tier="dram")))
    for what, other in tries:
        longest = longest_seq(lambda t: fits_with_activations(p, base, other, batch, t), 1 << 24)
        if longest > 0:
            line += f" ({longest} with {what})"
            break
    return line
