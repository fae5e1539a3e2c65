"""Hugging Face Trainer through the offload engine: `OffloadTrainer`, a transformers.Trainer subclass.

    args = TrainingArguments(output_dir, learning_rate=3e-4, warmup_steps=10, gradient_accumulation_steps=2,
                             bf16=True, save_strategy="no")
    trainer = OffloadTrainer(model=model, args=args, train_dataset=ds, offload_config={
        "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}, "nvme_path": "/mnt/nvme"})
    trainer.train(); trainer.save_model(out_dir); trainer.close()

Everything else of Trainer stays as it is (data loading, the LR scheduler, logging, evaluation, callbacks).
TrainingArguments own the learning rate and its schedule, Adam's betas/eps, weight decay, gradient
accumulation, max_grad_norm and bf16/fp16; the offload config says where states live (and may be a
DeepSpeed JSON config; offload/integrations/common.py says how the two meet).
"""

from __future__ import annotations

import os
import warnings

import torch
import transformers
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME

from offload import handback
from offload.checkpoint import format as checkpoint_format
from offload.integrations import common
from offload.integrations.accelerate import EngineOptimizer, route

# [Note: where Trainer meets the engine]
# Each hook is a method Trainer documents for subclassing or calls at one place:
# - __init__: the engine is built over the model; Trainer's move of the whole model to the device is
#   skipped (_move_model_to_device): the engine places each weight in its tier.
# - _wrap_model: the model Trainer calls in training, evaluation and prediction is the engine. Accelerate
#   never prepares it: Trainer prepares only a model that _wrap_model returned as is.
# - create_optimizer: an EngineOptimizer (offload/integrations/accelerate.py). Trainer's create_scheduler
#   builds its LR scheduler over it as over any optimizer; the lr reaches the engine at every backward.
# - accelerator.backward, which Trainer.training_step calls, goes to engine.backward (accelerate.route).
#   Trainer's loss is already divided for gradient accumulation (by the window's item count, or the step
#   count) and its Accelerator counts one step; the engine divides by gradient_accumulation_steps itself,
#   so the route multiplies by it: the gradients are Trainer's.
# - _clip_grad_norm, _get_grad_norm: the engine clips in its step (gradient_clipping = max_grad_norm); the
#   logged grad_norm is the engine's, known after that step (_maybe_log_save_evaluate).
# - create_accelerator_and_postprocess: a model other than the trained one that the trainer prepares for
#   evaluation (accelerator.prepare_model(m, evaluation_mode=True): TRL's DPO reference model) is frozen
#   and run on an engine of its own ([Note: frozen models beside the trained one]).
# - _save (save_model): HF weights from the engine's fp32 masters in the model's dtype, streamed; a PEFT
#   model's adapter alone (adapter_config.json + adapter_model.safetensors, as the stock Trainer writes it),
#   read from the trainable parameters' masters without touching the frozen base.
# - Checkpoints (save_steps): Trainer's _save_checkpoint writes checkpoint-N as always (trainer_state.json,
#   scheduler.pt, rng_state.pth, rotation by save_total_limit), but the weights and optimizer.pt are the
#   engine's checkpoint in that folder (engine.save_checkpoint: every state from its tier, the step count,
#   loss scale, a delayed update as it is; in the background unless save_blocking=True, finished by the
#   next save, close(), or at the latest when the process exits), written by _save_optimizer_and_scheduler; save_model writes no
#   weights there. resume_from_checkpoint: _load_from_checkpoint loads the engine checkpoint,
#   _load_optimizer_and_scheduler the scheduler, and Trainer skips the batches already seen and restores
#   its RNG. save_only_model=True keeps Trainer's weights-only checkpoints (they do not resume).
#
# [Note: another Trainer's subclass]
# A Trainer subclass (TRL's SFTTrainer, DPOTrainer) goes under the engine as `class X(OffloadTrainer,
# SFTTrainer)`: OffloadTrainer first, so its hooks override that trainer's, and its __init__ takes
# offload_config before the other's __init__ sees the rest (offload/integrations/trl.py). The other order
# is refused when the class is defined (__init_subclass__), where it would fail later on offload_config.
#
# [Note: frozen models beside the trained one]
# Trainers that keep a frozen model beside the trained one (TRL's DPO reference model) place it with
# accelerator.prepare_model(model, evaluation_mode=True), which would move it whole to the device. Here that
# call returns an engine of its own over it (Trainer's accelerator is ours: its prepare_model is replaced on
# that object, as route() replaces backward): the model's parameters are frozen, its weights placed as the
# trained model's (the same offload config) and streamed unit by unit for each forward, with no optimizer
# state, gradient or step; each forward is that engine's whole step (offload.step.pipeline, [Note: phases]). The
# trainer calls it as it called the model; close() closes it.

