"""TRL's trainers on the offload engine (offload.integrations.trl): OffloadSFTTrainer's losses equal stock
SFTTrainer's, full and LoRA; OffloadDPOTrainer's equal stock DPOTrainer's with the reference model on a
frozen engine of its own (its memory measured: weights only), or, with LoRA, the policy with its adapters
disabled; fp32, step by step, 1e-5 relative. Then what is refused and what is said."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("OffloadTrainer needs transformers 5", allow_module_level=True)

from offload.integrations.transformers import OffloadTrainer  # noqa: E402
from offload.integrations.trl import OffloadDPOTrainer, OffloadSFTTrainer  # noqa: E402

STEPS, BATCH, GAS = 5, 2, 2
PROMPTS = ["what is the capital of france ?", "hello there ,", "how are you ?", "name a colour :", "two plus two is"]
GOOD = ["paris .", "hello to you .", "fine , thanks .", "blue .", "four ."]
BAD = ["london .", "go away .", "what ?", "four .", "five ."]


def tokenizer():
    """A word-level tokenizer over the words above: built here, nothing downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for text in PROMPTS + GOOD + BAD for w in text.split()})
    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="</s>")


TOKENIZER = tokenizer()


def tiny_llama(config=None, model=None):
    """A 2-layer model over TOKENIZER from seed 0: a Llama, or the (config, model) classes given."""
    config, model = config or transformers.LlamaConfig, model or transformers.LlamaForCausalLM
    cfg = config(vocab_size=len(TOKENIZER), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 pad_token_id=TOKENIZER.pad_token_id, eos_token_id=TOKENIZER.eos_token_id)
    torch.manual_seed(0)
    return model(cfg)


def repeat(texts):
    n = STEPS * BATCH * GAS
    return [texts[i % len(texts)] for i in range(n)]


def sft_data():
    return datasets.Dataset.from_dict({"prompt": repeat(PROMPTS), "completion": repeat(GOOD)})


def dpo_data():
    return datasets.Dataset.from_dict({"prompt": repeat(PROMPTS), "chosen": repeat(GOOD), "rejected": repeat(BAD)})


def nvme(tmp_path) -> dict:
    return {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"},
            "nvme_path": str(tmp_path / "swap"), "units": {"classes": ["LlamaDecoderLayer"]}}


def config(cls, tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=GAS,
                max_steps=STEPS, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                disable_tqdm=True, train_sampling_strategy="sequential", dataloader_pin_memory=False,
                bf16=False)  # fp32: the losses compare at 1e-5
    return cls(**{**base, **kw})


def lora():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.fixture
def closing():
    """Closes every offload trainer a test made."""
    made = []
    yield made.append
    for t in made:
        t.close()


def train_both(stock, ours, tmp_path, closing, build):
    """({class: its losses}, our trainer): the stock trainer and ours, each built by build(cls, its extra
    keyword arguments: ours gets an nvme offload_config) and trained."""
    runs, t = {}, None
    for cls in (stock, ours):
        t = build(cls, {"offload_config": nvme(tmp_path)} if cls is ours else {})
        if cls is ours:
            closing(t)
        t.train()
        runs[cls] = losses(t)
    return runs, t


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_sft_losses_equal_stock_sft_trainer(tmp_path, closing, kind):
    lr, extra = (1e-2, {"peft_config": lora()}) if kind == "lora" else (1e-3, {})
    runs, _ = train_both(trl.SFTTrainer, OffloadSFTTrainer, tmp_path, closing, lambda cls, more: cls(
        model=tiny_llama(), args=config(trl.SFTConfig, tmp_path, learning_rate=lr), train_dataset=sft_data(),
        processing_class=TOKENIZER, **extra, **more))
    assert len(runs[OffloadSFTTrainer]) == STEPS
    assert runs[OffloadSFTTrainer] == pytest.approx(runs[trl.SFTTrainer], rel=1e-5)
    assert runs[OffloadSFTTrainer][-1] < runs[OffloadSFTTrainer][0]  # it trained


