"""GGUF files as transformers reads them: a header check that says what is wrong with a file in milliseconds,
before the slow load (check_gguf), and the conversion of a GGUF model into a plain Hugging Face directory
(convert_gguf: model.safetensors, config.json, generation_config.json, the tokenizer and its chat template).

transformers' own loader (`from_pretrained(folder, gguf_file=...)`) dequantizes the weights (the `gguf`
package's numpy code) and builds the tokenizer from the file's metadata; its model is marked as quantized and
save_pretrained refuses it, so the weights go into a model built from the same config without
`quantization_config`, which saves as any other ([Note: the dtype of a converted GGUF]). Needs transformers,
safetensors and the `gguf` package (the `pretrained` extra); never the network.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct

from offload.integrations.hf_io import with_dtype

MAGIC = b"GGUF"
VERSIONS = (2, 3)            # GGUF v1 had 32-bit counts; transformers and llama.cpp write v3
DEFAULT_ALIGNMENT = 32       # of the tensor data, unless general.alignment says otherwise
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# [Note: the dtype of a converted GGUF]
# A Q4_1 weight is 4-bit codes with an fp16 scale and minimum per block of 32; transformers dequantizes it to
# fp32 (scale * code + minimum), and those fp32 values are what its model, and its greedy answers, are made of.
# They are saved as they are, in fp32: bf16 would halve the directory (269 MB instead of 538 MB) but round
# most of them again, so the saved model would no longer be the one transformers loads from the GGUF. Runs
# at bf16 cast them as they load (`--precision`), as they do any fp32 checkpoint.


class GGUFError(ValueError):
    """A file that is not a complete GGUF model of the expected kind; the message names the path."""


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    version: int
    architecture: str | None      # general.architecture: "llama", ...
    name: str | None              # general.name
    tensors: int
    data_end_bytes: int           # where the last tensor's bytes end: the file's size at least
    file_bytes: int


class _Short(Exception):
    """The header ran past the end of the file (at .pos)."""

    def __init__(self, pos: int):
        self.pos = pos


class _Reader:
    """Little-endian values from a buffer, with a position; _Short past its end."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise _Short(self.pos)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise _Short(self.pos)
        self.pos += n

    def string(self, keep: bool = True) -> str | None:
        n = self.unpack("<Q")
        start = self.pos
        self.skip(n)
        return bytes(self.buf[start:self.pos]).decode("utf-8", "replace") if keep else None

    def value(self, kind: int, keep: bool):
        """One metadata value of GGUF type `kind`; arrays (of token strings: 49152 of them) are skipped."""
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string(keep)
        if kind != _ARRAY:
            raise ValueError(f"a metadata value of unknown type {kind} at byte {self.pos}")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item in _SCALARS:
            self.skip(count * struct.calcsize(_SCALARS[item]))
        else:
            for _ in range(count):
                self.value(item, keep=False)
        return None


def _tensor_bytes(kind: int, dims: list[int]) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise ValueError(f"a tensor of ggml type {kind}, which the installed gguf package does not know; upgrade "
                         "it: pip install --no-deps -U gguf") from None
    return math.prod(dims) // block * type_bytes


REMEDY = "install or copy it again"


def read_header(path: str, remedy: str = REMEDY) -> GGUFHeader:
    """The GGUF's header walked (metadata skipped but for general.architecture, general.name and
    general.alignment; every tensor's extent), the data never read. GGUFError naming the path and `remedy`:
    not a GGUF, a version this reader does not know, or a file that ends before its header or its tensors."""
    _gguf_package()
    with open(path, "rb") as f:  # FileNotFoundError names the path
        size = os.fstat(f.fileno()).st_size
        if f.read(4) != MAGIC:
            f.seek(0)
            raise GGUFError(f"{path}: not a GGUF file (it starts with {f.read(8)!r}, not {MAGIC!r}); {remedy}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _walk(path, buf, size, remedy)


def _walk(path: str, buf, size: int, remedy: str) -> GGUFHeader:
    r = _Reader(buf)
    r.skip(4)
    try:
        version = r.unpack("<I")
        if version not in VERSIONS:
            raise GGUFError(f"{path}: GGUF version {version}, not one this reader knows {VERSIONS}; {remedy}")
        n_tensors, n_values = r.unpack("<Q"), r.unpack("<Q")
        meta = {}
        for _ in range(n_values):
            key = r.string()
            kind = r.unpack("<I")
            meta[key] = r.value(kind, keep=key.startswith("general."))
        end = 0
        for _ in range(n_tensors):
            r.string(keep=False)
            dims = [r.unpack("<Q") for _ in range(r.unpack("<I"))]
            kind, offset = r.unpack("<I"), r.unpack("<Q")
            end = max(end, offset + _tensor_bytes(kind, dims))
    except _Short as e:
        raise GGUFError(f"{path}: truncated: the file ({size:,} bytes) ends inside its header (at byte {e.pos:,}): an "
                        f"interrupted download or copy; {remedy}") from None
    except ValueError as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{path}: not a GGUF this reader understands ({e}); {remedy}") from None
    alignment = meta.get("general.alignment") or DEFAULT_ALIGNMENT
    data_end = -(-r.pos // alignment) * alignment + end
    if size < data_end:
        raise GGUFError(f"{path}: truncated: the file is {size:,} bytes, its {n_tensors} tensors end at byte "
                        f"{data_end:,}: an interrupted download or copy; {remedy}")
    return GGUFHeader(version, meta.get("general.architecture"), meta.get("general.name"), n_tensors, data_end,
                      size)


def check_gguf(path: str, architecture: str | None = None, remedy: str = REMEDY) -> GGUFHeader:
    """read_header, and GGUFError when the file's general.architecture is not `architecture` (when given)."""
    header = read_header(path, remedy)
    if architecture is not None and header.architecture != architecture:
        raise GGUFError(f"{path}: a GGUF of architecture {header.architecture!r} ({header.name or 'unnamed'}), not "
                        f"the {architecture!r} model expected here; {remedy}")
    return header


def _gguf_package():
    try:
        import gguf
    except ImportError as e:
        raise ValueError("reading a GGUF file needs the gguf package; pip install --no-deps gguf (its "
                         "dependencies numpy, pyyaml and tqdm come with offload)") from e
    return gguf


def convert_gguf(path: str, directory: str) -> None:
    """The GGUF model at `path` written into `directory` (which exists) as transformers' from_pretrained and
    AutoTokenizer load it: fp32 weights as transformers dequantizes them ([Note: the dtype of a converted
    GGUF]), config.json without quantization_config, generation_config.json, the tokenizer with its chat
    template. Check the file first (check_gguf): transformers' own errors on a damaged one say little."""
    _gguf_package()
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ValueError("converting a GGUF model needs transformers; pip install 'offload[pretrained]'") from e
    folder, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError, TypeError, NotImplementedError) as e:
        raise GGUFError(f"{path}: transformers {transformers.__version__} cannot load this GGUF ({e}); upgrade "
                        f"transformers, or use a GGUF of an architecture it converts") from e
    config = with_dtype(loaded.config.to_dict(), torch.float32)
    config.pop("quantization_config", None)
    config = type(loaded.config).from_dict(config)
    with torch.device("meta"):  # no init: every weight comes from the loaded model
        plain = transformers.AutoModelForCausalLM.from_config(config)
    plain.load_state_dict({k: v.float() for k, v in loaded.state_dict().items()}, strict=True, assign=True)
    plain.tie_weights()  # assign=True gave the tied names separate Parameters
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
