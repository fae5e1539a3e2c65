"""Local Hugging Face directories, tensor by tensor: read safetensors shards as a stream (iter_safetensors,
or SafetensorsWeights, a weights source for offload.initialize), write them back (save_hf_directory).

Reading never holds more than one tensor of one open shard (safetensors.safe_open maps the file and
copies out only the tensor asked for; a converted parameter, the few it is made of), so a model larger than
RAM can stream into its tiers. Writing holds at most one shard (max_shard_bytes) in memory. Needs the
`safetensors` package (the `hf` extra); no network, ever.
"""

from __future__ import annotations

import copy
import errno
import functools
import json
import os
import re
from typing import Iterable, Iterator

import torch

# [Note: checkpoint names]
# A Hugging Face directory's safetensors keys are not always its model's parameter names: transformers 5 renames
# some when loading (GPT-NeoX's embed_out is lm_head) and converts others (an MoE layer's experts, stored one
# tensor per expert, are stacked into one 3-D parameter: Mixtral, Qwen2-MoE), by a conversion mapping per
# model type; save_pretrained applies its reverse. We use that mapping, the same for every architecture:
# reading, each model name is made of the checkpoint keys from_pretrained would make it of (load_conversions);
# writing, each tensor goes out under the keys save_pretrained would write (checkpoint_items). Before
# transformers 5 there is no mapping and names are taken as they are.

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def _safetensors():
    try:
        import safetensors.torch
        return safetensors
    except ImportError as e:
        raise ValueError("safetensors is not installed; pip install 'offload[hf]'") from e


def read_config(directory: str) -> dict:
    """config.json of a HF model directory as a dict."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from e


def shard_files(directory: str) -> list[str]:
    """Paths of the safetensors files of a HF directory, in shard order."""
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index_path}: not a safetensors index with a weight_map ({e})") from e
        paths = [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
        for path in paths:
            if not os.path.isfile(path):
                raise FileNotFoundError(errno.ENOENT, f"shard named in {INDEX_FILE} is missing", path)
        return paths
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(errno.ENOENT, f"no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights are "
                            f"read; convert .bin checkpoints with save_pretrained(safe_serialization=True))",
                            directory)


def iter_safetensors(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the directory, one shard open at a time, one tensor at a time."""
    st = _safetensors()
    for path in shard_files(directory):
        with st.safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class SafetensorsWeights:
    """`name -> tensor` read lazily from a HF directory's safetensors shards: one open handle per shard,
    kept until close(); each call copies out one tensor (safe_open maps the file), or the few a converted
    name is made of. With `model` (the transformers model the directory is loaded into, on the meta device),
    names are the model's: a checkpoint key that from_pretrained renames or converts ([Note: checkpoint
    names] below) is found under the model's name, and tied weights under any of their names."""

    def __init__(self, directory: str, aliases: dict[str, list[str]] | None = None, model=None):
        self.directory = directory
        self.aliases = aliases if aliases is not None else tied_aliases(model) if model is not None else {}
        self._st = _safetensors()
        self._where: dict[str, str] = {}
        for path in shard_files(directory):
            with self._st.safe_open(path, framework="pt", device="cpu") as f:
                self._where.update((name, path) for name in f.keys())
        self._open: dict[str, object] = {}
        self._converted = load_conversions(model, list(self._where)) if model is not None else {}
        self._config = getattr(model, "config", None)

    def __call__(self, name: str) -> torch.Tensor:
        for candidate in [name, *self.aliases.get(name, [])]:  # a tied weight may be stored under another name
            if candidate in self._converted:
                return self._convert(candidate, *self._converted[candidate])
            if candidate in self._where:
                return self._read(candidate)
        if ".lora_" in name or ".base_layer." in name:  # a peft model's name
            raise ValueError(f"weights[{name!r}]: a peft LoRA model's name, not in the safetensors of "
                             f"{self.directory}; pass weights=offload.lora.LoraWeights(this source, model, seed), "
                             "which maps the base's names and gives the adapters peft's init")
        raise ValueError(f"weights[{name!r}]: not in the safetensors of {self.directory}; "
                         f"the checkpoint does not match its config.json")

    def _read(self, key: str) -> torch.Tensor:
        path = self._where[key]
        if path not in self._open:
            self._open[path] = self._st.safe_open(path, framework="pt", device="cpu")
        return self._open[path].get_tensor(key)

    def _convert(self, name: str, converter, sources: list[tuple[str, str]]) -> torch.Tensor:
        if converter is None:  # renamed only
            return self._read(sources[0][1])
        converter = copy.deepcopy(converter)  # one per model name, as from_pretrained makes them
        for pattern, key in sources:
            converter.add_tensor(name, key, pattern, functools.partial(self._read, key))  # read when converting
        value = converter.convert(name, config=self._config)[name]
        return value[0] if isinstance(value, list) else value

    def close(self) -> None:
        self._open.clear()  # safe_open handles unmap when dropped


