"""Hugging Face pieces of the training tests (tests/test_train_hf.py, tests/test_train_lora.py,
tests/test_save_dtype.py, tests/test_qlora.py): a tiny Llama, a small BPE tokenizer, a probe batch and a spy
on the recipe's saves. transformers is imported where it is used: a test module skips without it first."""

import os

import torch

from offload import train as training


def tiny_llama(tied: bool):
    """A 2-layer Llama (hidden 64, vocabulary 260) from seed 0; `tied`: the head is the input embedding."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied, rope_theta=10000.0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def save_tokenizer(directory, text: str):
    """A 200-token byte-level BPE tokenizer trained on `text`, saved into `directory`; returned."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(directory)
    return fast


def probe():
    """A fixed batch of token ids (2 x 12, below 200: every tokenizer's vocabulary here)."""
    return torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(7))


def spy_on_saves(monkeypatch) -> dict:
    """Wraps training.save: before the first save, the engine's full state and its logits on the probe batch."""
    seen, real = {}, training.save

    def save(engine, info, directory, lora=None, merged=False, **kw):
        if "state" not in seen:
            seen["state"] = engine.full_state_dict()
            seen["units"] = [[s.name for s in u.slots] for u in engine.units]
            engine.eval()
            with torch.no_grad():
                out = engine(probe())
            seen["logits"] = out if isinstance(out, torch.Tensor) else out.logits
        return real(engine, info, directory, lora, merged, **kw)

    monkeypatch.setattr(training, "save", save)
    return seen


EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "data")  # the bundled SFT examples
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer(directory=None, template: bool = True):
    """A byte-level BPE tokenizer: with the ChatML template (EOS <|im_end|>), or without a template and
    starting every text with BOS <s> as Llama's does (EOS </s>)."""
    import transformers
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = "What is the capital of France? Paris. Hello there, how are you? system user assistant " * 20
    special = ["<unk>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if not template:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
        return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                    eos_token="</s>")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    fast.chat_template = CHATML
    if directory is not None:
        fast.save_pretrained(directory)
    return fast


def save_chat_llama(directory):
    """A 2-layer Llama (hidden 32, 128 positions) from seed 0 saved into `directory` with chat_tokenizer's
    ChatML tokenizer, whose EOS it ends with; the tokenizer is returned."""
    import transformers

    tok = chat_tokenizer(directory)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return tok