@pytest.mark.parametrize("reference", ["ref_model", "loaded from the model's directory", "precomputed"])
def test_dpo_losses_equal_stock_dpo_trainer_with_the_reference_on_a_frozen_engine(tmp_path, closing, reference):
    """The reference model runs on an engine of its own: its weights on nvme, streamed per unit for its
    forward, no optimizer state, no gradient; they stay as they were."""
    directory = tmp_path / "policy"
    tiny_llama().save_pretrained(directory)

    def build(cls, more):
        if reference == "loaded from the model's directory":
            models = {"model": str(directory)}
        else:
            models = {"model": tiny_llama(), "ref_model": tiny_llama()}
        args = config(trl.DPOConfig, tmp_path, precompute_ref_log_probs=reference == "precomputed")
        return cls(**models, args=args, train_dataset=dpo_data(), processing_class=TOKENIZER, **more)

    runs, t = train_both(trl.DPOTrainer, OffloadDPOTrainer, tmp_path, closing, build)
    assert len(runs[OffloadDPOTrainer]) == STEPS
    assert runs[OffloadDPOTrainer] == pytest.approx(runs[trl.DPOTrainer], rel=1e-5)
    assert runs[OffloadDPOTrainer][-1] < runs[OffloadDPOTrainer][0]

    (ref,) = t.frozen_engines
    assert t.ref_model is ref and t.engine is not ref
    initial = tiny_llama()
    assert all(torch.equal(v, initial.state_dict()[n]) for n, v in ref.full_state_dict().items())  # as it came
    plan, measured, policy = ref.placement, ref.stats()["tiers"], t.engine.stats()["tiers"]
    layers = sum(p.numel() for p in initial.model.layers.parameters())
    assert plan.trainable_numel == 0 and not plan.state_home
    assert plan.frozen_numel == sum(p.numel() for p in initial.parameters())
    assert layers * 4 <= measured["nvme"]["peak_bytes"] < layers * 4 * 1.1  # its fp32 weights on nvme, nothing else
    assert measured["dram"]["peak_bytes"] == plan.chunk_bytes  # one chunk (writes its weights): no optimizer window
    for tier in ("hbm", "dram", "nvme"):
        assert measured[tier]["peak_bytes"] <= plan.need[tier], (tier, plan.summary())
    assert policy["nvme"]["peak_bytes"] > 4 * measured["nvme"]["peak_bytes"]  # the policy's: weights + 16 B states
    print("reference engine peaks:", {k: v["peak_bytes"] for k, v in measured.items()},
          "policy engine:", {k: v["peak_bytes"] for k, v in policy.items()})


def test_dpo_with_lora_uses_the_policy_with_its_adapters_disabled_as_the_reference(tmp_path, closing):
    runs = {}
    for cls in (trl.DPOTrainer, OffloadDPOTrainer):
        more = {"offload_config": nvme(tmp_path)} if cls is OffloadDPOTrainer else {}
        t = cls(model=tiny_llama(), args=config(trl.DPOConfig, tmp_path, learning_rate=1e-2), train_dataset=dpo_data(),
                processing_class=TOKENIZER, peft_config=lora(), **more)
        if cls is OffloadDPOTrainer:
            closing(t)
        t.train()
        runs[cls] = losses(t)
    assert runs[OffloadDPOTrainer] == pytest.approx(runs[trl.DPOTrainer], rel=1e-5)
    assert runs[OffloadDPOTrainer][-1] < runs[OffloadDPOTrainer][0]
    assert t.ref_model is None and t.frozen_engines == []  # no second model: nothing extra to place


def test_offload_trainer_must_come_first_among_the_bases():
    with pytest.raises(TypeError, match=r"class Reversed\(SFTTrainer, OffloadTrainer\): OffloadTrainer must come "
                                        r"before SFTTrainer .*write class Reversed\(OffloadTrainer, SFTTrainer\)"):
        class Reversed(trl.SFTTrainer, OffloadTrainer):
            pass

    class Mine(OffloadSFTTrainer):  # a subclass of a right one is right
        pass


