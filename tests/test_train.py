"""The run `offload.train.train` and its recipe (offload.recipe): settings precedence, a short run's report and
files, --save."""

import argparse
import json
import os

import pytest
import torch

import offload
from offload import recipe
from offload import train as training


def _resolve(**kw):
    return recipe.resolve(recipe.as_namespace(kw))


def test_defaults_are_the_recipe():  # what `offload train` runs with no flags (make demo passes its own)
    cfg, run = _resolve()
    assert (cfg.offload_param.device, cfg.offload_optimizer.device) == ("nvme", "nvme")
    assert cfg.nvme_path == recipe.DEFAULT_SWAP_DIR and cfg.precision == "auto"  # resolved by the engine
    assert cfg.optimizer.lr == recipe.RECIPE["lr"] and cfg.gradient_clipping == recipe.RECIPE["clip"]
    assert cfg.lr_schedule.type == "cosine" and cfg.lr_schedule.total_steps == recipe.RECIPE["steps"]
    assert run == {k: recipe.RECIPE[k] for k in ("model", "steps", "batch_size", "seq_len")} | {
        "data": None, "eval": None, "prompts": None, "lora": None, "save_dtype": "auto"}


def test_flags_beat_the_config_file_which_beats_the_recipe(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("offload_optimizer: {device: cpu}\noptimizer: {lr: 1.0e-4}\ngradient_clipping: 0.5\n")
    cfg, _ = _resolve(offload_config=str(path))
    assert (cfg.offload_param.device, cfg.offload_optimizer.device) == ("none", "cpu")  # file's placement
    assert cfg.optimizer.lr == 1e-4 and cfg.gradient_clipping == 0.5 and cfg.nvme_path == recipe.DEFAULT_SWAP_DIR
    cfg, _ = _resolve(offload_config=str(path), lr=0.02, offload_param="cpu", precision="fp32", steps=7)
    assert cfg.optimizer.lr == 0.02 and cfg.offload_param.device == "cpu" and cfg.precision == "fp32"
    assert cfg.lr_schedule.total_steps == 7 and cfg.lr_schedule.warmup_steps == 0  # short run, short warmup
    cfg, _ = _resolve(offload_param="cpu")
    assert cfg.offload_optimizer.device == "cpu"  # as config_from_args: states follow offloaded weights


def test_tier_budget_flags_beat_the_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("budgets: {hbm_bytes: 1G, dram_bytes: 3G}\n")
    cfg, _ = recipe.resolve(recipe.train_parser().parse_args(["--offload-config", str(path), "--hbm", "2.5G"]))
    assert (cfg.budgets.hbm_bytes, cfg.budgets.dram_bytes) == (int(2.5 * 2**30), 3 << 30)
    assert _resolve(dram="512M")[0].budgets.dram_bytes == 512 << 20  # train({...}) takes the same strings
    parser = offload.add_arguments(argparse.ArgumentParser())  # a training script's flags
    assert offload.config_from_args(parser.parse_args(["--dram", "8G"])).budgets.dram_bytes == 8 << 30


def test_unknown_setting_names_the_nearest():
    with pytest.raises(ValueError, match=r"batchsize: unknown train setting; did you mean 'batch_size'\?"):
        recipe.as_namespace({"batchsize": 4})


def _run(tmp_path, **kw):
    settings = {"model": "tiny", "steps": 3, "batch_size": 4, "seq_len": 64, "nvme_path": str(tmp_path / "swap"),
                "out": str(tmp_path / "run"), "no_progress": True} | kw
    return training.train(settings)


def test_short_run_writes_its_report(tmp_path, capsys):
    report = _run(tmp_path)
    assert "loss" in capsys.readouterr().out
    assert report["steps"] == 3 and len(report["losses"]) == len(report["step_seconds"]) == 3
    assert report["losses"][-1] < report["losses"][0]                 # it learns
    assert report["tokens_per_step"] == 256 and report["config"]["offload_param"]["device"] == "nvme"
    st = report["stats"]
    assert st["step"] == 3 and st["tiers"]["nvme"]["used_bytes"] > 0  # states really lived on nvme
    assert st["links"]["nvme_to_dram"]["bytes"] > 0 and st["links"]["dram_to_nvme"]["bytes"] > 0
    rows = report["samples"]["rows"]
    assert len(rows) >= 2 and len(rows[0]) == len(report["samples"]["columns"])
    assert rows[-1][report["samples"]["columns"].index("nvme_to_dram_bytes")] > 0
    with open(report["files"]["report"]) as f:
        assert json.load(f)["losses"] == report["losses"]
    with open(report["files"]["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path / "swap") == []


def test_evaluation_before_the_first_step_every_n_steps_and_after_the_last(tmp_path, capsys):
    """--eval-data: the mean loss over the same --eval-batches batches, forward only, before the first step,
    every --eval-every steps and after the last; in the report, the summary table and the progress line.
    Training is unchanged by it, and by --sample-prompts' answers before and after."""
    text = tmp_path / "eval.txt"
    text.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 20)
    plain = _run(tmp_path, steps=3, out=str(tmp_path / "plain"))
    capsys.readouterr()
    prompts = tmp_path / "prompts.txt"  # answering them before and after changes nothing either
    prompts.write_text("To be, or\n")
    report = _run(tmp_path, steps=3, eval_data=str(text), eval_every=2, eval_batches=2, no_progress=False,
                  sample_prompts=str(prompts), sample_tokens=4)
    assert [e["step"] for e in report["eval_losses"]] == [0, 2, 3]
    assert all(2 < e["loss"] < 7 for e in report["eval_losses"])  # bytes: ln(257) = 5.5 at random
    assert report["losses"] == plain["losses"] and plain["eval_losses"] == []
    assert report["run"]["eval"] == {"data": str(text), "every": 2, "batches": 2}
    assert [(a["step"], a["prompt"]) for a in report["answers"]] == [(0, "To be, or"), (3, "To be, or")]
    with open(report["files"]["report"]) as f:
        assert json.load(f)["eval_losses"] == report["eval_losses"]
    out, err = capsys.readouterr()
    assert f"eval loss   {report['eval_losses'][0]['loss']:.3f} (step 0) -> " in out
    assert f"eval {report['eval_losses'][-1]['loss']:.3f}" in err  # the progress line


def test_a_resumed_run_does_not_evaluate_its_checkpoints_step_again(tmp_path):
    """The run that saved the checkpoint evaluated before its first step and on its schedule; the run resumed
    from it evaluates on the same schedule from the next step on, so no step's loss is taken twice."""
    text = tmp_path / "eval.txt"
    text.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 20)
    constant = tmp_path / "constant.yaml"  # the same learning rates in a run of 2 steps and one of 4
    constant.write_text("lr_schedule: {type: constant}\n")
    common = dict(eval_data=str(text), eval_every=1, eval_batches=1, checkpoint_dir=str(tmp_path / "ck"),
                  offload_config=str(constant))
    first = _run(tmp_path, steps=2, save_every=2, **common)
    resumed = _run(tmp_path, steps=4, resume="latest", out=str(tmp_path / "run2"), **common)
    whole = _run(tmp_path, steps=4, out=str(tmp_path / "run3"), **common)
    assert [e["step"] for e in first["eval_losses"]] == [0, 1, 2]
    assert [e["step"] for e in resumed["eval_losses"]] == [3, 4]
    assert first["eval_losses"] + resumed["eval_losses"] == whole["eval_losses"]  # one run, cut in two


def test_evaluation_flags_are_checked():
    with pytest.raises(ValueError, match="--eval-every/--eval-batches: need --eval-data PATH"):
        _resolve(eval_every=5)
    with pytest.raises(ValueError, match="--eval-batches=0: must be a positive integer"):
        _resolve(eval_data="x.txt", eval_batches=0)
    _, run = _resolve(eval_data="x.txt")
    assert run["eval"] == {"data": "x.txt", "every": None, "batches": recipe.DEFAULT_EVAL_BATCHES}


def test_accumulation_and_clipping(tmp_path):
    report = _run(tmp_path, steps=2, grad_accum=2, clip=0.1, offload_param="cpu", offload_optimizer="cpu")
    assert report["tokens_per_step"] == 2 * 4 * 64 and report["stats"]["step"] == 2
    assert report["config"]["gradient_clipping"] == 0.1 and all(g is not None for g in report["grad_norms"])


def test_save_a_preset_as_a_hf_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    report = _run(tmp_path, steps=2, save=str(tmp_path / "hf"))
    model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and report["saved"] == str(tmp_path / "hf")
    from offload.models import build_model

    init = build_model("tiny", seed=0)  # the seeded start the Engine materialized
    trained = model.model.layers[0].self_attn.q_proj.weight
    assert trained.shape == init.layers[0].attn.wq.weight.shape
    assert not torch.equal(trained, init.layers[0].attn.wq.weight)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # tied, as the preset


def test_delayed_update_flag_and_save_flushes_the_pending_update(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg, _ = _resolve(delayed_update=True)
    assert cfg.delayed_update is True
    report = _run(tmp_path, steps=1, delayed_update=True, save=str(tmp_path / "hf"))
    assert report["config"]["delayed_update"] is True
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    from offload.models import build_model

    init = build_model("tiny", seed=0)
    # one step under delayed_update: its update was pending at the end, and --save applied it
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, init.layers[0].attn.wq.weight)


def test_tied_preset_with_its_embedding_as_a_unit_trains(tmp_path):
    # With min_numel this small the tied embedding is an offloaded unit; the tied head (TiedLinear)
    # owns the same Parameter, so the Engine fetches that unit for it too.
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"units": {"min_numel": 1024}}))
    report = _run(tmp_path, steps=2, offload_config=str(path), offload_param="cpu")
    assert report["stats"]["step"] == 2 and report["losses"][1] < report["losses"][0] + 1.0

