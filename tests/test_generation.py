"""generate() through the engine (issue 51, [Note: generation] in offload.step.generation): each unit streamed once
per forward on a trace of its own, prefetched ahead, the training trace untouched; the KV cache charged to hbm and
refused naming the largest batch that fits; units that fit beside it kept for the whole call and the next; a dram
home read in place on the CPU backend; the tokens always the plain model's."""

import copy
import logging

import pytest
import torch

import offload
from offload.scheduler.trace import CyclicTrace
from offload.step.generation import kv_bytes

transformers = pytest.importorskip("transformers")

VOCAB = 300


def llama(frozen: bool = False):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))
    return model.requires_grad_(not frozen)


def config(tmp_path, place="nvme", **extra):
    return {"precision": "fp32", "offload_param": {"device": place}, "offload_optimizer": {"device": "cpu"},
            "nvme_path": str(tmp_path / "swap"), "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.0},
            "units": {"min_numel": 8192}, **extra}  # a unit a layer, the embedding and the head


def prompts(batch: int = 2, length: int = 6):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(batch))


def generate(model, x, new: int = 5):
    return model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)


def streamed(eng) -> int:
    return sum(w.nbytes for w in eng.weights if w is not None and w.home != "hbm")


def nvme_read(eng) -> int:
    return eng.stats()["links"]["nvme_to_dram"]["bytes"]


def hbm_plan(tmp_path) -> tuple[int, list[int], int]:
    """(hbm bytes used once the engine is built, the streamed units' bytes largest first, prefetch_units) of a
    frozen llama() on nvme."""
    with offload.initialize(llama(frozen=True), config(tmp_path)) as eng:
        sizes = sorted((w.nbytes for w in eng.weights if w.home != "hbm"), reverse=True)
        return eng.rt.tiers.acct["hbm"].used_bytes, sizes, eng.placement.knobs.prefetch_units


def kv(batch: int, tokens: int) -> int:
    return kv_bytes(llama().config, batch, tokens, 4)


def tight_budget(tmp_path, x, new: int) -> int:
    """The hbm budget that holds the KV cache of generating `new` tokens after `x` and the units in flight, and
    nothing more (no unit kept)."""
    used, sizes, ahead = hbm_plan(tmp_path)
    return used + kv(x.shape[0], x.shape[1] + new) + sum(sizes[:ahead + 1])


def test_the_cyclic_trace_runs_on_into_the_next_step():
    trace = CyclicTrace(lookahead=2)
    for _ in range(2):
        trace.begin_step()
        for u in (0, 1, 2, 3):
            trace.observe(u)
        trace.end_step()
    trace.begin_step()
    assert trace.observe(0) == [1, 2]
    assert trace.observe(1) == [2, 3]
    assert trace.observe(2) == [3, 0]  # the next forward's first unit, fetched during this one's last
    assert trace.next_use_distance(3) == 0 and trace.next_use_distance(1) == 2  # 3, 0, then 1
    assert trace.observe(3) == [0, 1]


def test_each_unit_streams_once_a_forward_prefetched_and_the_tokens_are_the_plain_models(tmp_path):
    """With no hbm to spare (the budget holds the KV cache and the units in flight), every forward of generate()
    reads every streamed unit once from nvme, most of them fetched ahead of their use, and no unit is kept."""
    x, new = prompts(), 5
    budget = tight_budget(tmp_path, x, new)
    plain = llama().eval()
    with offload.initialize(llama(frozen=True), {**config(tmp_path), "budgets": {"hbm_bytes": budget}}) as eng:
        eng.eval()
        ahead = []
        training_policy = eng.prefetcher.policy
        generate(eng.module, x, 1)  # records the generation trace
        read = nvme_read(eng)
        original = type(eng.prefetcher.policy).before_use

        def spy(policy, unit, room, backward=False):
            got = original(policy, unit, room, backward)
            ahead.extend(got)
            assert policy.reuse_bytes == 0
            return got

        type(eng.prefetcher.policy).before_use = spy
        try:
            got = generate(eng.module, x, new)
        finally:
            type(eng.prefetcher.policy).before_use = original
        # the prefill and new - 1 decode steps: one read each; and the last step's look ahead into a next one
        trace = eng.pipeline.generation_trace
        wasted = sum(eng.weights[u].nbytes for u in trace.recorded[:trace.lookahead])
        assert trace.lookahead == 2 and nvme_read(eng) - read == new * streamed(eng) + wasted
        assert len(ahead) >= (new - 1) * (len(eng.units) - 2)
        assert eng.prefetcher.policy is training_policy  # set aside during the call, back after
    assert torch.equal(got, generate(plain, x, new))


