"""Where users already are: DeepSpeed JSON configs read into our Config (deepspeed.py: standard library
and offload.plan.settings only, so the plan's Config.from_deepspeed and --deepspeed read through it), Hugging Face model directories read
and written as safetensors (hf_io.py), Hugging Face's Trainer (transformers.py), TRL's trainers on it
(trl.py) and Accelerate (accelerate.py). The core never imports the last three; a module here that needs
an optional package imports it itself."""
