"""TRL's SFTTrainer and DPOTrainer through the offload engine: `OffloadSFTTrainer`, `OffloadDPOTrainer`.

    args = DPOConfig(output_dir, learning_rate=5e-7, gradient_accumulation_steps=4, bf16=True)
    trainer = OffloadDPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=pairs,
                                processing_class=tokenizer, offload_config={
        "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}, "nvme_path": "/mnt/nvme"})
    trainer.train(); trainer.save_model(out_dir); trainer.close()

Each is `class X(OffloadTrainer, TRLTrainer)` ([Note: another Trainer's subclass] in transformers.py): TRL
keeps its datasets, collators, losses, metrics and PEFT handling; OffloadTrainer's hooks run the model on
the engine, as under Trainer. The same two-base class puts TRL's other trainers on the engine; these two
are the tested ones (tests/test_trl.py).
"""

from __future__ import annotations

import trl
from trl import DPOTrainer, SFTTrainer

from offload.integrations.transformers import OffloadTrainer

# [Note: DPO's reference model]
# - A PEFT policy (peft_config=, or a PeftModel): TRL's reference is the policy with its adapters disabled,
#   run under no_grad through the policy's own engine, whose frozen base is already streamed: nothing extra.
# - Otherwise the reference is a second model (ref_model=, or the one TRL loads from the policy's
#   directory), which TRL places with accelerator.prepare_model(evaluation_mode=True). OffloadTrainer runs
#   it on an engine of its own, frozen ([Note: frozen models beside the trained one] in transformers.py):
#   its weights placed as the policy's and streamed unit by unit for its forward, with no optimizer state,
#   gradient or step, so the two models never need to fit in memory at once.
# Refused: sync_ref_model (TRL would write the policy's weights into the reference's parameters, whose
# values live in the engine's tiers) and precompute_ref_log_probs without a ref_model (TRL would run the
# policy for them before the engine wraps it).

if tuple(int(x) for x in trl.__version__.split(".")[:2]) < (1, 16):  # the version tested (tests/test_trl.py)
    raise ImportError(f"offload.integrations.trl needs trl 1.16 or later (found {trl.__version__}); "
                      "pip install -U 'trl>=1.16'")


class OffloadSFTTrainer(OffloadTrainer, SFTTrainer):
    """trl.SFTTrainer training through an offload Engine; takes SFTTrainer's arguments and offload_config
    (as OffloadTrainer). Call close() at the end."""


class OffloadDPOTrainer(OffloadTrainer, DPOTrainer):
    """trl.DPOTrainer training through an offload Engine, its separate reference model on a frozen engine
    of its own (module note); takes DPOTrainer's arguments and offload_config. Call close() at the end."""

    def __init__(self, model, ref_model=None, args=None, *rest, offload_config=None, **kwargs):
        _refuse_unsupported(args, ref_model)
        super().__init__(model, ref_model, args, *rest, offload_config=offload_config, **kwargs)


def _refuse_unsupported(args, ref_model) -> None:
    if args is None:
        return  # DPOConfig's defaults
    checks = [
        (args.sync_ref_model, "sync_ref_model=True: TRL would write the policy's weights into the reference "
         "model's parameters, whose values live in the offload engine's tiers; set it False"),
        (args.precompute_ref_log_probs and ref_model is None, "precompute_ref_log_probs=True without ref_model: "
         "TRL would compute them with the policy model before the offload engine wraps it (the whole model in "
         "memory); pass ref_model= (it runs on an engine of its own) or set it False"),
    ]
    problems = [why for failed, why in checks if failed]
    if problems:
        raise ValueError("OffloadDPOTrainer: " + "\n  ".join(problems))
