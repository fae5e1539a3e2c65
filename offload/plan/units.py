"""Units: the module subtrees whose parameters move together, and their flat-buffer layout."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from offload.plan import quantized

# [Note: the unit policy]
# Without `units.classes`, the elements of module containers (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# become units (transformer blocks, the layers of an MLP), and any other child subtree holding at least
# `units.min_numel` parameters and no container becomes one unit (embeddings, lm_head). Parameters left
# over (norms, biases of the root) form the resident "rest" unit, which stays in hbm. A parameter shared
# by several modules (tied embeddings) belongs to the first unit that holds it; the other modules that
# use it fetch that unit before they run ("users"). The module dicts of peft's tuner layers (one
# entry per adapter) are not containers: LoRA's lora_A and lora_B stay in their decoder layer's unit.
#
# [Note: the flat layout]
# Each unit has one flat buffer per dtype: trainable parameters first, then frozen ones, so that the
# optimizer states (fp32 master, exp_avg, exp_avg_sq, gradient) cover the contiguous prefix
# [0, trainable_numel). A trainable parameter starts at a multiple of TRAINABLE_ALIGN_NUMEL elements (one
# block of int8 moments: [Note: int8 optimizer states] in offload/kernels/quant8.py), a frozen one at a
# multiple of 32, and both the trainable prefix and the whole buffer are padded to ALIGN_NUMEL x
# world_size, so a later ZeRO stage can cut each buffer into `world_size` equal shards that each start
# 4 KiB-aligned in bf16 and fp32.

ALIGN_NUMEL = 2048  # 4 KiB of bf16, 8 KiB of fp32
TRAINABLE_ALIGN_NUMEL = 256
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
REST = "<rest>"


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass
class Slot:
    """One parameter's place in its unit's flat buffer."""

    name: str              # the first fully qualified name of the parameter
    param: nn.Parameter
    offset: int            # in elements
    numel: int
    shape: torch.Size
    trainable: bool
    record: object = None  # a quantized weight's Record (offload.plan.quantized): numel counts its bytes' elements

    def attach(self, flat: torch.Tensor) -> None:
        """Points the parameter (a quantized one: its record's tensors) at its place in `flat`."""
        region = flat[self.offset:self.offset + self.numel]
        if self.record is None:
            self.param.data = region.view(self.shape)
        else:
            self.record.bind(region.view(torch.uint8))

    def detach(self, placeholder: torch.Tensor) -> None:
        """Points the parameter at an empty placeholder (a quantized one: empty tensors of its own dtypes)."""
        if self.record is None:
            self.param.data = placeholder
        else:
            self.record.unbind(placeholder.device)

    def value(self, flat: torch.Tensor) -> torch.Tensor:
        """The parameter's value from its place in `flat`, in fp32 (a quantized one dequantized)."""
        region = flat[self.offset:self.offset + self.numel]
        if self.record is None:
            return region.to("cpu", torch.float32, copy=True).view(self.shape)
        return self.record.dequantize(region.cpu().view(torch.uint8)).to(torch.float32)


@dataclass
class Unit:
    index: int
    name: str                       # module path, or REST
    module: nn.Module | None        # the subtree root (None for the rest unit)
    slots: list[Slot]
    numel: int                      # padded flat numel (all parameters)
    trainable_numel: int            # padded numel of the trainable prefix
    users: list[nn.Module] = field(default_factory=list)  # modules outside `module` using its params

    @property
    def persistent(self) -> bool:
        return self.module is None

    def key(self, kind: str, rank: int = 0) -> str:
        """Stable swap/checkpoint key: unit path + kind (weight dtype, master, exp_avg, ...) + rank."""
        return f"{self.name}/{kind}/rank{rank}"


def _subtree_numel(module: nn.Module, taken: set) -> int:
    return sum(p.numel() for p in module.parameters() if p not in taken)


def _adapter_dicts(model: nn.Module) -> set:
    """The module dicts of peft's tuner layers (lora_A, lora_B, lora_dropout: one entry per adapter name):
    an adapter's few parameters belong to its layer's unit, so these are not containers of units (as
    containers, a 7B Llama with LoRA on q and v would split into 291 units). Empty when peft is not
    imported."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    layer_class = getattr(tuners, "BaseTunerLayer", None)
    if layer_class is None:
        return set()
    return {child for m in model.modules() if isinstance(m, layer_class)
            for child in m.children() if isinstance(child, CONTAINERS)}


def _is_container(module: nn.Module, adapters: set) -> bool:
    return isinstance(module, CONTAINERS) and module not in adapters


def _has_container(module: nn.Module, adapters: set) -> bool:
    return any(_is_container(m, adapters) for m in module.modules())


def _unit_roots(model: nn.Module, min_numel: int, classes: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    roots: list[tuple[str, nn.Module]] = []
    taken: set = set()
    adapters = _adapter_dicts(model)

    def take(path: str, module: nn.Module) -> None:
        roots.append((path, module))
        taken.update(module.parameters())

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if classes:
                take(path, child) if type(child).__name__ in classes else visit(path, child)
            elif _subtree_numel(child, taken) == 0:
                continue
            elif _is_container(module, adapters) and not _has_container(child, adapters):
                take(path, child)
            elif _has_container(child, adapters):
                visit(path, child)
            elif _subtree_numel(child, taken) >= min_numel:
                take(path, child)

    visit("", model)
    if classes and not roots:
        found = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"units.classes={list(classes)}: no module of these classes in the model; "
                         f"classes present: {found}")
    return roots


def _layout(index: int, name: str, module, params: list[tuple[str, nn.Parameter]], world_size: int,
            records: dict, itemsize: int) -> Unit:
    pad = ALIGN_NUMEL * world_size
    slots: list[Slot] = []
    offset = 0

    def place(group, align: int) -> None:
        nonlocal offset
        for pname, p in group:
            rec = records.get(p)
            numel = p.numel() if rec is None else -(-rec.nbytes // itemsize)  # a record: its bytes as elements
            slots.append(Slot(pname, p, offset, numel, p.shape, p.requires_grad, rec))
            offset = _round_up(offset + numel, align)

    place([np for np in params if np[1].requires_grad], TRAINABLE_ALIGN_NUMEL)
    trainable_numel = offset = _round_up(offset, pad)
    place([np for np in params if not np[1].requires_grad], 32)
    return Unit(index, name, module, slots, _round_up(max(offset, 1), pad), trainable_numel)


def partition(model: nn.Module, min_numel: int, classes: tuple[str, ...] = (), world_size: int = 1,
              itemsize: int = 4) -> list[Unit]:
    """Splits `model` into units (see the notes above); the rest unit, if any, comes last. `itemsize`: the
    bytes of an element of the flat buffers (the compute dtype's), which a quantized weight's record fills
    ([Note: quantized weights as records] in offload.plan.quantized)."""
    records = quantized.records(model)
    owner: dict = {}  # parameter -> unit index (first holder wins: tied weights)
    units: list[Unit] = []
    for path, module in _unit_roots(model, min_numel, classes):
        params = [(f"{path}.{n}", p) for n, p in module.named_parameters() if p not in owner]
        if not params:
            continue
        for _, p in params:
            owner[p] = len(units)
        units.append(_layout(len(units), path, module, params, world_size, records, itemsize))
    rest = [(n, p) for n, p in model.named_parameters() if p not in owner]
    if rest:
        for _, p in rest:
            owner[p] = len(units)
        units.append(_layout(len(units), REST, None, rest, world_size, records, itemsize))
    _attach_users(model, units, owner)
    return units


def _attach_users(model: nn.Module, units: list[Unit], owner: dict) -> None:
    """Modules that use a unit's parameters from outside the unit's subtree fetch it too (tied weights)."""
    inside = {u.index: set(u.module.modules()) for u in units if u.module is not None}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            u = units[owner[p]]
            if not u.persistent and module not in inside[u.index] and module not in u.users:
                u.users.append(module)


def forward_order(model: nn.Module, units: list[Unit]) -> list[int]:
    """The units fetched in one forward, in the order their modules appear in the model (a unit's root
    and each module using its tied parameters): the order a model that runs its modules as it lists
    them fetches them in. The memory model replays the residency policy over it (offload.plan.memory)."""
    at = {u.module: u.index for u in units if u.module is not None}
    for u in units:
        for m in u.users:
            at.setdefault(m, u.index)
    return [at[m] for m in model.modules() if m in at and not units[at[m]].persistent]
