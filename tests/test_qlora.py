"""QLoRA through the tiers (issue 40): a base quantized by bitsandbytes (nf4 and fp4 with and without double
quantization, int8) trains through offload.initialize with its frozen weights stored and moved as they are
(packed bytes plus their quantization state: [Note: quantized weights as records] in offload.plan.quantized), to
the losses of the plain peft + bitsandbytes loop (torch AdamW on the adapters, fp32), in hbm, dram and nvme;
the packed bytes come back bit for bit, and nvme reads the quantized bytes, not an expansion of them."""

import copy
import json
import sys

import pytest
import torch

import offload
from offload.plan import quantized

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

VOCAB, SEQ, STEPS, LR = 300, 16, 5, 1e-2  # the byte tokenizer of offload train needs 257
QUANT = {
    "nf4-dq": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "int8": dict(load_in_8bit=True),
}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return str(d)


def qlora(base_dir: str, quant: str, mode: str = "train"):
    """The LoRA model on from_pretrained's quantized base, in `mode`, which picks bitsandbytes' kernels: "train"
    its training ones (4-bit: dequantize, then matmul; int8: MatMul8bitFp), "eval" its inference ones (int8:
    MatMul8bitLt; 4-bit on an AVX512-BF16 CPU: a repack of the weight and its own kernel, [Note: the CPU
    inference repack] in offload.plan.quantized). from_pretrained returns eval mode: say which."""
    q = transformers.BitsAndBytesConfig(**QUANT[quant])
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=q, dtype=torch.float32)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))
    return model.train(mode == "train")


def batches(n: int):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(n)]


def config(tmp_path, where: str) -> dict:
    param = {"hbm": "none", "dram": "cpu", "nvme": "nvme"}[where]
    return {"precision": "fp32", "offload_param": {"device": param}, "offload_optimizer": {"device": "cpu"},
            "nvme_path": str(tmp_path / "nvme"), "units": {"classes": ["LlamaDecoderLayer"]},
            "optimizer": {"type": "adamw", "lr": LR, "weight_decay": 0.0}}


def plain_losses(model, data) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0,
                            foreach=False)
    out = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def train(engine, data) -> list[float]:
    out = []
    for ids in data:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def packed_bytes(model) -> dict:
    """Every quantized weight's record, as the layer holds it now."""
    return {n: rec.capture() for n, rec in ((n, quantized.records(model).get(p)) for n, p in model.named_parameters())
            if rec is not None}


def stored_records(engine) -> dict:
    """Every quantized weight's record as the engine holds it at home: each unit fetched, captured, released."""
    out = {}
    for u in engine.units:
        w = engine.weights[u.index]
        w.wait_for_fetch()
        out.update({s.name: s.record.capture() for s in u.slots if s.record is not None})
        w.release()
    return out


@pytest.mark.parametrize("quant,where", [("nf4-dq", "hbm"), ("nf4-dq", "dram"), ("nf4-dq", "nvme"),
                                         ("nf4", "nvme"), ("fp4", "dram"), ("int8", "nvme"), ("int8", "hbm")])
def test_a_quantized_base_trains_to_the_plain_loops_losses(tmp_path, base_dir, quant, where):
    data = batches(1) * STEPS  # one batch again and again: the loss must fall
    reference = plain_losses(qlora(base_dir, quant), data)
    model = qlora(base_dir, quant)
    before = packed_bytes(model)
    assert before, "the base has quantized weights"
    with offload.initialize(model, config=config(tmp_path, where)) as engine:
        assert train(engine, data) == pytest.approx(reference, rel=1e-6)
        assert reference[-1] < reference[0]  # it trained
        seen = 0
        for u in engine.units:  # the bytes at home after training, fetched: each record bit for bit as loaded
            w = engine.weights[u.index]
            w.wait_for_fetch()
            for s in u.slots:
                if s.record is not None:
                    assert torch.equal(s.record.capture(), before[s.name]), s.name
                    seen += 1
            w.release()
        assert seen == len(before)


