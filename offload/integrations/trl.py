"""TRL's SFTTrainer, DPOTrainer and GRPOTrainer through the offload engine: `OffloadSFTTrainer`,
`OffloadDPOTrainer`, `OffloadGRPOTrainer`.

    args = DPOConfig(output_dir, learning_rate=5e-7, gradient_accumulation_steps=4, bf16=True)
    trainer = OffloadDPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=pairs,
                                processing_class=tokenizer, offload_config={
        "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}, "nvme_path": "/mnt/nvme"})
    trainer.train(); trainer.save_model(out_dir); trainer.close()

Each is `class X(OffloadTrainer, TRLTrainer)` ([Note: another Trainer's subclass] in transformers.py): TRL
keeps its datasets, collators, losses, metrics and PEFT handling; OffloadTrainer's hooks run the model on
the engine, as under Trainer. The same two-base class puts TRL's other trainers on the engine; these three
are the tested ones (tests/test_trl.py). GRPO's rollouts: [Note: GRPO's rollouts].
"""

from __future__ import annotations

import trl
from trl import DPOTrainer, GRPOTrainer, SFTTrainer

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

# [Note: GRPO's rollouts]
# GRPOTrainer generates its completions with `generate` on the model its accelerator unwraps from
# model_wrapped, which under OffloadTrainer is the engine. The rollouts go through the model the engine holds
# instead (model_wrapped is the trained model while they run): its forward fetches each unit as training
# does, the weights stay where they live (streamed, a quantized base as stored), and the same copy of them
# serves training and generation, so a rollout after a step sees that step's weights. The reference (beta >
# 0) is as for DPO: the policy with its adapters disabled for a PEFT policy, else a second model on a frozen
# engine of its own. Refused: use_vllm (the rollouts are the engine's), sync_ref_model (as for DPO) and
# transformers' continuous batching (not run through the engine yet).

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


class OffloadGRPOTrainer(OffloadTrainer, GRPOTrainer):
    """trl.GRPOTrainer training through an offload Engine, its rollouts generated through the same engine
    ([Note: GRPO's rollouts]); takes GRPOTrainer's arguments and offload_config. Call close() at the end."""

    def __init__(self, model, reward_funcs, args=None, *rest, offload_config=None, **kwargs):
        _refuse_grpo(args)
        super().__init__(model, reward_funcs, args, *rest, offload_config=offload_config, **kwargs)

    def _generate_single_turn(self, *args, **kwargs):
        wrapped, self.model_wrapped = self.model_wrapped, self.model  # [Note: GRPO's rollouts]
        try:
            return super()._generate_single_turn(*args, **kwargs)
        finally:
            self.model_wrapped = wrapped


def _refuse_grpo(args) -> None:
    if args is None:
        return
    checks = [
        (args.use_vllm, "use_vllm=True: the rollouts are generated through the offload engine, which streams the "
         "weights as training does (a vLLM server or colocated vLLM would need them whole); set it False"),
        (args.sync_ref_model, "sync_ref_model=True: TRL would write the policy's weights into the reference model's "
         "parameters, whose values live in the offload engine's tiers; set it False"),
        (getattr(args, "use_transformers_continuous_batching", False) or getattr(args, "use_transformers_paged", False),
         "use_transformers_continuous_batching=True: not run through the offload engine yet; set it False"),
    ]
    problems = [why for failed, why in checks if failed]
    if problems:
        raise ValueError("OffloadGRPOTrainer: " + "\n  ".join(problems))


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