if int(transformers.__version__.split(".")[0]) < 5:  # the hooks below are Trainer 5's methods
    raise ImportError(f"offload.integrations.transformers needs transformers 5 or later (found "
                      f"{transformers.__version__}); pip install -U 'transformers>=5'")

ADAMW = ("adamw_torch", "adamw_torch_fused")  # torch's AdamW: the update the engine's CPU Adam computes


class OffloadTrainer(Trainer):
    """transformers.Trainer training through an offload Engine. offload_config: an offload.Config, a dict,
    the path of a .json/.yaml config, or a DeepSpeed JSON config (a path or a dict). Call close() at the
    end: it removes the swap files and frees pinned memory."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        before = [c for c in mro[1:mro.index(OffloadTrainer)] if issubclass(c, Trainer)
                  and not issubclass(c, OffloadTrainer)]
        if before:  # [Note: another Trainer's subclass]
            bases = ", ".join(b.__name__ for b in cls.__bases__)
            raise TypeError(f"class {cls.__name__}({bases}): OffloadTrainer must come before {before[0].__name__} "
                            f"among the bases, so that its hooks override that trainer's; write class "
                            f"{cls.__name__}(OffloadTrainer, {before[0].__name__})")

    def __init__(self, *args, offload_config=None, save_blocking: bool = False, **kwargs):
        self.engine = None
        self.frozen_engines = []  # [Note: frozen models beside the trained one]
        self._save_blocking = save_blocking  # save_steps' engine checkpoints: else in the background
        self._offload_settings = common.settings(offload_config)
        self._precision_said = False
        self._weights_in_engine_checkpoint = False  # True while _save_checkpoint writes an engine checkpoint
        try:
            super().__init__(*args, **kwargs)
            _refuse_unsupported(self)
            if self.args.weight_decay > 0:
                warnings.warn(f"OffloadTrainer: weight_decay={self.args.weight_decay} applies to every parameter, "
                              "biases and norm weights included (Trainer's own optimizer exempts those; the engine "
                              "has one weight decay)", stacklevel=2)
            # save_model writes the dtype the model came in (the engine's placeholders have the compute dtype)
            self.save_dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()),
                                   torch.float32)
            import offload

            self.engine = offload.initialize(self.model, config=self._engine_config())
        except BaseException:
            self.close()  # a frozen model's engine built before the error
            raise
        self.model_wrapped = self.engine

    def _engine_config(self):
        """The Config of every engine this trainer builds (the trained model's and the frozen ones')."""
        if not self._precision_said:  # before the first engine's own line (a frozen one's, under DPOTrainer)
            self._precision_said = True
            _warn_slow_precision(self.args)
        return common.with_owned(self._offload_settings, trainer_settings(self.args), owner="Trainer",
                                 lr_from="TrainingArguments' learning_rate, lr_scheduler_type and warmup")

    def close(self, keep_weights: bool = False) -> None:
        """Closes the engines (the trained model's and the frozen ones'): removes their swap files and frees
        their memory. The trainer trains no further. keep_weights: each model gets its weights back first
        and runs in plain PyTorch (Engine.close; refused, nothing freed, when they do not fit in RAM)."""
        engines = [e for e in [self.engine, *self.frozen_engines] if e is not None]
        if keep_weights:
            handback.check_room(engines)  # all of them at once, before any is freed
        for engine in engines:
            engine.close(keep_weights=keep_weights)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        prepare_model = self.accelerator.prepare_model

        def prepare(model, device_placement=None, evaluation_mode=False):
            if evaluation_mode and model is not self.model:  # [Note: frozen models beside the trained one]
                return self._frozen_engine(model)
            return prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

        self.accelerator.prepare_model = prepare

    def _frozen_engine(self, model):
        """`model` frozen (requires_grad=False) on an engine of its own, placed by this trainer's config."""
        import offload

        model.requires_grad_(False)
        engine = offload.initialize(model, config=self._engine_config())
        self.frozen_engines.append(engine)
        return engine

    # -- the hooks (module note) -------------------------------------------------------------------------
    def _move_model_to_device(self, model, device):
        pass  # the engine places each weight in its tier; moving the whole model would defeat the offload

    def _wrap_model(self, model, training=True, dataloader=None):
        return self.engine

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = EngineOptimizer(self.engine)
            route(self.accelerator, self.optimizer)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if torch.is_tensor(num_items_in_batch):
            # a count as a float tensor: the engine casts floating inputs to its compute dtype, and bf16
            # rounds counts above 256. A number passes as it is.
            num_items_in_batch = num_items_in_batch.item()
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def _clip_grad_norm(self, model):
        return None  # the engine clips in its step, at gradient_clipping = max_grad_norm

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # known after the engine's step: see _maybe_log_save_evaluate

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        # None when the engine stepped during backward (overlap_step: no clipping), which computes no norm
        return super()._maybe_log_save_evaluate(tr_loss, self.engine.last_grad_norm, *args, **kwargs)

    def set_initial_training_values(self, args, dataloader):
        values = super().set_initial_training_values(args, dataloader)
        _, per_epoch, _, _, _, batches, max_steps = values
        gas = args.gradient_accumulation_steps
        if batches % gas and max_steps >= per_epoch:
            raise ValueError(f"gradient_accumulation_steps={gas}: an epoch has {batches} batches, so Trainer would "
                             f"step its last window after {batches % gas}; the engine steps full windows only. Use "
                             f"a batch count per epoch that {gas} divides, or max_steps below {per_epoch}")
        return values

    # -- checkpoints (module note) -------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        self._weights_in_engine_checkpoint = not self.args.save_only_model
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._weights_in_engine_checkpoint = False

    def save_model(self, output_dir=None, _internal_call=False):
        if self._weights_in_engine_checkpoint:
            return  # inside a checkpoint: the engine's checkpoint holds the weights (_save_optimizer_and_scheduler)
        super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir):
        """The engine's checkpoint in place of optimizer.pt (and of the weights), then Trainer's scheduler.pt."""
        name, again = f"step{self.state.global_step:08d}", 0
        while os.path.lexists(os.path.join(output_dir, name)):  # an earlier run's in this folder: kept (keep=1 prunes this run's only)
            again += 1
            name = f"step{self.state.global_step:08d}-{again}"
        background = not (self._save_blocking or self.engine.cfg.delayed_update)  # its pending update: blocking
        self.engine.save_checkpoint(output_dir, name=name, keep=1, background=background)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """The engine checkpoint in Trainer's checkpoint-N: weights, optimizer states, counters, RNG."""
        if not os.path.isfile(os.path.join(resume_from_checkpoint, checkpoint_format.LATEST)):
            raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r}: holds no offload engine checkpoint "
                             f"(no {checkpoint_format.LATEST!r}); resume from a checkpoint OffloadTrainer saved "
                             "without save_only_model (weights-only checkpoints do not resume: from_pretrained loads "
                             "them)")
        self.engine.load_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """The optimizer's states came with the engine checkpoint (_load_from_checkpoint); the scheduler here."""
        if checkpoint is None:
            return
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        # what optimizer.load_state_dict would restore: the lr the scheduler set last, pushed at the next backward
        for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
            group["lr"] = lr

    def _save(self, output_dir=None, state_dict=None):
        """Trainer's save: the engine's fp32 masters in the model's dtype, streamed one shard at a time (a
        model larger than RAM can be saved), config.json saying that dtype, then the generation config,
        the processing class and training_args.bin as Trainer writes them."""
        from offload.integrations.hf_io import save_hf_directory

        if not self.args.should_save:
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.engine.flush()  # delayed_update: the last accepted update is not in the weights before this
        dtype = self.save_dtype
        if hasattr(self.model, "peft_config"):  # the adapter, as the stock Trainer saves a PEFT model
            adapter = {n: t.to(dtype) for n, t in self.engine.trainable_state_dict().items()}
            self.model.save_pretrained(output_dir, state_dict=adapter)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
            return
        config = self.model.config.to_dict() if hasattr(self.model, "config") else {}  # a plain nn.Module: none
        config["dtype"] = str(dtype).removeprefix("torch.")
        save_hf_directory(((n, t.to(dtype)) for n, t in self.engine.state_items()), config, output_dir)
        if getattr(self.model, "generation_config", None) is not None and self.model.can_generate():
            self.model.generation_config.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))  # as Trainer's TRAINING_ARGS_NAME


