"""Generation through the engine: `model.generate()` on a wrapped Hugging Face model streams each unit once per
forward (the prefill, then one decode step a token) on a trace of its own, with the KV cache counted in hbm and
the units that fit beside it kept there for the whole generation, and on for the next one."""

from __future__ import annotations

import weakref

import torch

from offload.scheduler.policy import ResidencyPolicy
from offload.scheduler.trace import CyclicTrace
from offload.state.residency import R

# [Note: generation]
# generate() runs one forward for the prompts (the prefill) and one per new token (a decode step), all under
# no_grad and outside the engine's forward, on the model the engine holds: the unit hooks fetch each unit
# from its tier, as in training. While a generate() runs (GenerationSession), the prefetcher carries out a
# policy of its own over a trace of its own (CyclicTrace): one step of that trace is one forward, and since
# every forward uses the units in the same order, the units due next and a unit's next use run on into the
# next forward: the first units of the next token are fetched while the last ones of this token compute.
# The training trace and policy are set aside untouched (nothing is observed or re-recorded in them) and put
# back after; the generation trace is kept across generate() calls (GRPO's rollouts replay it at once).
# Before the first forward: the weights are brought up to date (flush(): a delayed update, split_step's
# deferred steps), so a generate() after step() sees that step's weights, the one copy training updates;
# everything else kept in hbm (an eval forward's units) is released; the KV cache of the call's batch and
# length is charged to hbm by formula (kv_bytes: 2 x layers x kv heads x head dim x tokens x batch in the
# compute dtype), and refused, naming the largest batch that fits, when it does not fit beside the largest
# streamed unit. What is left of the budget beside the KV cache and the units in flight (the unit in use and
# prefetch_units ahead) keeps units resident (the policy's reuse_bytes): those are fetched once, and the bytes
# streamed per token shrink by theirs. They stay fetched after the call (Prefetcher.carried, still charged to
# hbm) for the next generate(), which reads them no more unless its own KV cache needs their room; anything
# else that runs first releases them: a training or eval forward (Prefetcher.release_carried: its room is
# its own), a step, a load, a failure (every fetched copy is released before a home is updated). With
# partitioned weights (zero_stage 3) nothing is kept: a fetch is a gather every rank must run alike, and the
# ranks' KV caches may differ.
#
# [Note: the prefill's last positions]
# transformers computes the prefill's logits for the last position only: lm_head(hidden[:, -1:, :]), a slice
# whose strides are not a dense tensor's (at batch 1 torch calls it contiguous, strides (T x H, H, 1) all the
# same); TRL's log-probabilities of completions slice the last k positions alike. When the head's weight does
# not require grad (a model for inference, a LoRA base, GRPO's reference), torch's bf16 linear of such a 3-d
# input on the CPU does not fold it into one matrix: it runs a batched matmul over the weight expanded to every
# sequence, materialized: batch x vocab x hidden x 2 bytes, with grad or without (TinyLlama-1.1B: 0.38 s at
# batch 1 against 0.005 s for the same row dense; 4.2 GB more RSS and 12 s at batch 32; torch 2.13). So on the
# CPU backend the engine gives the output embeddings a pre-hook, from init to close (contiguous_head), that
# copies a bf16 input into dense strides (batch x k x hidden values): the matrix product torch folds to when
# the weight requires grad. At batch >= 2 its logits may differ from the batched matmul's by a bf16 rounding.