# -- offload train --quantize: the base quantized as it is materialized ----------------------------------------

def _train_args(base_dir, tmp_path, *extra):
    from offload import recipe

    return recipe.train_parser().parse_args(["--model", base_dir, "--lora", "4", "--seq-len", str(SEQ),
                                             "--batch-size", "2", "--steps", "2", "--nvme-path",
                                             str(tmp_path / "nvme"), "--out", str(tmp_path / "run"),
                                             "--no-progress", *extra])


@pytest.mark.parametrize("quant,flag", [("nf4-dq", "nf4"), ("int8", "int8")])
def test_quantize_flag_quantizes_as_from_pretrained_bit_for_bit(tmp_path, base_dir, quant, flag):
    """The engine's records (streamed from the safetensors, quantized unit by unit on the meta-built model)
    equal the ones from_pretrained(..., quantization_config=...) makes, byte for byte, name for name."""
    from offload import recipe

    cfg, run = recipe.resolve(_train_args(base_dir, tmp_path, "--quantize", flag, "--precision", "fp32"))
    model, weights, info = recipe.build(run, cfg)
    assert info["quantized"] == {"kind": flag, "layers": 14}  # 7 linears x 2 layers; lm_head stays
    expected = packed_bytes(qlora(base_dir, quant))
    with offload.initialize(model, cfg, weights=weights) as engine:
        got = stored_records(engine)
        assert engine.placement.quantized[flag][0] == 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)
        records = sum(s.record.nbytes for u in engine.units for s in u.slots if s.record is not None)
        assert engine.placement.quantized[flag][1] == records == sum(t.numel() for t in expected.values())
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_quantize_needs_lora_and_names_the_reason(tmp_path, base_dir):
    from offload import recipe

    args = recipe.train_parser().parse_args(["--model", base_dir, "--quantize", "nf4"])
    with pytest.raises(ValueError, match=r"--quantize=nf4: a quantized base cannot be trained itself.*add --lora R"):
        recipe.resolve(args)
    with pytest.raises(ValueError, match=r"quantize_base='q3'.*use \"nf4\""):
        offload.Config(quantize_base="q3")


def test_without_bitsandbytes_quantize_names_the_extra(tmp_path, base_dir, monkeypatch):
    from offload import recipe

    cfg, run = recipe.resolve(_train_args(base_dir, tmp_path, "--quantize", "nf4"))
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: its import fails
    with pytest.raises(ValueError, match=r"needs the bitsandbytes package.*pip install 'offload\[qlora\]'"):
        recipe.build(run, cfg)


def test_the_saved_adapter_loads_on_the_4bit_base_and_merged_loads_alone(tmp_path, base_dir, capsys):
    """--save: peft loads the adapter on from_pretrained's 4-bit base (its path in the adapter config) and gives
    the engine's logits; --save-merged: AutoModelForCausalLM loads the merged model (the base dequantized plus
    alpha/r B A), with the same logits within the 4-bit's own rounding of the merge."""
    from offload import train as training

    args = _train_args(base_dir, tmp_path, "--quantize", "nf4", "--precision", "fp32", "--save",
                       str(tmp_path / "adapter"), "--save-merged", str(tmp_path / "merged"), "--lr", "1e-2")
    training.train(args)
    q = transformers.BitsAndBytesConfig(**QUANT["nf4-dq"])
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=q, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    assert json.load(open(tmp_path / "adapter" / "adapter_config.json"))["base_model_name_or_path"] == base_dir
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    ids = batches(1)[0]
    loaded.train()  # bitsandbytes' training kernel: the fp32 dequantized base, as the merge (eval mode may repack)
    with torch.no_grad():
        a, m = loaded(input_ids=ids).logits, merged(input_ids=ids).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=q,
                                                                 dtype=torch.float32).train()(input_ids=ids).logits
    assert not torch.allclose(a, plain, atol=1e-4)  # the adapter trained: it moves the logits
    torch.testing.assert_close(m, a, rtol=1e-4, atol=1e-4)