def trainer_settings(args) -> dict:
    """The Config keys TrainingArguments own: {key: (value, where it is set)} (common.with_owned)."""
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    return {
        "optimizer.type": ("adamw", f"optim={_name(args.optim)!r}"),
        "optimizer.lr": (args.learning_rate, f"learning_rate={args.learning_rate}"),
        "optimizer.betas": ((args.adam_beta1, args.adam_beta2), f"adam_beta1={args.adam_beta1}, "
                            f"adam_beta2={args.adam_beta2}"),
        "optimizer.eps": (args.adam_epsilon, f"adam_epsilon={args.adam_epsilon}"),
        "optimizer.weight_decay": (args.weight_decay, f"weight_decay={args.weight_decay}"),
        "gradient_accumulation_steps": (args.gradient_accumulation_steps,
                                        f"gradient_accumulation_steps={args.gradient_accumulation_steps}"),
        "gradient_clipping": (max(float(args.max_grad_norm or 0), 0.0), f"max_grad_norm={args.max_grad_norm}"),
        "precision": (precision, f"bf16={args.bf16}, fp16={args.fp16}"),
    }


def _warn_slow_precision(args) -> None:
    """bf16/fp16 of TrainingArguments where this device runs it slowly (TRL's SFTConfig and DPOConfig set
    bf16=True by default): one warning that says so and which arguments choose what "auto" would."""
    from offload.plan.precision import resolve_precision

    choice = resolve_precision(trainer_settings(args)["precision"][0])
    if choice.slow:
        use = {"fp32": f"{choice.name}=False", "bf16": "bf16=True, fp16=False",
               "fp16": "fp16=True, bf16=False"}[choice.auto]
        trl_default = choice.name == "bf16" and type(args).__module__.startswith("trl.")  # SFTConfig, DPOConfig
        default = f" ({type(args).__name__}'s default)" if trl_default else ""
        warnings.warn(f"OffloadTrainer: {choice.name}=True{default} is slow on this host: {choice.slow}; set {use} "
                      f"to train in {choice.auto}, what precision \"auto\" picks here")


