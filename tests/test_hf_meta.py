"""Hugging Face models under offload as users build them (issue 31): a Llama built on the meta device
streamed from weights= gives the CPU build's logits (its rotary buffers included); a peft LoRA model
built on meta starts from the base model (lora_B zero), as its CPU build does; a wrapped model's
forward under no_grad and generate() work."""

import copy

import pytest
import torch

import offload

transformers = pytest.importorskip("transformers")

SEED = 3


def cfg(tmp_path, place="nvme"):
    return {"precision": "fp32", "offload_param": {"device": place}, "offload_optimizer": {"device": place},
            "nvme_path": str(tmp_path / "swap"), "seed": SEED}


def llama_config(vocab: int = 300):
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def llama(device: str, vocab: int = 300):
    torch.manual_seed(SEED)
    with torch.device(device):
        return transformers.LlamaForCausalLM(llama_config(vocab))


def ids(vocab: int = 300, length: int = 16):
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def logits(model, x):
    return model(input_ids=x).logits


@pytest.mark.parametrize("place", ["nvme", "cpu"])
def test_meta_llama_with_weights_source_gives_the_cpu_build_logits(tmp_path, place):
    cpu = llama("cpu").eval()
    values = {n: p.detach().clone() for n, p in cpu.named_parameters()}
    meta = llama("meta")
    with offload.initialize(meta, cfg(tmp_path, place), weights=values.__getitem__) as eng:
        eng.eval()
        for name, b in cpu.named_buffers():  # non-persistent: no checkpoint holds them, the module's init does
            assert torch.equal(meta.get_buffer(name), b), name
        torch.testing.assert_close(logits(eng.module, ids()), logits(cpu, ids()), rtol=0, atol=0)


class WithBuffers(torch.nn.Module):
    """A persistent buffer the checkpoint holds, a non-persistent one reset_parameters() sets, and one
    set only in __init__ (nothing can set it again on meta)."""

    def __init__(self, init_only: bool = False):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("shift", torch.empty(4), persistent=False)
        if init_only:
            self.register_buffer("odd", torch.ones(4), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        self.shift.fill_(0.5)

    def forward(self, x):
        return (self.lin(x) * self.scale + self.shift).sum()


def test_weights_source_gives_persistent_buffers_and_init_the_others(tmp_path):
    torch.manual_seed(0)
    cpu = WithBuffers()
    cpu.scale.fill_(3.0)  # as if trained: only the checkpoint knows this value
    source = {n: t.detach().clone() for n, t in cpu.state_dict().items()}
    with torch.device("meta"):
        meta = WithBuffers()
    with offload.initialize(meta, cfg(tmp_path, "cpu"), weights=source.__getitem__):
        assert torch.equal(meta.scale, cpu.scale) and torch.equal(meta.shift, cpu.shift)
    with torch.device("meta"):
        meta = WithBuffers(init_only=True)
    with pytest.raises(ValueError, match=r"buffer odd \(WithBuffers\): on the meta device, not given by weights="):
        offload.initialize(meta, cfg(tmp_path, "cpu"), weights=source.__getitem__)


# --- peft ------------------------------------------------------------------------------------------------


def lora_llama(device: str, **lora):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **lora)
    torch.manual_seed(SEED)
    with torch.device(device):
        return peft.get_peft_model(transformers.LlamaForCausalLM(llama_config()), config)


@pytest.mark.parametrize("init,place", [(True, "nvme"), ("gaussian", "nvme"), ("gaussian", "cpu")])
def test_meta_peft_model_starts_from_the_base_model_as_its_cpu_build(tmp_path, monkeypatch, init, place):
    from offload.state import materialize

    cpu = lora_llama("cpu", init_lora_weights=init).eval()
    base = llama("cpu").eval()  # the same seed: the base model the CPU build wrapped
    meta = lora_llama("meta", init_lora_weights=init)
    events = []  # [Note: adapters initialized late]: each layer is placed with its base, not at the end
    for name in ("place", "_fill_late"):
        monkeypatch.setattr(materialize, name, lambda *a, _f=getattr(materialize, name), _n=name, **k:
                            (events.append((_n, a[1].name)), _f(*a, **k))[1])
    with offload.initialize(meta, cfg(tmp_path, place)) as eng:
        layers = [u.name for u in eng.units if ".layers." in u.name]
        assert len(layers) == 2 and [e for e in events if e[0] == "_fill_late"] == [("_fill_late", n) for n in layers]
        assert max(events.index(("place", n)) for n in layers) < events.index(("_fill_late", layers[0]))
        state = eng.full_state_dict()
        lora_b = [n for n in state if ".lora_B." in n]
        assert len(lora_b) == 4 and all(not state[n].any() for n in lora_b)
        assert all(torch.equal(state[n], p.detach()) for n, p in cpu.named_parameters())  # lora_A's draws too
        eng.eval()
        torch.testing.assert_close(logits(eng, ids()), logits(base, ids()), rtol=0, atol=0)


def test_meta_peft_init_that_reads_base_weights_is_refused(tmp_path):
    meta = lora_llama("meta", init_lora_weights="pissa")
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa' reads the base weights.*build the model on "
                                         r"the CPU, or pass weights="):
        offload.initialize(meta, cfg(tmp_path))


# --- forward without grad ----------------------------------------------------------------------------------


def test_first_forward_under_no_grad_then_training(tmp_path):
    """A vocabulary large enough to make the embedding a unit of its own (the hooks count references to
    its weights to skip its fetch in backward), as in a real Llama."""
    model = llama("cpu", vocab=32000)
    ref = copy.deepcopy(model)
    x = ids(32000)
    with offload.initialize(model, cfg(tmp_path)) as eng:
        assert any(u.name.endswith("embed_tokens") for u in eng.units)
        eng.eval()
        torch.testing.assert_close(logits(eng, x), logits(ref.eval(), x), rtol=0, atol=0)
        eng.train()
        loss = eng(input_ids=x, labels=x).loss
        eng.backward(loss)
        eng.step()
        assert loss.item() == ref.train()(input_ids=x, labels=x).loss.item()


def test_generate_between_training_steps_equals_the_plain_model(tmp_path):
    """generate() on the wrapped model (its forwards under no_grad, outside the engine's forward) gives
    the plain model's tokens, before training and between steps, and training goes on as the plain loop's."""
    model = llama("cpu", vocab=32000)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    x = ids(32000, 12)
    prompt = dict(input_ids=x[:, :6], attention_mask=torch.ones(2, 6, dtype=torch.long), max_new_tokens=4,
                  do_sample=False, pad_token_id=0)
    config = {**cfg(tmp_path), "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.0}}
    ours, theirs = [], []
    with offload.initialize(model, config) as eng:
        for step in range(3):
            eng.eval()
            ref.eval()
            got, expected = model.generate(**prompt), ref.generate(**prompt)
            assert got.shape == (2, 10) and torch.equal(got, expected), step
            eng.train()
            ref.train()
            loss = eng(input_ids=x, labels=x).loss
            eng.backward(loss)
            eng.step()
            ours.append(loss.item())
            loss = ref(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            theirs.append(loss.item())
    assert ours == theirs