def test_merged_of_a_bf16_base_is_bf16_and_equals_peft_merge_on_its_dequantized_base(tmp_path, capsys):
    """--save-merged of an nf4 run on a bf16 directory: bf16 tensors under a bf16 config, bit for bit what peft's
    merge_and_unload writes on from_pretrained's 4-bit base dequantized (in bf16, its own dtype) with the saved
    adapter; AutoModelForCausalLM and AutoTokenizer load the directory alone."""
    from offload import train as training
    from offload.integrations.hf_io import iter_safetensors
    from tests.hf_util import save_tokenizer

    base_dir = tmp_path / "bf16"
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(base_dir)
    tok = save_tokenizer(base_dir, "To be, or not to be, that is the question. " * 20)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    training.train(_train_args(str(base_dir), tmp_path, "--quantize", "nf4", "--save", str(adapter), "--save-merged",
                             str(merged), "--lr", "1e-2"))
    assert f"merged      {merged} (Hugging Face directory, bfloat16)" in capsys.readouterr().out
    q = transformers.BitsAndBytesConfig(**QUANT["nf4-dq"])
    dequantized = transformers.AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=q).dequantize()
    theirs = peft.PeftModel.from_pretrained(dequantized, str(adapter)).merge_and_unload().state_dict()
    ours = dict(iter_safetensors(str(merged)))
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, theirs[name]), name
    config = json.loads((merged / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    model = transformers.AutoModelForCausalLM.from_pretrained(merged)
    assert model.dtype == torch.bfloat16
    assert transformers.AutoTokenizer.from_pretrained(merged)("the question").input_ids == tok("the question").input_ids


def test_nvme_reads_the_quantized_bytes_once_per_fetch(tmp_path, base_dir, monkeypatch):
    """A step reads from nvme exactly the fetched units' flat buffers, whose quantized weights are their
    records (a few bits a parameter), not an expansion of them."""
    from offload.state.residency import WeightHandle

    reads = []
    original = WeightHandle._read_chunks
    monkeypatch.setattr(WeightHandle, "_read_chunks", lambda self, update=None: (reads.append(self.unit.index),
                                                                                 original(self, update))[1])
    model = qlora(base_dir, "nf4-dq")
    with offload.initialize(model, config=config(tmp_path, "nvme")) as engine:
        layers = [u for u in engine.units if any(s.record is not None for s in u.slots)]
        for u in layers:  # a decoder layer: its records' bytes, padded, plus adapters and norms at fp32
            records = sum(s.record.nbytes for s in u.slots if s.record is not None)
            dense = sum(s.numel for s in u.slots if s.record is None) * 4
            pad = 2 * 2048 * 4 + 32 * 4 * len(u.slots)  # the prefix and the buffer padded to 2048, slots to 32
            assert records <= engine.weights[u.index].nbytes <= records + dense + pad
            assert engine.weights[u.index].nbytes < sum(s.record.numel for s in u.slots if s.record) * 4 / 3
        for ids in batches(2):
            reads.clear()
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            read = engine.stats()["last_step"]["links"]["nvme_to_dram"]["bytes"]
            assert reads and read == sum(engine.weights[i].nbytes for i in reads)


def test_a_checkpoint_holds_the_quantized_bytes_and_resumes_bit_for_bit(tmp_path, base_dir):
    data = batches(4)
    run = train
    with offload.initialize(qlora(base_dir, "nf4-dq"), config=config(tmp_path, "nvme")) as engine:
        run(engine, data[:2])
        path = engine.save_checkpoint(str(tmp_path / "ckpt"))
        straight = run(engine, data[2:])
    with offload.initialize(qlora(base_dir, "nf4-dq"), config=config(tmp_path, "dram")) as engine:
        engine.load_checkpoint(path)
        assert run(engine, data[2:]) == straight
    from offload.checkpoint import format as fmt

    manifest = fmt.read_manifest(path)
    marked = {n: e["quantized"] for n, e in manifest["tensors"].items() if "quantized" in e}
    assert len(marked) == 14 and set(marked.values()) == {"nf4"}
    for entry in manifest["tensors"].values():  # a checkpoint saved before it kept what dequantizes the bytes
        entry.pop("quantization", None)
    with pytest.raises(fmt.CheckpointError, match=r"is a nf4 weight stored as its quantized bytes.*--save-merged"):
        list(fmt.iter_weights(path, manifest, torch.float32, dequantize=quantized.dequantize_bytes))


@pytest.mark.parametrize("flag", ["nf4", "int8"])
def test_the_export_of_a_qlora_checkpoint_is_the_merged_model_save_merged_writes(tmp_path, base_dir, flag):
    """`offload checkpoint export` of an `offload train --lora --quantize` checkpoint: the base dequantized by
    bitsandbytes from the checkpoint's bytes, the adapters merged: the tensors --save-merged writes, bit for bit."""
    from offload.cli import main
    from offload.integrations.hf_io import iter_safetensors

    merged, ckpts, export = tmp_path / "merged", tmp_path / "ck", tmp_path / "export"
    args = ["train", "--model", base_dir, "--lora", "4", "--quantize", flag, "--seq-len", str(SEQ), "--batch-size", "2",
            "--steps", "2", "--lr", "1e-2", "--precision", "fp32", "--nvme-path", str(tmp_path / "nvme"),
            "--out", str(tmp_path / "run"), "--save-merged", str(merged), "--save-every", "2", "--checkpoint-dir",
            str(ckpts), "--no-progress"]
    assert main(args) == 0
    assert main(["checkpoint", "export", str(ckpts), str(export)]) == 0
    ours, theirs = dict(iter_safetensors(str(export))), dict(iter_safetensors(str(merged)))
    assert sorted(ours) == sorted(theirs) and any("q_proj" in n for n in ours)
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name


def test_what_cannot_move_as_a_record_is_refused_by_name(base_dir):
    from torch import nn

    class QuantLinear(nn.Module):  # the shape of a GPTQ layer: packed weights in buffers
        def __init__(self):
            super().__init__()
            self.register_buffer("qweight", torch.zeros(8, 8, dtype=torch.int32))
            self.bias = nn.Parameter(torch.zeros(8))

    model = nn.Sequential(nn.Linear(8, 8), QuantLinear())
    with pytest.raises(ValueError, match=r"1: .*QuantLinear is a quantized layer offload does not move yet; "
                                          r"supported: bitsandbytes Linear4bit"):
        quantized.records(model)
    ints = nn.Linear(8, 8)
    ints.register_parameter("scale", nn.Parameter(torch.zeros(8, dtype=torch.int8), requires_grad=False))
    with pytest.raises(ValueError, match=r"scale: a torch.int8 parameter of Linear"):
        quantized.records(ints)


def test_offload_trainer_trains_a_qlora_model_as_stock_trainer_does(tmp_path, base_dir):
    """OffloadTrainer over a 4-bit base on nvme: the losses of stock Trainer (fp32, 1e-5 relative)."""
    pytest.importorskip("accelerate")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("OffloadTrainer needs transformers 5")
    from offload.integrations.transformers import OffloadTrainer

    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.cat(batches(4))]

    def args(name):
        return transformers.TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=2,
                                              learning_rate=1e-2, max_steps=4, logging_steps=1, save_strategy="no",
                                              report_to=[], disable_tqdm=True, dataloader_pin_memory=False,
                                              train_sampling_strategy="sequential")

    stock = transformers.Trainer(model=qlora(base_dir, "nf4-dq"), args=args("stock"), train_dataset=data)
    stock.train()
    cfg = {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "cpu"}, "precision": "fp32",
           "nvme_path": str(tmp_path / "nvme"), "units": {"classes": ["LlamaDecoderLayer"]}}
    trainer = OffloadTrainer(model=qlora(base_dir, "nf4-dq"), args=args("ours"), train_dataset=data,
                             offload_config=cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (trainer, stock)]
    assert len(losses[0]) == 4 and losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_quantize_refuses_a_model_of_conv1d_layers_by_name():
    """GPT-2's linears are transformers' Conv1D: --quantize would leave the whole base in full precision."""
    from tests import hf_archs

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_archs.config("gpt2"))
    with pytest.raises(ValueError, match=r"quantize_base='nf4': 8 of the model's layers are transformers' Conv1D "
                                         r"\(GPT-2's; transformer.h.0.attn.c_attn, ...\).*from_pretrained"):
        quantized.replace_linears(model, "nf4", torch.float32)
    from offload import estimate

    with pytest.raises(ValueError, match=r"--quantize=int8: 8 of the model's layers are transformers' Conv1D"):
        estimate.quantized_weights(model, "int8")