def test_trace_flag_writes_a_perfetto_trace_and_a_timeline_png(tmp_path):
    trace = tmp_path / "trace.json"
    report = _run(tmp_path, steps=2, trace=str(trace), offload_param="nvme")
    events = json.loads(trace.read_text())["traceEvents"]
    cats = {e.get("cat") for e in events if e["ph"] == "X"}
    assert {"step", "compute", "nvme", "cpu_adam"} <= cats
    png = tmp_path / "trace.json.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["stats"]["step"] == 2


def test_activation_checkpointing_flag_checkpoints_the_presets_blocks(tmp_path):
    """--activation-checkpointing (config activation_checkpointing; also a training-script flag): the engine
    checkpoints the preset's 4 blocks, which train to the same losses (the same flag and mechanism for a
    Hugging Face directory: tests/test_train_hf.py)."""
    import argparse

    import offload

    cfg, _ = _resolve(activation_checkpointing=True)
    assert cfg.activation_checkpointing is True and _resolve()[0].activation_checkpointing is False
    parser = offload.add_arguments(argparse.ArgumentParser())
    assert offload.config_from_args(parser.parse_args(["--activation-checkpointing"])).activation_checkpointing
    plain = _run(tmp_path, steps=2, out=str(tmp_path / "plain"))
    report = _run(tmp_path, steps=2, activation_checkpointing=True)
    assert report["losses"] == plain["losses"] and report["config"]["activation_checkpointing"] is True
    assert report["stats"]["activations"]["checkpointed_units"] == 4
    assert plain["stats"]["activations"]["checkpointed_units"] == 0


def test_offload_activations_flag_keeps_the_inputs_on_nvme_and_the_summary_says_so(tmp_path, capsys):
    """--offload-activations nvme (with --activation-checkpointing; alone the config refuses it): the same
    losses as with the inputs in hbm; the plan, the report's stats and the summary say where they waited."""
    from offload import report as rep

    with pytest.raises(ValueError, match="activation_checkpointing is off"):
        _resolve(offload_activations="nvme")
    inputs_in_hbm = _run(tmp_path, steps=2, activation_checkpointing=True, out=str(tmp_path / "hbm"))
    capsys.readouterr()
    report = _run(tmp_path, steps=2, activation_checkpointing=True, offload_activations="nvme")
    assert "the inputs wait in nvme, back ahead of their backward" in capsys.readouterr().err
    assert report["losses"] == inputs_in_hbm["losses"]
    act = report["stats"]["activations"]
    assert act["where"] == "nvme" and act["moved_out_bytes"] == act["moved_in_bytes"] > 0
    assert "activations kept inputs in nvme: " in rep.summary_table(report)
    assert "activations kept inputs" not in rep.summary_table(inputs_in_hbm)
