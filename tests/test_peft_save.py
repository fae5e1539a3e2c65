"""A PEFT model trained through the engine saves what peft loads (issue 31, part 2): `save_pretrained(dir)`
on the wrapped model and OffloadTrainer.save_model write the adapter (adapter_config.json +
adapter_model.safetensors), read from the trainable parameters' masters without reading the frozen base,
and peft's from_pretrained on a fresh base gives the engine's logits."""

import json
import os

import pytest
import torch

import offload

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, SEQ = 128, 16


def base_model():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def lora_model():
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(base_model(), config)


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(n)]


def nvme(tmp_path) -> dict:
    return {"precision": "fp32", "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"},
            "nvme_path": str(tmp_path / "swap"), "units": {"classes": ["LlamaDecoderLayer"]},
            "optimizer": {"lr": 1e-2}}


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_save_pretrained_on_the_wrapped_peft_model_writes_the_adapter_peft_loads(tmp_path):
    model = lora_model()
    with offload.initialize(model, nvme(tmp_path)) as eng:
        for ids in batches(3):
            eng.backward(eng(input_ids=ids, labels=ids).loss)
            eng.step()
        reads = []
        read = eng.store.read
        eng.store.read = lambda key, *a, **k: (reads.append(key), read(key, *a, **k))[1]
        model.save_pretrained(str(tmp_path / "adapter"))  # as users call it: no state_dict=
        eng.store.read = read
        assert reads and all("master" in k for k in reads), reads  # no frozen weight read
        eng.eval()
        ours = logits(eng, batches(1)[0])
    files = set(os.listdir(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files, files
    loaded = peft.PeftModel.from_pretrained(base_model(), str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(logits(loaded, batches(1)[0]), ours, rtol=1e-6, atol=1e-6)
    assert not torch.equal(ours, logits(base_model().eval(), batches(1)[0]))  # the adapter trained


def test_offload_trainer_saves_a_peft_model_as_its_adapter(tmp_path):
    pytest.importorskip("accelerate")
    from offload.integrations.transformers import OffloadTrainer

    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.cat(batches(4))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                                          learning_rate=1e-2, max_steps=3, save_strategy="no", report_to=[],
                                          disable_tqdm=True, dataloader_pin_memory=False)
    trainer = OffloadTrainer(model=lora_model(), args=args, train_dataset=data, offload_config=nvme(tmp_path))
    try:
        trainer.train()
        trainer.save_model(str(tmp_path / "saved"))
        ours = logits(trainer.engine, batches(1)[0])
    finally:
        trainer.close()
    files = set(os.listdir(tmp_path / "saved"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files, files
    assert json.loads((tmp_path / "saved" / "adapter_config.json").read_text())["r"] == 4
    loaded = peft.PeftModel.from_pretrained(base_model(), str(tmp_path / "saved")).eval()
    torch.testing.assert_close(logits(loaded, batches(1)[0]), ours, rtol=1e-6, atol=1e-6)