# -- evaluation and training, each on bitsandbytes' kernel for its mode (issue 49) -------------------------------

def repack_on(model, kernel: str) -> None:
    """kernel "native": bitsandbytes repacks 4-bit weights for its CPU inference kernel as it decides (on a CPU
    with AVX512-BF16 only: skipped elsewhere); "forced": every Linear4bit repacks as if it had AVX512-BF16. The
    repack is plain PyTorch and runs anywhere; here the kernel it leads to is bitsandbytes' reference one, read
    with the repacked layout (numbers unlike the training kernel's, but deterministic), there the AVX512-BF16 one."""
    if kernel == "native" and not bnb.functional.has_avx512bf16():
        pytest.skip("needs a CPU with AVX512-BF16, where bitsandbytes repacks 4-bit weights at an eval-mode forward")
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit) and kernel == "forced":
            m.support_avx512bf16_for_cpu = True


def plain_eval(model, ids) -> torch.Tensor:
    """The plain model's eval-mode logits, taken on a copy: the repack of an eval forward stays there (trained
    after it, the plain model would run the inference kernel, which has no gradient: [Note: the CPU inference
    repack] in offload.plan.quantized)."""
    twin = copy.deepcopy(model).eval()
    with torch.no_grad():
        return twin(input_ids=ids).logits


