"""Meta-device initialization equals the CPU build with the same seed: standard torch modules
(nn.MultiheadAttention, nn.TransformerEncoderLayer), a Hugging Face Llama; clear errors otherwise."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload.state import materialize
from tests.engine_util import LlamaLoss, llama_batches

SEED = 3


def cfg(tmp_path, place="cpu"):
    return {"precision": "fp32", "offload_param": {"device": place}, "offload_optimizer": {"device": place},
            "nvme_path": str(tmp_path / "swap"), "units": {"min_numel": 512}, "seed": SEED}


class TorchTransformer(nn.Module):
    """embedding -> MultiheadAttention -> two TransformerEncoderLayers -> head; forward gives the loss.
    `tied`: the head, built second, shares the embedding's weight (its own bias is not shared), so the
    modules after it equal the CPU build only if its init draws from the RNG as there."""

    def __init__(self, vocab: int = 128, d: int = 32, heads: int = 4, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        if tied:
            self.head = nn.Linear(d, vocab)
            self.head.weight = self.embed.weight
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, heads, dim_feedforward=64, dropout=0.0,
                                                               batch_first=True) for _ in range(2))
        if not tied:
            self.head = nn.Linear(d, vocab)

    def forward(self, ids, labels):
        h = self.embed(ids)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class Scale(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.gain


def hf_llama(device: str, tied: bool):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tied)
    torch.manual_seed(SEED)
    with torch.device(device):
        return LlamaLoss(transformers.LlamaForCausalLM(config))


def assert_meta_build_equals_cpu_build(tmp_path, build, place):
    cpu = build("cpu")
    meta = build("meta")
    assert all(p.is_meta for p in meta.parameters())
    ids, labels = llama_batches(1)[0]
    with offload.initialize(meta, cfg(tmp_path, place)) as eng:
        state = eng.full_state_dict()
        cpu_params = dict(cpu.named_parameters(remove_duplicate=False))
        assert state.keys() == cpu_params.keys()
        for name, p in cpu_params.items():
            assert torch.equal(state[name], p.detach()), name
        assert eng(ids, labels).item() == cpu(ids, labels).item()


@pytest.mark.parametrize("place,tied", [("cpu", False), ("cpu", True), ("nvme", True)])
def test_torch_attention_modules_equal_cpu_build(tmp_path, place, tied):
    def build(device):
        torch.manual_seed(SEED)
        with torch.device(device):
            return TorchTransformer(tied=tied)

    assert_meta_build_equals_cpu_build(tmp_path, build, place)


@pytest.mark.parametrize("place,tied", [("cpu", False), ("cpu", True), ("nvme", False)])
def test_hf_llama_equals_cpu_build(tmp_path, place, tied):
    assert_meta_build_equals_cpu_build(tmp_path, lambda device: hf_llama(device, tied), place)


class Gate(nn.Module):
    """A module PreTrainedModel._init_weights does not know: it keeps its constructor's values."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.empty(d))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.uniform_(self.w, -1.0, 1.0)

    def forward(self, x):
        return x * self.w


@functools.cache
def tiny_pretrained_class():
    transformers = pytest.importorskip("transformers")

    class TinyLM(transformers.PreTrainedModel):
        config_class = transformers.PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.embed = nn.Embedding(128, 32)
            self.gate = Gate(32)
            self.head = nn.Linear(32, 128)
            if getattr(config, "with_scale", False):
                self.scale = Scale(32)  # neither a default init nor known to _init_weights
            self.post_init()

        def forward(self, ids, labels):
            return F.cross_entropy(self.head(self.gate(self.embed(ids))).flatten(0, 1), labels.flatten())

    return TinyLM


def test_hf_model_keeps_the_default_init_of_modules_init_weights_skips(tmp_path):
    tiny = tiny_pretrained_class()

    def build(device):
        torch.manual_seed(SEED)
        with torch.device(device):
            return tiny(tiny.config_class())

    assert_meta_build_equals_cpu_build(tmp_path, build, "cpu")


def test_hf_module_init_weights_leaves_uninitialized_is_refused_by_name(tmp_path):
    tiny = tiny_pretrained_class()
    with torch.device("meta"):
        model = tiny(tiny.config_class(with_scale=True))
    with pytest.raises(ValueError, match=r"module Scale \(scale\): TinyLM._init_weights\(\) leaves gain "
                                         r"uninitialized.*weights="):
        offload.initialize(model, cfg(tmp_path))


def test_module_without_any_init_is_refused_by_name(tmp_path):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), Scale(16))
    with pytest.raises(ValueError, match=r"module Scale \(1\): .*neither reset_parameters\(\) nor "
                                         r"_reset_parameters\(\).*build the model on the CPU.*weights="):
        offload.initialize(model, cfg(tmp_path))


def test_progress_shows_only_when_initialization_is_slow(tmp_path, capsys, monkeypatch):
    with torch.device("meta"):
        model = TorchTransformer()
    offload.initialize(model, cfg(tmp_path / "quiet")).close()
    assert "initializing" not in capsys.readouterr().err  # (the memory plan is printed once, always)
    monkeypatch.setattr(materialize, "PROGRESS_FIRST_S", 0.0)
    with torch.device("meta"):
        model = TorchTransformer()
    with offload.initialize(model, cfg(tmp_path / "slow")) as eng:
        n = len(eng.units)
    err = capsys.readouterr().err
    assert f"offload: initializing: 1/{n} units placed" in err
    assert f"offload: initializing: {n}/{n} units placed" in err