@pytest.mark.parametrize("kw, ref, message", [
    ({"sync_ref_model": True}, True, "sync_ref_model=True"),
    ({"precompute_ref_log_probs": True}, False, "precompute_ref_log_probs=True without ref_model"),
])
def test_dpo_settings_the_engine_cannot_honour_are_refused(tmp_path, kw, ref, message):
    with pytest.raises(ValueError, match=message):
        OffloadDPOTrainer(model=tiny_llama(), ref_model=tiny_llama() if ref else None,
                          args=config(trl.DPOConfig, tmp_path, **kw), train_dataset=dpo_data(),
                          processing_class=TOKENIZER, offload_config=nvme(tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's precision check")
def test_trls_bf16_default_on_a_cpu_without_native_bf16_says_what_to_set(tmp_path, monkeypatch, closing):
    from offload.plan import precision

    monkeypatch.setattr(precision, "cpu_bf16_native", lambda: False)
    args = config(trl.SFTConfig, tmp_path, bf16=None, use_cpu=True)  # SFTConfig's default: bf16=True
    assert args.bf16
    with pytest.warns(UserWarning, match=r"OffloadTrainer: bf16=True \(SFTConfig's default\) "
                                         r"is slow on this host: this CPU has no native bf16 .*; set bf16=False to "
                                         r"train in fp32, what precision \"auto\" picks here"):
        t = OffloadSFTTrainer(model=tiny_llama(), args=args, train_dataset=sft_data(), processing_class=TOKENIZER,
                              offload_config=nvme(tmp_path))
    closing(t)
    assert t.engine.cfg.precision == "bf16"  # said, and honoured


def test_close_keep_weights_hands_back_the_policy_and_the_reference(tmp_path, closing):
    """OffloadDPOTrainer.close(keep_weights=True): the trained policy runs in plain PyTorch with its engine's
    logits, and the reference model (its own frozen engine) comes back as it was given."""
    policy, reference = tiny_llama(), tiny_llama()
    t = OffloadDPOTrainer(model=policy, ref_model=reference, args=config(trl.DPOConfig, tmp_path, max_steps=2),
                          train_dataset=dpo_data(), processing_class=TOKENIZER, offload_config=nvme(tmp_path))
    closing(t)
    t.train()
    ids = torch.tensor([TOKENIZER("the cat sat").input_ids])
    with torch.no_grad():
        ours = t.engine(input_ids=ids).logits
    t.close(keep_weights=True)
    with torch.no_grad():
        assert torch.equal(policy(input_ids=ids).logits, ours)
        assert torch.equal(reference(input_ids=ids).logits, tiny_llama()(input_ids=ids).logits)


# -- GRPO: rollouts through the engine (issue 51) -----------------------------------------------------------------

def tiny_qwen2():
    return tiny_llama(transformers.Qwen2Config, transformers.Qwen2ForCausalLM)


def length_reward(completions, **kw):
    return [float(len(c)) for c in completions]


def grpo_args(tmp_path, name, beta):
    return trl.GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=3, num_generations=3,
                          max_completion_length=8, max_steps=3, learning_rate=1e-2, logging_steps=1, report_to=[],
                          save_strategy="no", disable_tqdm=True, bf16=False, seed=0, dataloader_pin_memory=False,
                          beta=beta)


@pytest.mark.parametrize("policy", ["full", pytest.param("full with a reference", marks=pytest.mark.slow), "lora",
                                    pytest.param("qlora", marks=pytest.mark.slow)])
def test_grpo_rewards_lengths_and_losses_equal_stock_grpo_trainer(tmp_path, closing, policy):
    """3 GRPO steps of a tiny Qwen2, its weights and states on nvme, sampled rollouts (num_generations 3, 8
    new tokens at most) through the engine: each step's mean reward, mean completion length and loss equal
    stock GRPOTrainer's in memory under the same seed (losses 1e-5 relative or 1e-6 absolute). With a reference (beta > 0): a
    full policy's on a frozen engine, a LoRA policy's its adapters disabled."""
    from offload.integrations.trl import OffloadGRPOTrainer

    directory = tmp_path / "policy"
    tiny_qwen2().save_pretrained(directory)
    beta = 0.0 if policy == "full" else 0.04
    data = datasets.Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(12)]})
    runs = {}
    for cls in (trl.GRPOTrainer, OffloadGRPOTrainer):
        more = ({"offload_config": {**nvme(tmp_path), "units": {"classes": ["Qwen2DecoderLayer"]}}}
                if cls is OffloadGRPOTrainer else {})
        if policy == "qlora":
            q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                bnb_4bit_use_double_quant=True)
            model = transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=q,
                                                                      dtype=torch.float32)
        else:
            model = tiny_qwen2() if policy == "full" else str(directory)
        if policy in ("lora", "qlora"):
            more["peft_config"] = lora()
        t = cls(model=model, reward_funcs=length_reward, args=grpo_args(tmp_path, cls.__name__, beta),
                train_dataset=data, processing_class=TOKENIZER, **more)
        if cls is OffloadGRPOTrainer:
            closing(t)
        t.train()
        runs[cls] = [(h["loss"], h["reward"], h["completions/mean_length"]) for h in t.state.log_history
                     if "loss" in h]
        if cls is OffloadGRPOTrainer:
            assert len(t.frozen_engines) == (1 if policy == "full with a reference" else 0)
    ours, stock = runs[OffloadGRPOTrainer], runs[trl.GRPOTrainer]
    assert len(ours) == 3
    assert [r[1:] for r in ours] == [r[1:] for r in stock]  # the same rollouts: rewards and lengths exactly
    # GRPO's loss is near zero after the first step (advantages centred): 1e-5 relative, or 1e-6 absolute
    assert [r[0] for r in ours] == pytest.approx([r[0] for r in stock], rel=1e-5, abs=1e-6)


def test_grpo_settings_the_engine_does_not_run_are_refused(tmp_path):
    from offload.integrations.trl import OffloadGRPOTrainer

    args = grpo_args(tmp_path, "x", 0.0)
    args.use_vllm = True
    with pytest.raises(ValueError, match=r"OffloadGRPOTrainer: use_vllm=True: the rollouts are generated through the "
                                         r"offload engine.*set it False"):
        OffloadGRPOTrainer(model=tiny_qwen2(), reward_funcs=length_reward, args=args,
                           train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}), processing_class=TOKENIZER,
                           offload_config=nvme(tmp_path))


@pytest.mark.slow
@pytest.mark.pretrained
def test_the_grpo_example_runs_on_smollm2(smollm2):
    """examples/grpo.py, cut to one step: the rollouts of the real model through the engine are rewarded."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "examples", "grpo.py"), "--steps", "1", "--prompts", "1",
                           "--generations", "2", "--max-new-tokens", "4"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["rewards"]) == 1 and 0 <= result["rewards"][0] <= 1 and not result["stock"]