def engine_eval(model, engine, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = engine(input_ids=ids).logits
    model.train()
    return out


def packed_layers(model) -> int:
    return sum(bool(getattr(m.weight.quant_state, "packing_format_for_cpu", False)) for m in model.modules()
               if isinstance(m, bnb.nn.Linear4bit))


@pytest.mark.parametrize("kernel", ["native", "forced"])
def test_the_4bit_eval_mode_runs_another_kernel_than_training(base_dir, kernel):
    """What the tests above guard against: on such a CPU an eval-mode forward repacks the weights and runs
    another kernel, whose logits are not the training kernel's; a reference in the wrong mode fails them."""
    model = qlora(base_dir, "nf4-dq")
    repack_on(model, kernel)
    ids = batches(1)[0]
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    evaluated = plain_eval(model, ids)
    assert packed_layers(model) == 0
    assert not torch.allclose(evaluated, trained, atol=1e-5)


def test_the_int8_eval_mode_runs_another_kernel_than_training_on_every_host(base_dir):
    model = qlora(base_dir, "int8")
    ids = batches(1)[0]
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    assert not torch.allclose(plain_eval(model, ids), trained, atol=1e-5)


SLOW = pytest.mark.slow  # the other placements of what nvme shows in the default suite (make test-slow)


@pytest.mark.parametrize("quant,where,kernel", [pytest.param("nf4-dq", "hbm", "forced", marks=SLOW),
                                                pytest.param("nf4-dq", "dram", "forced", marks=SLOW),
                                                ("nf4-dq", "nvme", "forced"), ("nf4-dq", "nvme", "native"),
                                                ("int8", "nvme", "native")])  # int8's kernels differ on any host
def test_eval_train_eval_through_the_engine_equal_the_plain_models(tmp_path, base_dir, quant, where, kernel):
    """model.eval() under no_grad through the engine gives the plain model's eval-mode logits, training then
    gives the plain loop's train-mode losses, and evaluating again the plain trained model's eval-mode logits."""
    plain, model = qlora(base_dir, quant), qlora(base_dir, quant)
    if quant != "int8":
        repack_on(plain, kernel)
        repack_on(model, kernel)
    data, ids = batches(1) * 3, batches(2)[1]
    with offload.initialize(model, config=config(tmp_path, where)) as engine:
        torch.testing.assert_close(engine_eval(model, engine, ids), plain_eval(plain, ids), rtol=0, atol=1e-6)
        assert train(engine, data) == pytest.approx(plain_losses(plain, data), rel=1e-6)
        torch.testing.assert_close(engine_eval(model, engine, ids), plain_eval(plain, ids), rtol=0, atol=1e-6)
        assert packed_layers(model) == 0  # the record stays in the training kernel's layout


@pytest.mark.parametrize("where,kernel", [pytest.param("hbm", "forced", marks=SLOW),
                                          pytest.param("dram", "forced", marks=SLOW), ("nvme", "forced"),
                                          ("nvme", "native")])
def test_a_base_repacked_by_an_evaluation_trains_to_the_plain_loops_losses(tmp_path, base_dir, where, kernel):
    """A model evaluated before offload.initialize (its 4-bit weights repacked in place) is taken as bitsandbytes
    holds it, unpacked by bitsandbytes' own inverse (what its state_dict() saves), and trains to the losses of
    the plain model so unpacked; its evaluation then equals that plain model's."""
    model = qlora(base_dir, "nf4-dq")
    repack_on(model, kernel)
    model.eval()
    with torch.no_grad():
        model(input_ids=batches(1)[0])
    assert packed_layers(model) == 14
    reference = copy.deepcopy(model)
    reference.state_dict()  # bitsandbytes unpacks each layer in place as it saves
    assert packed_layers(reference) == 0
    reference.train()
    data, ids = batches(1) * 3, batches(2)[1]
    expected = plain_losses(reference, data)
    model.train()
    with offload.initialize(model, config=config(tmp_path, where)) as engine:
        assert train(engine, data) == pytest.approx(expected, rel=1e-6)
        assert expected[-1] < expected[0]
        torch.testing.assert_close(engine_eval(model, engine, ids), plain_eval(reference, ids), rtol=0, atol=1e-6)


@pytest.mark.parametrize("quant,where", [("nf4-dq", "nvme"), pytest.param("nf4-dq", "hbm", marks=SLOW),
                                         ("int8", "dram")])
def test_keep_weights_hands_back_a_qlora_model_that_runs_and_saves_in_plain_pytorch(tmp_path, base_dir, quant,
                                                                                     where):
    """close(keep_weights=True): the records bound to their bytes as bitsandbytes stores them, the adapters in the
    compute dtype; the plain model gives the engine's last logits in both modes, bit for bit, and saves."""
    model = qlora(base_dir, quant)
    if quant != "int8":
        repack_on(model, "forced")  # its eval mode then repacks in plain PyTorch, as the engine's did
    ids = batches(2)[1]
    with offload.initialize(model, config=config(tmp_path, where)) as engine:
        train(engine, batches(2))
        with torch.no_grad():
            trained = engine(input_ids=ids).logits
        evaluated = engine_eval(model, engine, ids)
        stored = stored_records(engine)
        engine.close(keep_weights=True)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, trained)
    assert torch.equal(plain_eval(model, ids), evaluated)
    now = packed_bytes(model)
    assert sorted(now) == sorted(stored) and all(torch.equal(now[n], stored[n]) for n in stored)
    model.save_pretrained(tmp_path / "adapter")  # peft's own save, the engine gone
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=transformers.BitsAndBytesConfig(
        **QUANT[quant]), dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).train()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained)