# What a saved directory's floating tensors may be: the names `--save-dtype` and config.json's dtype use.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# safetensors' header names of the floating dtypes
_HEADER_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def with_dtype(config: dict, dtype: torch.dtype) -> dict:
    """config.json's dict saying its tensors are `dtype`: transformers 5's key `dtype`, or `torch_dtype` where
    the config has that one alone (transformers 4 writes it; 5 reads both)."""
    key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
    return {**config, key: str(dtype).removeprefix("torch.")}


def source_dtype(config: dict, directory: str | None = None) -> torch.dtype:
    """The dtype of a HF model's weights as from_pretrained(dtype="auto") takes it: config.json's `dtype` (or
    `torch_dtype`), else that of the directory's first floating tensor, else fp32."""
    for key in ("dtype", "torch_dtype"):
        dtype = getattr(torch, str(config.get(key)), None)
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            return dtype
    if directory is not None:
        st = _safetensors()
        for path in shard_files(directory):
            with st.safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    found = _HEADER_DTYPES.get(f.get_slice(name).get_dtype())  # read from the header alone
                    if found is not None:
                        return found
    return torch.float32


def tied_aliases(model) -> dict[str, list[str]]:
    """{the first name of a parameter shared by several modules: its other names} (tied embeddings)."""
    names: dict = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(n)
    return {ns[0]: ns[1:] for ns in names.values() if len(ns) > 1}


def _transforms():
    """transformers' conversion machinery, or None before transformers 5."""
    try:
        from transformers import conversion_mapping, core_model_loading
    except ImportError:
        return None
    return conversion_mapping, core_model_loading


def load_conversions(model, keys: list[str]) -> dict[str, tuple[object, list[tuple[str, str]]]]:
    """{model name: (transformers' WeightConverter, or None for a renaming; [(source pattern, checkpoint key)])}
    for every checkpoint key from_pretrained renames or converts for `model`; keys it takes as they are are
    not in it ([Note: checkpoint names])."""
    tf = _transforms()
    if tf is None:
        return {}
    mapping, core = tf
    transforms = mapping.get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, core.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, core.WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    names = model.state_dict()  # meta tensors: names only
    plan: dict = {}
    for key in sorted(keys, key=core.dot_natural_key):  # experts in their order, as from_pretrained stacks them
        name, pattern = core.rename_source_key(key, renamings, converters, model.base_model_prefix, names)
        if name not in names and key in names:
            name, pattern = key, None
        if name != key or pattern is not None:
            plan.setdefault(name, (by_pattern.get(pattern), []))[1].append((pattern or key, key))
    return plan