def _name(value) -> str:
    return getattr(value, "value", value)  # TrainingArguments' enums (SaveStrategy.STEPS) as the user wrote them


def _refuse_unsupported(t: Trainer) -> None:
    """Names every setting the engine cannot honour, rather than training something else than asked."""
    a = t.args
    optim = _name(a.optim)
    checks = [
        (t.is_deepspeed_enabled or a.deepspeed, "deepspeed=...: the offload engine replaces DeepSpeed here; pass "
         "the DeepSpeed JSON as offload_config=PATH (read as Config.from_deepspeed reads it) instead"),
        (t.is_fsdp_enabled or a.fsdp, "fsdp=...: FSDP and the offload engine both own the parameters; use one"),
        (a.torch_compile, "torch_compile=True: not supported with the offload engine (its hooks fetch each "
         "unit's weights around the compiled code); set it False"),
        (a.n_gpu > 1, f"n_gpu={a.n_gpu}: Trainer would wrap the model in DataParallel; the engine trains on one "
         "device: make one GPU visible (CUDA_VISIBLE_DEVICES=0)"),
        (a.world_size > 1, f"world_size={a.world_size}: the engine trains on one process (ZeRO over ranks is not "
         "implemented yet); launch one process"),
        (optim not in ADAMW, f"optim={optim!r}: the engine steps with its own AdamW; use 'adamw_torch' "
         "(the default)"),
        (t.optimizer is not None or t.lr_scheduler is not None or t.optimizer_cls_and_kwargs is not None,
         "optimizers=/optimizer_cls_and_kwargs=: the engine steps with its own AdamW, set by TrainingArguments "
         "(lr_scheduler_type for the schedule); leave them out"),
        (t.model_init is not None, "model_init=: hyperparameter search rebuilds the model per trial, which the "
         "engine does not follow; pass model="),
        (a.auto_find_batch_size, "auto_find_batch_size=True: retrying after an out-of-memory error is not "
         "supported with the offload engine; set the batch size"),
        (a.bf16_full_eval or a.fp16_full_eval, "bf16_full_eval/fp16_full_eval: evaluation runs through the engine "
         "in its own precision (bf16/fp16 of TrainingArguments); leave them False"),
        (a.label_smoothing_factor != 0, f"label_smoothing_factor={a.label_smoothing_factor}: not supported with "
         "the offload engine yet (Trainer would not see a causal LM through it and smooth unshifted labels); "
         "set it 0"),
        (a.load_best_model_at_end, "load_best_model_at_end=True: not implemented with the offload engine yet; "
         "leave it False (`offload checkpoint export CHECKPOINT_DIR OUT` turns the best checkpoint-N into a "
         "directory from_pretrained loads)"),
    ]
    problems = [why for failed, why in checks if failed]
    if problems:
        raise ValueError("OffloadTrainer: " + "\n  ".join(problems))
