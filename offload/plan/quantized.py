"""Quantized frozen weights: a bitsandbytes layer's weight kept as it is stored, its packed bytes and its
quantization state in one byte record, which lives in a unit's flat buffer like any weight (docs/python.md
"Quantized models"). Supported: SUPPORTED below; any other quantized layer or tensor type is refused by name.

[Note: quantized weights as records]
A record is the tensors bitsandbytes reads in the layer's forward and backward, back to back, each 16-byte
aligned: Linear4bit (nf4, fp4): the packed weight, absmax, the quant map (code), and with double
quantization the offset, the nested absmax and the nested code; Linear8bitLt: the int8 weight and its row
scales (SCB). A fetch binds views of the unit's fetched bytes to those attributes (the parameter's data,
the QuantState's tensors, the layer's MatmulLtState), a release binds empty tensors; nothing is expanded,
copied or cast, so the layer dequantizes exactly what it would without offload, and the bytes moved are
the quantized bytes. bitsandbytes' own objects keep their identity (autograd's context holds them between
forward and backward). bitsandbytes' CPU repack for its AVX512-BF16 inference kernel: [Note: the CPU
inference repack].
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass

import torch
from torch import nn

# [Note: the CPU inference repack]
# On a CPU with AVX512-BF16, bitsandbytes' Linear4bit repacks its weight in place at the first eval-mode
# forward whose input needs no grad, for an inference kernel (bf16 absmax, another nibble order) whose
# numbers differ from the training kernel's; from then on every forward, train mode included, runs that
# kernel, which has no autograd formula: plain PyTorch training after an evaluation gets no gradient through
# those layers (torch warns "an autograd kernel was not registered"). The engine holds one record, in the
# training kernel's layout: a model repacked before offload.initialize is unpacked by bitsandbytes' own
# inverse (what its state_dict() saves: the absmax rounded to bf16 by the repack stays so), and an eval-mode
# forward that bitsandbytes would run on a repacked weight gets a repack of the bound record for that
# forward alone (InferenceKernel), so evaluation gives the plain model's eval-mode numbers and training the
# train-mode ones, in any order. Without AVX512-BF16, or on CUDA, nothing repacks and none of this runs.

SUPPORTED = ("bitsandbytes Linear4bit (nf4 or fp4, with or without double quantization) and Linear8bitLt "
             "(int8, frozen)")
ALIGN_BYTES = 16
# module classes of quantization libraries whose layers we do not move as records (yet): refused by name
FOREIGN = ("QuantLinear", "WQLinear", "MarlinQuantLinear", "HQQLinear", "QuantizedLinear", "FP8Linear",
           "Embedding4bit", "Embedding8bit", "EmbeddingNF4", "EmbeddingFP4", "StableEmbedding", "Linear8bitLtFp16")


@dataclass
class Piece:
    """One tensor of a record: `owner.attr` (the parameter's data when attr is "data"), at byte `at`."""

    owner: object
    attr: str
    dtype: torch.dtype
    shape: tuple
    at: int = 0

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


class Record:
    """A quantized weight's tensors in one byte record ([Note: quantized weights as records]). `kind`: nf4,
    fp4 or int8; `aliases`: (owner, attr, piece index) also bound to a piece (8-bit's state.CB)."""

    def __init__(self, kind: str, numel: int, pieces: list[Piece], aliases=(), dequantize=None, quantize=None):
        self.kind, self.numel, self.pieces = kind, numel, pieces  # numel: the parameters it stands for
        self.aliases, self._dequantize = list(aliases), dequantize
        self._quantize = quantize  # a weight still to quantize (built on the meta device): value -> its parameter
        at = 0
        for p in pieces:
            p.at = at
            at += -(-p.nbytes // ALIGN_BYTES) * ALIGN_BYTES
        self.nbytes = at

    @property
    def param(self) -> nn.Parameter:
        return self.pieces[0].owner

    @property
    def pending(self) -> bool:
        """A layer built on the meta device whose weight is quantized when its value comes (materialization)."""
        return self._quantize is not None

    def quantize(self, value: torch.Tensor) -> nn.Parameter:
        """A pending record: quantizes `value` (the full-precision weight) as bitsandbytes does when
        from_pretrained loads it, puts the quantized parameter into the layer and returns it."""
        param = self._quantize(value)
        self._quantize = None
        return param

    def views(self, region: torch.Tensor) -> list[torch.Tensor]:
        """Each piece's tensor as a view of `region` (this record's bytes, uint8, at least nbytes)."""
        return [region[p.at:p.at + p.nbytes].view(p.dtype).view(p.shape) for p in self.pieces]

    def bind(self, region: torch.Tensor) -> None:
        views = self.views(region)
        for p, v in zip(self.pieces, views):
            _set(p.owner, p.attr, v)
        for owner, attr, i in self.aliases:
            setattr(owner, attr, self.param.data if i == 0 else views[i])

    def unbind(self, device) -> None:
        for p in self.pieces:
            _set(p.owner, p.attr, torch.empty(0, dtype=p.dtype, device=device))
        for owner, attr, _ in self.aliases:
            setattr(owner, attr, None)

    def capture(self) -> torch.Tensor:
        """The current values of the pieces (as the layer holds them now), in a new byte record."""
        out = torch.zeros(self.nbytes, dtype=torch.uint8)
        for p, v in zip(self.pieces, self.views(out)):
            v.copy_(_get(p.owner, p.attr).reshape(v.shape))
        return out

    def dequantize(self, region: torch.Tensor) -> torch.Tensor:
        """The weight the record stands for, in full precision, from the record's bytes in `region`."""
        return self._dequantize(self.views(region))

    def spec(self) -> dict:
        """What dequantize_bytes() needs besides the bytes (a checkpoint keeps it beside them): the kind, the
        weight's shape and dtype, and for 4-bit the block sizes and whether the absmax is quantized again."""
        if self.kind == "int8":  # the int8 weight has the layer's shape (unbound, the parameter holds none)
            return {"kind": "int8", "shape": list(self.pieces[0].shape), "dtype": "float32"}
        qs = self.param.quant_state
        spec = {"kind": self.kind, "shape": list(qs.shape), "dtype": str(qs.dtype).removeprefix("torch."),
                "blocksize": qs.blocksize, "nested": bool(qs.nested)}
        if qs.nested:
            spec["nested_blocksize"] = qs.state2.blocksize
        return spec


def dequantize_bytes(spec: dict, region: torch.Tensor) -> torch.Tensor:
    """The weight a record's bytes (`region`, uint8) stand for, from its spec (Record.spec), dequantized by
    bitsandbytes in the weight's own dtype as the layer would: what `offload checkpoint export` writes."""
    bnb = bitsandbytes("exporting a quantized weight")
    kind, shape = spec["kind"], tuple(spec["shape"])
    nested = spec.get("nested", False)
    pieces = [Piece(None, a, d, sh) for a, d, sh in layout(kind, shape, spec.get("blocksize", 64), nested)]
    views = Record(kind, 0, pieces).views(region)
    if kind == "int8":
        return bnb.functional.int8_vectorwise_dequant(views[0], views[1]).view(shape)
    dtype = getattr(torch, spec["dtype"])
    state2 = (bnb.functional.QuantState(absmax=views[4], code=views[5], blocksize=spec["nested_blocksize"],
                                        dtype=torch.float32) if nested else None)
    state = bnb.functional.QuantState(absmax=views[1], shape=torch.Size(shape), code=views[2],
                                      blocksize=spec["blocksize"], quant_type=kind, dtype=dtype,
                                      offset=views[3] if nested else None, state2=state2)
    return bnb.functional.dequantize_4bit(views[0], state)


def layout(kind: str, shape, blocksize: int = 64, nested: bool = True) -> list[tuple[str, torch.dtype, tuple]]:
    """(attribute, dtype, shape) of each tensor bitsandbytes keeps for a weight of `shape` quantized as `kind`
    (nf4, fp4: quantize_4bit with uint8 storage; int8: int8_vectorwise_quant): the record's pieces, in order."""
    numel = 1
    for d in shape:
        numel *= d
    if kind == "int8":
        return [("data", torch.int8, tuple(shape)), ("SCB", torch.float32, (shape[0],))]
    blocks = -(-numel // blocksize)
    pieces = [("data", torch.uint8, ((numel + 1) // 2, 1)),
              ("absmax", torch.uint8 if nested else torch.float32, (blocks,)), ("code", torch.float32, (16,))]
    if nested:
        pieces += [("offset", torch.float32, ()), ("state2.absmax", torch.float32, (-(-blocks // 256),)),
                   ("state2.code", torch.float32, (256,))]
    return pieces


def record_bytes(kind: str, shape, blocksize: int = 64, nested: bool = True) -> int:
    """The bytes of a record for a weight of `shape` quantized as `kind` (what every tier holds for it)."""
    return Record(kind, 0, [Piece(None, a, d, sh) for a, d, sh in layout(kind, shape, blocksize, nested)]).nbytes


def _set(owner, attr: str, t: torch.Tensor) -> None:
    if attr == "data":
        owner.data = t
    else:
        setattr(owner, attr, t)


def _get(owner, attr: str) -> torch.Tensor:
    return (owner.data if attr == "data" else getattr(owner, attr)).detach().cpu()


def _bnb():
    """bitsandbytes, if the model could hold its layers (it is imported); None otherwise."""
    return sys.modules.get("bitsandbytes")


def records(model: nn.Module) -> dict:
    """{parameter: Record} for every quantized weight of `model`; refuses what cannot move as a record."""
    bnb = _bnb()
    out = {}
    for path, module in model.named_modules():
        name = type(module).__name__
        if name in FOREIGN or _is_foreign(module):
            raise ValueError(f"{path or '<root>'}: {type(module).__module__}.{name} is a quantized layer offload "
                             f"does not move yet; supported: {SUPPORTED} (docs/python.md)")
        for pname, p in module._parameters.items():
            if p is None:
                continue
            where = f"{path}.{pname}" if path else pname
            rec = _record(bnb, module, p, where)
            if rec is not None:
                out[p] = rec
            elif type(p.data) is not torch.Tensor and not p.is_meta:
                raise ValueError(f"{where}: a {type(p.data).__module__}.{type(p.data).__name__} tensor; offload moves "
                                 f"plain tensors and {SUPPORTED} (docs/python.md)")
            elif not (p.is_floating_point() or p.is_complex()):
                raise ValueError(f"{where}: a {p.dtype} parameter of {name} that is not a quantization offload knows; "
                                 f"supported: {SUPPORTED} (docs/python.md)")
    return out


def _is_foreign(module: nn.Module) -> bool:
    """GPTQ / AWQ / torchao layers keep their packed weights in buffers or tensor subclasses."""
    return any(n in module._buffers for n in ("qweight", "qzeros")) and module._parameters.get("weight") is None


def _record(bnb, module: nn.Module, p: nn.Parameter, where: str) -> Record | None:
    if bnb is None:
        return None
    if isinstance(p, bnb.nn.Params4bit):
        return _record_4bit(bnb, module, p, where)
    if isinstance(p, bnb.nn.Int8Params):
        return _record_8bit(bnb, module, p, where)
    return None


def _frozen(p: nn.Parameter, where: str) -> None:
    if p.requires_grad:
        raise ValueError(f"{where}: a quantized weight that requires grad; a quantized base is frozen and trained "
                         "through adapters: freeze it (peft's get_peft_model does), or train a full-precision model")


def _record_4bit(bnb, module: nn.Module, p, where: str) -> Record:
    _frozen(p, where)
    if not isinstance(module, bnb.nn.Linear4bit):
        raise ValueError(f"{where}: a 4-bit weight of {type(module).__name__}; offload moves 4-bit weights of "
                         f"Linear4bit layers only (supported: {SUPPORTED})")
    if p.is_meta:
        return _pending(bnb, module, p, where, p.quant_type, p.blocksize, p.compress_statistics)
    qs = p.quant_state
    if qs is None or p.dtype != torch.uint8:
        raise ValueError(f"{where}: a Linear4bit weight that is not quantized yet (bitsandbytes quantizes it when the "
                         "layer moves to a device); load with from_pretrained(..., quantization_config=...) or call "
                         "model.to(device) first")
    if getattr(qs, "packing_format_for_cpu", False):  # evaluated before: [Note: the CPU inference repack]
        qs = _unpack(bnb, module, p, where)
    pieces = [Piece(p, "data", p.dtype, tuple(p.shape)), Piece(qs, "absmax", qs.absmax.dtype, tuple(qs.absmax.shape)),
              Piece(qs, "code", qs.code.dtype, tuple(qs.code.shape))]
    if qs.nested:
        s2 = qs.state2
        pieces += [Piece(qs, "offset", qs.offset.dtype, tuple(qs.offset.shape)),
                   Piece(s2, "absmax", s2.absmax.dtype, tuple(s2.absmax.shape)),
                   Piece(s2, "code", s2.code.dtype, tuple(s2.code.shape))]

    def dequantize(views):
        state = copy.copy(qs)
        state.absmax, state.code = views[1], views[2]
        if qs.nested:
            state.offset = views[3]
            state.state2 = copy.copy(qs.state2)
            state.state2.absmax, state.state2.code = views[4], views[5]
        return bnb.functional.dequantize_4bit(views[0], state)

    return Record(qs.quant_type, qs.shape.numel(), pieces, dequantize=dequantize)


def _unpack(bnb, module: nn.Module, p, where: str):
    """A weight repacked for the CPU inference kernel, back in the layout the training kernel reads, in place,
    by bitsandbytes' own inverse (what its state_dict() and .cuda() run); returns the new quantization state."""
    inverse = getattr(bnb.functional, "_convert_weight_packed_for_cpu_inverse", None)
    if inverse is None:
        raise ValueError(f"{where}: a Linear4bit weight repacked for CPU inference (AVX512-BF16), and this "
                         f"bitsandbytes ({bnb.__version__}) has no inverse of the repack; reload the model, or "
                         "upgrade bitsandbytes")
    p.data, p.quant_state = inverse(p.data, p.quant_state)
    if getattr(module, "quant_state", None) is not None:
        module.quant_state = p.quant_state
    return p.quant_state


class InferenceKernel:
    """[Note: the CPU inference repack] The engine's side of it: the Linear4bit layers of `model` whose forward
    would repack their weight in place (support_avx512bf16_for_cpu) no longer do; for an eval-mode forward
    that bitsandbytes would run on the repacked weight, a repack made from the bound record for that forward
    alone. close(restore=True) gives the layers their own repack back (the model leaves the engine)."""

    def __init__(self, model: nn.Module):
        bnb = _bnb()
        self.layers = {m: m.support_avx512bf16_for_cpu for m in model.modules()
                       if bnb is not None and isinstance(m, bnb.nn.Linear4bit)
                       and getattr(m, "support_avx512bf16_for_cpu", False)}
        self.saved: dict = {}
        self.handles = []
        for m in self.layers:
            m.support_avx512bf16_for_cpu = False
            self.handles += [m.register_forward_pre_hook(self._repack),
                             m.register_forward_hook(self._restore, always_call=True)]

    def _repack(self, module: nn.Module, args) -> None:
        x = args[0] if args else None  # bitsandbytes' own test, Linear4bit.forward
        if x is None or x.device.type != "cpu" or module.training or x.requires_grad:
            return
        p = module.weight
        self.saved[module] = (p.data, p.quant_state)
        p.data, p.quant_state = _bnb().functional._convert_weight_packed_for_cpu(p.data, copy.copy(p.quant_state))

    def _restore(self, module: nn.Module, args, out) -> None:
        saved = self.saved.pop(module, None)
        if saved is not None:
            module.weight.data, module.weight.quant_state = saved

    def close(self, restore: bool) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        if restore:
            for m, on in self.layers.items():
                m.support_avx512bf16_for_cpu = on


def _record_8bit(bnb, module: nn.Module, p, where: str) -> Record:
    _frozen(p, where)
    if not isinstance(module, bnb.nn.Linear8bitLt) or module.state.has_fp16_weights:
        raise ValueError(f"{where}: an 8-bit weight of {type(module).__name__} (has_fp16_weights="
                         f"{getattr(getattr(module, 'state', None), 'has_fp16_weights', None)}); offload moves the int8 "
                         f"weights of Linear8bitLt layers with has_fp16_weights=False (supported: {SUPPORTED})")
    if p.is_meta:
        return _pending(bnb, module, p, where, "int8")
    if p.CB is not None:  # what the layer's first forward does: the state holds CB and SCB from here on
        module.init_8bit_state()
    state = module.state
    if p.dtype != torch.int8 or state.SCB is None:
        raise ValueError(f"{where}: a Linear8bitLt weight that is not quantized yet (bitsandbytes quantizes it when "
                         "the layer moves to a device); load with from_pretrained(..., quantization_config=...) or "
                         "call model.to(device) first")
    pieces = [Piece(p, "data", torch.int8, tuple(p.shape)), Piece(state, "SCB", state.SCB.dtype, tuple(state.SCB.shape))]

    def dequantize(views):
        return bnb.functional.int8_vectorwise_dequant(views[0], views[1])

    return Record("int8", p.numel(), pieces, aliases=[(state, "CB", 0)], dequantize=dequantize)


def _pending(bnb, module: nn.Module, p, where: str, kind: str, blocksize: int = 64, nested: bool = False) -> Record:
    """The record of a layer built on the meta device: its layout from the weight's shape (layout()); its
    pieces take their owners when quantize() makes the parameter, as transformers' bitsandbytes loading does
    (Params4bit / Int8Params of the value with the meta parameter's settings, moved to the CPU)."""
    if kind != "int8" and getattr(p, "quant_storage", torch.uint8) != torch.uint8:
        raise ValueError(f"{where}: bnb_4bit_quant_storage={p.quant_storage}; offload quantizes with uint8 storage")
    shape = tuple(p.shape)
    pieces = [Piece(None, attr, dtype, sh) for attr, dtype, sh in layout(kind, shape, blocksize, nested)]
    settings = {k: v for k, v in p.__dict__.items() if k not in ("SCB", "CB")}

    def quantize(value: torch.Tensor) -> nn.Parameter:
        if tuple(value.shape) != shape:
            raise ValueError(f"{where}: a value of shape {tuple(value.shape)} for a weight of shape {shape}")
        if kind == "int8":
            new = bnb.nn.Int8Params(value.to("cpu"), requires_grad=False, **settings).to("cpu")
            module._parameters["weight"] = new
            made = _record_8bit(bnb, module, new, where)
        else:
            new = bnb.nn.Params4bit(value, requires_grad=False, **settings).to("cpu")
            module._parameters["weight"] = new
            made = _record_4bit(bnb, module, new, where)
        if [(p.dtype, p.shape) for p in made.pieces] != [(p.dtype, p.shape) for p in pieces]:
            raise RuntimeError(f"{where}: bitsandbytes made {[(p.dtype, p.shape) for p in made.pieces]}, offload "
                               f"planned {[(p.dtype, p.shape) for p in pieces]} (offload.plan.quantized.layout); a "
                               "bitsandbytes version offload does not know: report it with `offload doctor`'s output")
        record.pieces, record.aliases, record._dequantize = made.pieces, made.aliases, made._dequantize
        return new

    numel = 1
    for d in shape:
        numel *= d
    record = Record(kind, numel, pieces, quantize=quantize)
    return record


def replace_linears(model: nn.Module, kind: str, compute_dtype: torch.dtype) -> list[str]:
    """Turns the model's nn.Linear layers (on the meta device) into bitsandbytes layers that quantize their
    weight when it is materialized, as from_pretrained(..., quantization_config=BitsAndBytesConfig(...))
    builds them: nf4 is QLoRA's (nf4, double quantization, blocksize 64, uint8 storage), int8 LLM.int8()'s
    (threshold 6.0, no fp16 weights). The output head (and what transformers leaves out: tied weights, the
    last module) stays in full precision. Returns the paths of the layers replaced."""
    bnb = bitsandbytes()
    done = []
    for path, module in quantizable_linears(model, f"quantize_base={kind!r}"):
        if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            continue
        with torch.device("meta"):
            if kind == "int8":
                new = bnb.nn.Linear8bitLt(module.in_features, module.out_features, module.bias is not None,
                                          has_fp16_weights=False, threshold=6.0)
            else:
                new = bnb.nn.Linear4bit(module.in_features, module.out_features, module.bias is not None,
                                        compute_dtype, compress_statistics=True, quant_type=kind,
                                        quant_storage=torch.uint8)
        new.requires_grad_(False)
        model.set_submodule(path, new)
        done.append(path)
    return done


def quantizable_linears(model: nn.Module, what: str) -> list[tuple[str, nn.Linear]]:
    """(path, module) of the linears replace_linears quantizes: every nn.Linear but the output head, what
    transformers leaves out and peft's adapters. Transformers' Conv1D layers (GPT-2's, the weight stored
    [in, out]) are refused, for `what`: offload does not quantize them yet, and a base left half in full
    precision is not what was asked for."""
    skip = _not_converted(model)
    conv1d = [path for path, m in model.named_modules() if type(m).__name__ == "Conv1D"
              and not any(path == k or path.endswith("." + k) for k in skip)]
    if conv1d:
        raise ValueError(f"{what}: {len(conv1d)} of the model's layers are transformers' Conv1D (GPT-2's; "
                         f"{conv1d[0]}, ...), which offload does not quantize yet; load the model with "
                         "from_pretrained(..., quantization_config=BitsAndBytesConfig(...)) and pass it to "
                         "offload.initialize, or train without quantizing the base")
    return [(path, m) for path, m in model.named_modules()
            if isinstance(m, nn.Linear) and ".lora_" not in f".{path}"
            and not any(path == k or path.endswith("." + k) or path.startswith(k + ".") for k in skip)]


def quantize_base(model: nn.Module, kind: str, compute_dtype: torch.dtype) -> None:
    """Config quantize_base: a model built on the meta device gets its linears replaced (replace_linears; peft's
    adapters left as they are) unless it holds bitsandbytes layers already; a model in memory is refused."""
    bnb = bitsandbytes()
    if any(isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) for m in model.modules()):
        return
    if not any(p.is_meta for p in model.parameters()):
        raise ValueError(f"quantize_base={kind!r}: quantizes a model built on the meta device as the engine "
                         "materializes it, and this one is in memory; load it quantized with from_pretrained(..., "
                         "quantization_config=BitsAndBytesConfig(...)), or build it under torch.device('meta')")
    replace_linears(model, kind, compute_dtype)


@torch.no_grad()
def quantize_linears(model: nn.Module, kind: str, compute_dtype: torch.dtype) -> list[str]:
    """replace_linears on a model in memory: each linear's weight (and bias) quantized into its bitsandbytes
    layer now, as from_pretrained would load it (a plain in-memory model to compare the engine with)."""
    old = {path: m for path, m in model.named_modules() if isinstance(m, nn.Linear)}
    done = replace_linears(model, kind, compute_dtype)
    pending = records(model)
    for path in done:
        new, linear = model.get_submodule(path), old[path]
        pending[new.weight].quantize(linear.weight.detach())
        if linear.bias is not None:
            new.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return done


def _not_converted(model: nn.Module) -> set[str]:
    """What transformers' bitsandbytes loading leaves unquantized (its get_keys_to_not_convert) for its
    models; the output head, lm_head, for ours."""
    skip = {"lm_head"}
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if pretrained is not None and isinstance(model, pretrained):
        try:
            from transformers.quantizers.base import get_keys_to_not_convert
            skip |= set(get_keys_to_not_convert(model))
        except (ImportError, AttributeError):
            pass
    return skip


def bitsandbytes(what: str = "quantize_base"):
    """bitsandbytes, or one line naming the extra that brings it (`what` needs it)."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ValueError(f"{what}: needs the bitsandbytes package, which is not installed; "
                         "pip install 'offload[qlora]' (in a source checkout: pip install -e '.[qlora]')") from e
    return bnb