def checkpoint_items(model, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(model name, tensor) pairs -> (checkpoint key, tensor) pairs as save_pretrained writes `model` (a
    transformers model, on any device): a tied weight once, under its first name; transformers'
    revert_weight_conversion, streamed ([Note: checkpoint names]). A converted tensor goes out when all the
    model tensors it is made of have come (one, for the stacked experts of an MoE layer)."""
    tied = {alias for aliases in tied_aliases(model).values() for alias in aliases}
    items = ((n, t) for n, t in items if n not in tied)
    tf = _transforms()
    if tf is None:
        yield from items
        return
    mapping, core = tf
    transforms = [t for t in mapping.get_model_conversion_mapping(model, add_legacy=False)
                  if not isinstance(t, core.PrefixChange)][::-1]  # as revert_weight_conversion, for a built model
    reverse = [t.reverse_transform() for t in transforms]
    renamings = [t for t in reverse if isinstance(t, core.WeightRenaming)]
    converters = [t for t in reverse if isinstance(t, core.WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    pending: dict = {}
    for name, tensor in items:
        target, pattern = core.apply_converters(name, converters)
        if pattern is None:
            yield core.apply_renamings(name, renamings), tensor
            continue
        converter = pending.setdefault(target, copy.deepcopy(by_pattern[pattern]))
        converter.add_tensor(target, name, pattern, tensor)
        if set(converter.collected_tensors) == set(converter.source_patterns):
            del pending[target]
            for key, value in converter.convert(target, model=model, config=model.config).items():
                yield core.apply_renamings(key, renamings), value[0] if isinstance(value, list) else value
    if pending:
        raise ValueError(f"saving {next(iter(pending))}: transformers converts it from several tensors and not all "
                         "of them were given")


def _atomic_json(obj: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _own_storage(t: torch.Tensor, pending: dict[str, torch.Tensor]) -> torch.Tensor:
    # safetensors refuses tensors of one file that share storage (tied weights, views): give each its own.
    t = t.detach().to("cpu").contiguous()
    whole = t.untyped_storage().nbytes() == t.nbytes and t.storage_offset() == 0
    shared = any(p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for p in pending.values())
    return t if whole and not shared else t.clone()


# What from_pretrained, AutoTokenizer and generate() read beside the weights and config.json: copied as they
# were from the directory a run started from.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def copy_companions(source: str | None, directory: str, config=None) -> list[str]:
    """Copies the tokenizer files and generation_config.json of `source` (a local HF directory) into
    `directory`; where `source` has no generation_config.json (or is None), writes the one transformers
    derives from `config` (a dict or PretrainedConfig), as save_pretrained does. Returns the names written."""
    import shutil

    written = []
    for name in COMPANION_FILES:
        path = os.path.join(source, name) if source else None
        if path and os.path.isfile(path):
            shutil.copyfile(path, os.path.join(directory, name))
            written.append(name)
    if "generation_config.json" not in written and config is not None:
        try:
            from transformers import GenerationConfig, PretrainedConfig
        except ImportError:
            return written
        if isinstance(config, dict):
            config = PretrainedConfig.from_dict(config)
        GenerationConfig.from_model_config(config).save_pretrained(directory)
        written.append("generation_config.json")
    return written


def save_hf_directory(state_dict_iter: Iterable[tuple[str, torch.Tensor]], config, directory: str,
                      max_shard_bytes: int = 2 << 30) -> list[str]:
    """Write (name, tensor) pairs as safetensors shards + index + config.json that from_pretrained loads.

    config: a dict or a transformers PretrainedConfig (None: no config.json). One shard -> model.safetensors; several ->
    model-0000i-of-0000n.safetensors and model.safetensors.index.json. Shards are written under
    temporary names and renamed when all are complete; weight files of an earlier save that the new one
    does not use are removed last. Returns the paths of the weight files.
    """
    st = _safetensors()
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: must be positive")
    os.makedirs(directory, exist_ok=True)
    shards: list[tuple[str, list[str], int]] = []     # (temporary path, names, bytes)
    pending: dict[str, torch.Tensor] = {}
    seen: set[str] = set()

    def flush():
        tmp = os.path.join(directory, f".tmp-shard-{len(shards):05d}.safetensors")
        st.torch.save_file(pending, tmp, metadata={"format": "pt"})
        shards.append((tmp, list(pending), sum(t.nbytes for t in pending.values())))
        pending.clear()

    for name, tensor in state_dict_iter:
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice; each name must be written once")
        seen.add(name)
        tensor = _own_storage(tensor, pending)
        if pending and sum(t.nbytes for t in pending.values()) + tensor.nbytes > max_shard_bytes:
            flush()
        pending[name] = tensor
    if pending or not shards:
        flush()
    return _finish(shards, config, directory)


def _finish(shards: list[tuple[str, list[str], int]], config, directory: str) -> list[str]:
    n = len(shards)
    final = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for (tmp, _, _), name in zip(shards, final):
        os.replace(tmp, os.path.join(directory, name))
    index_path = os.path.join(directory, INDEX_FILE)
    if n > 1:
        weight_map = {key: name for (_, keys, _), name in zip(shards, final) for key in keys}
        _atomic_json({"metadata": {"total_size": sum(b for _, _, b in shards)}, "weight_map": weight_map},
                     index_path)
    if config is not None:  # None: weights only
        config_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        _atomic_json(config_dict, os.path.join(directory, "config.json"))
    stale = [f for f in os.listdir(directory) if (f == SINGLE_FILE or _SHARD_RE.match(f)) and f not in final]
    if n == 1 and os.path.exists(index_path):
        stale.append(INDEX_FILE)
    for f in stale:
        os.remove(os.path.join(directory, f))
    return [os.path.join(directory, name) for name in final]
