"""`offload generate`: a Hugging Face directory with a saved LoRA adapter, the weights on nvme, answers each prompt
as the plain peft model's own greedy generate() does; bad input is one line naming what to change."""

import json

import pytest
import torch

from offload.cli import main
from tests.hf_util import save_chat_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
PROMPTS = ["What is the capital of France?", "Hello"]  # of different lengths: the batch is left-padded


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    model_dir, adapter_dir = root / "llama", root / "adapter"
    tok = save_chat_llama(model_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    tuned = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # adapters that change the answers (peft starts lora_B at zero)
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    tuned.save_pretrained(adapter_dir)
    return model_dir, adapter_dir, tok, tuned.eval()


def expected_answers(model, tok, n: int) -> list[str]:
    out = []
    for p in PROMPTS:
        x = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)
        ids = model.generate(**x, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
        out.append(tok.decode(ids[0, x["input_ids"].shape[1]:], skip_special_tokens=True))
    return out


def test_generate_with_an_adapter_from_nvme_answers_as_peft_in_memory(model_and_adapter, tmp_path, capsys):
    model_dir, adapter_dir, tok, tuned = model_and_adapter
    argv = ["generate", "--model", str(model_dir), "--adapter", str(adapter_dir), "--max-new-tokens", "8",
            "--offload-param", "nvme", "--nvme-path", str(tmp_path / "swap"), "--json"]
    assert main([*argv, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "\r  token 1/8 (" in captured.err  # the progress line, a decode step at a time
    summary = json.loads(out.strip().splitlines()[-1])
    expected = expected_answers(tuned, tok, 8)
    assert [a["answer"] for a in summary["answers"]] == expected and any(expected)
    with tuned.disable_adapter():  # the adapter changed them: it was loaded, not skipped
        assert expected_answers(tuned, tok, 8) != expected
    assert summary["offload_param"] == "nvme" and summary["new_tokens"] > 0 and summary["tokens_per_s"] > 0
    assert f"> {PROMPTS[0]}\n{expected[0]}\n" in out and "tokens/s (weights in nvme" in out


def test_bad_input_is_one_line(model_and_adapter, tmp_path, capsys):
    model_dir, adapter_dir, _, _ = model_and_adapter
    base = ["generate", "--model", str(model_dir), "--prompt", "Hello"]
    assert main([*base, "--max-new-tokens", "200"]) == 2
    assert "exceed the model's 128 positions; shorten the prompt or pass --max-new-tokens" in capsys.readouterr().err
    assert main([*base, "--adapter", str(tmp_path)]) == 2
    assert "no adapter_config.json: pass --adapter a LoRA adapter directory" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["generate", "--model", str(model_dir)])
    assert "one of the arguments --prompt --prompts is required" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--adapter", str(adapter_dir), "--prompt", "Hi"]) == 2
    assert "--adapter" in capsys.readouterr().err