def kv_bytes(config, batch: int, tokens: int, itemsize: int) -> int | None:
    """Bytes of a KV cache of `batch` sequences of `tokens` (keys and values of every layer), from a transformers
    config; None where the config does not say (no layers or heads)."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    layers, heads = getattr(text, "num_hidden_layers", None), getattr(text, "num_attention_heads", None)
    if not layers or not heads:
        return None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * layers * kv_heads * head_dim * batch * tokens * itemsize


def call_shape(model, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
    """(sequences, prompt tokens, tokens in all) of a generate() call; None where its prompts are not a tensor."""
    x = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    x = kwargs.get("inputs_embeds") if x is None else x
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return None
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)

    def setting(name: str, default):
        value = kwargs.get(name, getattr(gc, name, None))
        return default if value is None else value

    new = setting("max_new_tokens", None)
    tokens = x.shape[1] + new if new is not None else max(setting("max_length", 20), x.shape[1] + 1)
    return x.shape[0] * setting("num_return_sequences", 1) * setting("num_beams", 1), x.shape[1], tokens


def contiguous_head(model) -> list:
    """A forward pre-hook on `model`'s output embeddings that copies a bf16 input whose strides are not dense
    into dense ones ([Note: the prefill's last positions]): its removable handle, in a list; [] where the model
    has no output embeddings."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return []

    def contiguous(module, args):
        x = args[0] if args else None
        if (isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.dim() >= 3
                and x.stride() != dense_strides(x.shape)):
            return (x.clone(memory_format=torch.contiguous_format), *args[1:])
        return None

    return [head.register_forward_pre_hook(contiguous)]


def dense_strides(shape) -> tuple[int, ...]:
    """The strides of a dense row-major tensor of `shape` (size-1 dimensions included)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


class GenerationSession:
    """One generate() call's hold on the engine (module note): enter before its first forward, exit after."""

    def __init__(self, engine, model, shape: tuple[int, int, int] | None):
        self.engine, self.model, self.shape = engine, model, shape
        self.charged, self._hook, self._saved, self._started = 0, None, None, False
        self.streamed: list = []  # the handles of the units fetched from their tier (not hbm, not read in place)

    def __enter__(self) -> "GenerationSession":
        eng = self.engine
        eng.pipeline.check_usable("generate()")
        eng.flush()
        prefetcher = eng.prefetcher
        carried = prefetcher.carried
        prefetcher.release_all(carried)
        self.streamed = [w for w in eng.weights if w is not None and w.home != "hbm" and not w.in_place_ok()]
        kv, room = self._budget(sum(carried.values()))
        acct = eng.rt.tiers.acct["hbm"]
        ahead = sorted((w.nbytes for w in self.streamed), reverse=True)
        in_flight = sum(ahead[:eng.placement.knobs.prefetch_units + 1])
        keep = 0 if eng.placement.weight_owners else max(0, room - kv - in_flight)
        if sum(carried.values()) > keep:  # this call's KV cache needs their room
            prefetcher.release_all()
            carried = {}
        if kv:
            acct.charge(kv, "the KV cache of generate()")
            self.charged = kv
        for w in eng.weights:
            if w is not None and w.in_place_ok():
                w.in_place = True
        trace = eng.pipeline.generation_trace
        self._saved = prefetcher.policy
        prefetcher.policy = ResidencyPolicy(trace, self._saved.nbytes, reuse_distance=0, reuse_bytes=keep,
                                            grad_reserve=0)
        prefetcher.policy.resident.update(carried)  # the last call's units, kept as this call would keep them
        prefetcher.policy.kept.update(carried)
        self._hook = self.model.register_forward_pre_hook(lambda *_: self._next_step(trace))
        return self

    def _next_step(self, trace: CyclicTrace) -> None:
        if self._started:
            trace.end_step()
        trace.begin_step()
        self._started = True

    def __exit__(self, *exc) -> None:
        eng = self.engine
        try:
            if self._hook is not None:
                self._hook.remove()
            if self._started and exc[0] is None:
                eng.prefetcher.policy.trace.end_step()
            elif self._started:
                eng.prefetcher.policy.trace.abandon_step()
        finally:
            policy, weights = eng.prefetcher.policy, eng.weights
            carry = {u: n for u, n in policy.kept.items() if weights[u].state is R.HBM and not weights[u].in_place}
            eng.prefetcher.release_all(carry if exc[0] is None and self._saved is not None else None)
            for w in eng.weights:
                if w is not None:
                    w.in_place = False
            if self._saved is not None:
                eng.prefetcher.policy = self._saved
            if self.charged:
                eng.rt.tiers.acct["hbm"].refund(self.charged)

    def _budget(self, carried: int) -> tuple[int, int]:
        """(KV cache bytes, hbm bytes free once the `carried` bytes of the last call's units are) of this call;
        refuses a call whose tokens exceed the model's positions or whose KV cache does not fit beside the
        largest streamed unit."""
        eng = self.engine
        acct = eng.rt.tiers.acct["hbm"]
        room = acct.budget_bytes - acct.used_bytes + carried
        largest = max((w.nbytes for w in self.streamed), default=0)
        if self.shape is None:
            return 0, room
        batch, prompt, tokens = self.shape
        config = getattr(self.model, "config", None)
        positions = getattr(config, "max_position_embeddings", None)
        if positions and tokens > positions:
            raise ValueError(f"generate(): {prompt} prompt tokens + {tokens - prompt} new tokens = {tokens} positions, "
                             f"but the model has {positions} (max_position_embeddings); shorten the prompts "
                             f"(truncate them to {max(positions - (tokens - prompt), 0)}) or lower max_new_tokens")
        one = kv_bytes(config, 1, tokens, eng.cfg.compute_dtype.itemsize) if config is not None else None
        if not one:
            return 0, room
        if one * batch + largest > room:
            fits = max(0, (room - largest) // one)
            what = (f"the largest batch that fits is {fits}" if fits else
                    f"not even one sequence of {tokens} tokens fits: lower max_new_tokens or shorten the prompts")
            raise ValueError(f"generate(): a batch of {batch} sequences x {tokens} tokens needs a KV cache of "
                             f"{_gib(one * batch)} in hbm beside the largest streamed unit ({_gib(largest)}), "
                             f"but {_gib(room)} of the hbm budget is free; {what} (or raise budgets.hbm_bytes)")
        return one * batch, room


def serve_generate(engine, model):
    """`generate()` on `model` (and on the transformers model a PEFT model wraps) runs in a GenerationSession.
    Returns what puts the model's own generate back."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    targets = [m for m in dict.fromkeys([model, base]) if callable(getattr(m, "generate", None))]
    ref, active = weakref.ref(engine), []
    undo = []
    for target in targets:
        original, own = target.generate, target.__dict__.get("generate")

        def generate(*args, _original=original, **kwargs):
            eng = ref()
            if eng is None or active:
                return _original(*args, **kwargs)
            active.append(True)
            try:
                with GenerationSession(eng, base, call_shape(base, args, kwargs)):
                    return _original(*args, **kwargs)
            finally:
                active.clear()

        generate.__doc__ = original.__doc__
        target.generate = generate
        undo.append((target, own))

    def unserve() -> None:
        for target, own in undo:
            if own is None:
                target.__dict__.pop("generate", None)
            else:
                target.generate = own

    return unserve


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