def test_units_that_fit_the_budget_stay_resident_for_the_whole_call(tmp_path):
    """With hbm to spare (the default budget on the CPU backend: the machine's memory), a generate() reads each
    unit once, however many tokens it makes; a budget between keeps some and streams the rest."""
    x, new = prompts(), 6
    plain = llama().eval()
    with offload.initialize(llama(), config(tmp_path)) as eng:
        eng.eval()
        read = nvme_read(eng)
        got = generate(eng.module, x, new)
        assert nvme_read(eng) - read == streamed(eng)
    assert torch.equal(got, generate(plain, x, new))
    budget = tight_budget(tmp_path, x, new)
    between = {**config(tmp_path), "budgets": {"hbm_bytes": budget + streamed(eng) // 2}}
    with offload.initialize(llama(frozen=True), between) as eng:
        eng.eval()
        generate(eng.module, x, 2)
        read = nvme_read(eng)
        assert torch.equal(generate(eng.module, x, new), got)
        per_call = nvme_read(eng) - read
    assert streamed(eng) < per_call < new * streamed(eng)


def test_the_units_kept_stay_fetched_for_the_next_call_until_anything_else_runs(tmp_path):
    """A generate() after another reads none of the units the first kept (they stay charged to hbm); a batch
    whose KV cache needs their room releases them rather than being refused; a forward releases them first;
    weights loaded between two calls are the ones the second generates with."""
    x, new = prompts(), 6
    _, sizes, _ = hbm_plan(tmp_path)
    with offload.initialize(llama(), config(tmp_path)) as eng:
        eng.eval()
        used = eng.rt.tiers.acct["hbm"].used_bytes
        got = generate(eng.module, x, new)
        carried = eng.prefetcher.carried
        assert sum(carried.values()) == streamed(eng)  # the default budget keeps every unit
        assert {eng.weights[u].state.value for u in carried} == {"hbm"}
        assert eng.rt.tiers.acct["hbm"].used_bytes == used + streamed(eng)
        read = nvme_read(eng)
        assert torch.equal(generate(eng.module, x, new), got)
        assert nvme_read(eng) == read
        with torch.no_grad():
            eng(input_ids=x)  # an eval forward: its room is its own
        assert not eng.prefetcher.carried
    budget = tight_budget(tmp_path, x, new) + streamed(eng) - sizes[-1]  # all kept but the smallest unit
    with offload.initialize(llama(frozen=True), {**config(tmp_path), "budgets": {"hbm_bytes": budget}}) as eng:
        eng.eval()
        generate(eng.module, x, new)
        assert eng.prefetcher.carried
        wide = prompts(64)  # a KV cache larger than the room beside the carried units: theirs too
        assert torch.equal(generate(eng.module, wide, new), generate(llama().eval(), wide, new))
    other = llama()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    with offload.initialize(llama(), config(tmp_path)) as eng:
        eng.eval()
        generate(eng.module, x, new)
        eng.load_state_dict(other.state_dict())
        assert torch.equal(generate(eng.module, x, new), generate(other.eval(), x, new))


def test_a_dram_home_is_read_in_place_on_the_cpu_backend(tmp_path):
    x, new = prompts(), 5
    plain = llama().eval()
    with offload.initialize(llama(), config(tmp_path, "cpu")) as eng:
        eng.eval()
        moved = eng.stats()["links"]["dram_to_hbm"]["bytes"]
        got = generate(eng.module, x, new)
        assert eng.stats()["links"]["dram_to_hbm"]["bytes"] == moved
        assert {w.state.value for w in eng.weights if w.home != "hbm"} == {"dram"}
        assert not any(w.in_place for w in eng.weights)
        eng.train()
        loss = eng(input_ids=x, labels=x).loss  # training fetches copies again
        assert eng.stats()["links"]["dram_to_hbm"]["bytes"] > moved
        eng.backward(loss)
        eng.step()
    assert torch.equal(got, generate(plain, x, new))


@pytest.mark.parametrize("extra", [{}, {"delayed_update": True}], ids=["plain", "delayed_update"])
def test_generate_between_steps_leaves_the_training_trace_and_sees_each_steps_weights(tmp_path, caplog, extra):
    """The training trace is neither observed nor re-recorded by generate(): no divergence warning in the steps
    after, and the recorded order is the same object; generate() after step() gives the plain model's tokens
    after the same step (delayed_update: the update is applied first)."""
    x = prompts(2, 12)
    ref = llama()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    with caplog.at_level(logging.WARNING, logger="offload"), \
            offload.initialize(llama(), config(tmp_path, **extra)) as eng:
        for step in range(3):
            eng.train()
            ref.train()
            loss = eng(input_ids=x, labels=x).loss
            eng.backward(loss)
            eng.step()
            ref(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            recorded = eng.pipeline.trace.recorded
            eng.eval()
            ref.eval()
            assert torch.equal(generate(eng.module, x[:, :6]), generate(ref, x[:, :6])), step
            assert eng.pipeline.trace.recorded is recorded
    assert "differs from the recorded trace" not in caplog.text


def test_a_kv_cache_that_does_not_fit_is_refused_naming_the_largest_batch(tmp_path):
    x, new = prompts(4), 10
    used, sizes, _ = hbm_plan(tmp_path)
    budget = used + sizes[0] + kv(2, 16) + kv(1, 16) // 2  # beside the largest unit: two sequences' KV cache, not three
    with offload.initialize(llama(frozen=True), {**config(tmp_path), "budgets": {"hbm_bytes": budget}}) as eng:
        eng.eval()
        used = eng.rt.tiers.acct["hbm"].used_bytes
        with pytest.raises(ValueError, match="batch of 4 sequences x 16 tokens needs a KV cache.*the largest batch "
                                             "that fits is 2"):
            generate(eng.module, x, new)
        assert eng.rt.tiers.acct["hbm"].used_bytes == used
        assert generate(eng.module, x[:2], new).shape == (2, 16)  # the batch it named runs
        assert eng.rt.tiers.acct["hbm"].used_bytes == used  # the KV cache's charge refunded
        with pytest.raises(ValueError, match="positions, but the model has 64.*lower max_new_tokens"):
            generate(eng.module, prompts(1, 60), 8)


def test_a_peft_model_generates_through_the_engine(tmp_path):
    peft = pytest.importorskip("peft")
    x, new = prompts(), 5
    base = llama()
    plain = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with offload.initialize(model, config(tmp_path)) as eng:
        eng.eval()
        read = nvme_read(eng)
        generate(eng.module, x, 2)
        assert nvme_read(eng) - read == streamed(eng)  # through the session: kept for the call
        got = generate(eng.module, x, new)
        assert nvme_read(eng) - read == streamed(eng)  # and for the next one
    plain.eval()
    assert torch.equal(got, generate(plain, x, new))


def test_kv_bytes_is_the_size_of_transformers_cache():
    """kv_bytes by formula equals the bytes of the cache generate() builds (the last token is never fed back)."""
    model, x, new = llama().eval(), prompts(3, 7), 5
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    cache = out.past_key_values
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert len(tensors) == 6
    assert sum(t.numel() * t.element_size() for t in tensors) == kv_bytes(model.config, 3, 7 + new - 1, 4)


def test_the_heads_sliced_input_is_made_dense_on_the_cpu(tmp_path):
    """transformers feeds lm_head the last positions, a slice whose strides are not dense (with a head that does
    not require grad torch's bf16 CPU linear materializes the weight per sequence for it: [Note: the prefill's
    last positions]): from init to close the engine's head gets it dense, in generate() at batches 4 and 1 and
    in forwards with logits_to_keep, with and without grad; in bf16 at batch 4 the tokens are the in-memory
    model's with the same hook (contiguous_head)."""
    from offload.step.generation import contiguous_head, dense_strides

    x, new, seen = prompts(4), 4, []
    dense = lambda m, args, out: seen.append(args[0].stride() == dense_strides(args[0].shape))  # noqa: E731
    plain = llama().eval().to(torch.bfloat16)
    contiguous_head(plain)
    probe = llama().eval().to(torch.bfloat16)  # stock: the slice the hook is for
    probe.get_output_embeddings().register_forward_hook(dense)
    generate(probe, x, 1)
    generate(probe, x[:1], 1)  # at batch 1 torch calls the slice contiguous: its strides are not dense either
    assert seen == [False, False]
    model = llama()
    head = model.get_output_embeddings()
    head.register_forward_hook(dense)
    with offload.initialize(model, {**config(tmp_path), "precision": "bf16"}) as eng:
        assert [h.__name__ for h in head._forward_pre_hooks.values()].count("contiguous") == 1
        seen.clear()
        got = generate(eng.module, x, new)
        generate(eng.module, x[:1], 1)
        assert len(seen) == new + 1 and all(seen)
        seen.clear()
        with torch.no_grad():
            eng.module(input_ids=x, logits_to_keep=3)
        eng.backward(eng(input_ids=x, logits_to_keep=3).logits.float().sum())
        assert seen == [True, True]
    assert torch.equal(got, generate(plain, x, new))
    assert "contiguous" not in [h.__name__ for h in head._forward_pre_hooks.values()]  # close() took it off
