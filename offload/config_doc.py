"""The config reference: a markdown table (key path, type, default, help) generated from the Config
dataclasses, written into docs/config.md so the reference cannot drift from the code
(tests/test_config_doc.py checks it).

    python -m offload.config_doc                        # print the table
    python -m offload.config_doc --write docs/config.md # replace the text between the file's markers
    python -m offload.config_doc --check docs/config.md # exit 1 if the file differs from the code

Help text comes from the field's inline comment in offload/plan/config.py, else from HELP below, else (for a
section) from its dataclass docstring. A field with none of these fails the test: document new keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import sys
import typing

from offload.plan.config import Config

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
DOC = "docs/config.md"  # the reference, relative to the repository root
REGENERATE = f"python -m offload.config_doc --write {DOC}"

HELP = {
    "precision": 'compute dtype of weights and gradients: "auto" (bf16 where the device runs it natively, fp16 '
                 'on an older GPU, fp32 on other CPUs; docs/precision.md), "bf16", "fp16" or "fp32"; master '
                 "weights and optimizer states are always fp32",
    "optimizer": "the optimizer, run on the CPU over fp32 states (CPU Adam)",
    "optimizer.type": '"adamw" (decoupled weight decay) or "adam" (L2 weight decay)',
    "optimizer.lr": "base learning rate; lr_schedule multiplies it",
    "optimizer.betas": "Adam's decay rates of the first and second moments",
    "optimizer.eps": "added to the denominator for numerical stability",
    "optimizer.weight_decay": "weight decay (0: none)",
    "optimizer.states": '"fp32" or "int8": exp_avg and exp_avg_sq as blockwise 8-bit codes, 256 a block with one '
                        'fp32 absmax (tensors under 4096 elements keep fp32; docs/design.md "int8 optimizer states")',
    "optimizer.master": '"fp32" (the only one built; "split", a bf16 weight plus a 16-bit remainder, is refused)',
    "gradient_accumulation_steps": "micro-batches (backward calls) per optimizer step",
    "gradient_clipping": "clip the global gradient norm to this value (0: off)",
    "zero_stage": "ZeRO partitioning of states over torch.distributed ranks: 0, 1, 2 or 3",
    "offload_param": "where weights live between uses",
    "offload_param.device": '"none" (hbm, the accelerator), "cpu" (dram) or "nvme" (swap files under nvme_path)',
    "offload_optimizer": "where the fp32 optimizer states (master, exp_avg, exp_avg_sq, gradient accumulator) live",
    "offload_optimizer.device": '"none" (hbm), "cpu" (dram) or "nvme"; must be offloaded when the weights are',
    "offload_activations": "where the inputs kept by the engine's activation checkpoints live between a unit's "
                           "forward and its backward",
    "offload_activations.device": '"none" (hbm, where they are made), "cpu" (dram) or "nvme"; needs '
                                  "activation_checkpointing",
    "activations": "the micro-batch the memory plan counts activations for, by formula from the model's shape "
                   '(docs/python.md "Planning a long sequence"): batch and seq, both or neither; null: none until the '
                   "first forward, which is refused if its activations do not fit; `offload train` sets its "
                   "--batch-size and --seq-len",
    "nvme_path": 'directory for swap files; required when a device is "nvme" (use a fast local drive); or a '
                 'list of several, one per drive: each local rank takes its turn',
    "budgets.hbm_bytes": 'accelerator memory budget, e.g. "2.5G" (null: derived from the free memory with a safety '
                         "margin; `offload train --hbm`)",
    "budgets.dram_bytes": 'host memory budget, e.g. "8G" (null: derived from the available RAM, or what a memory '
                          "cgroup's limit leaves, with a safety margin; `offload train --dram`)",
    "aio.engine": '"auto" (libaio when importable, else threads), "libaio" or "threads"',
    "aio.block_bytes": "bytes per I/O request, a multiple of 4096",
    "aio.queue_depth": "I/O requests in flight",
    "aio.threads": "worker threads of the threads backend",
    "lr_schedule.warmup_steps": "optimizer steps of linear warmup up to the base lr (then the decay, if any)",
    "loss_scale.initial": "initial fp16 loss scale",
    "loss_scale.growth_interval": "optimizer steps without overflow before the scale doubles",
    "loss_scale.min_scale": "the scale never drops below this",
}


def _comments(cls) -> dict[str, str]:
    """{field name: its inline `# comment`} from the dataclass's source."""
    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"^\s+(\w+)\s*:[^#]*#\s*(.+)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def _type_name(hint) -> str:
    if dataclasses.is_dataclass(hint):
        return "section"
    text = getattr(hint, "__name__", None) if typing.get_origin(hint) is None else None
    return text or str(hint).replace("typing.", "").replace("NoneType", "None")


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def rows(cls=Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key path, type, default as JSON, help) for every field, sections before their keys."""
    hints, comments = typing.get_type_hints(cls), _comments(cls)
    out = []
    for f in dataclasses.fields(cls):
        key, hint = prefix + f.name, hints[f.name]
        doc = (inspect.getdoc(hint) or "").split("\n\n")[0].replace("\n", " ") if dataclasses.is_dataclass(hint) else ""
        text = comments.get(f.name) or HELP.get(key) or doc
        if dataclasses.is_dataclass(hint):
            out.append((key, "section", "", text))
            out.extend(rows(hint, key + "."))
        else:
            out.append((key, _type_name(hint), json.dumps(_default(f)), text))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    lines = [f"Generated from `offload/plan/config.py` by `{REGENERATE}`; edit the code, not this table.",
             "Keys nest as in JSON/YAML (`optimizer.lr` is `{\"optimizer\": {\"lr\": ...}}`); unknown keys are an error.",
             'A `*_bytes` key takes a byte count or a size string: "2.5G", "512M", "64K" (binary units: 1K = 1024).',
             "", "| key | type | default | description |", "|---|---|---|---|"]
    for key, type_, default, text in rows():
        lines.append(f"| `{key}` | {_cell(type_)} | {f'`{default}`' if default else ''} | {_cell(text)} |")
    return "\n".join(lines)


def replace_section(text: str, generated: str) -> str:
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        raise ValueError(f"no {BEGIN} ... {END} markers; add them where the reference belongs")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{generated}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m offload.config_doc", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", metavar="FILE", help="replace the text between the markers in this file")
    g.add_argument("--check", metavar="FILE", help="exit 1 if this file's section differs from the code")
    args = p.parse_args(argv)
    generated = markdown()
    path = args.write or args.check
    if path is None:
        print(generated)
        return 0
    with open(path) as f:
        text = f.read()
    new = replace_section(text, generated)
    if args.check:
        if new != text:
            print(f"{path}: the config reference differs from offload/plan/config.py; run `{REGENERATE}`",
                  file=sys.stderr)
            return 1
        return 0
    if new != text:
        with open(path + ".tmp", "w") as f:
            f.write(new)
        os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
