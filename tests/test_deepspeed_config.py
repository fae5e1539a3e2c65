"""DeepSpeed configs read into our Config (offload/integrations/deepspeed.py), --deepspeed, and the CLI's
rough edges from issue 16: --version, user-facing --help, a malformed --offload-config in one line."""

import argparse
import json
import os
import subprocess
import sys
import warnings

import pytest

import offload
from offload import recipe
from offload.cli import _user_warning, main
from offload.integrations import deepspeed as ds
from offload.plan.config import Config
from offload.plan.settings import CHUNK_ALIGN_BYTES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Hugging Face's ZeRO-3 example with NVMe offload of weights and optimizer states, "auto" where the
# Trainer fills values in (transformers' DeepSpeed guide).
HF_ZERO3_NVME = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
            "overlap_events": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
# What that config asks for that we do differently: each named in the one warning, nothing else.
HF_ZERO3_NVME_NOTED = {
    "fp16.hysteresis", "scheduler.params.warmup_type", "zero_optimization.offload_optimizer.buffer_count",
    "zero_optimization.offload_param.buffer_count", "zero_optimization.offload_param.buffer_size",
    "zero_optimization.offload_param.max_in_cpu", "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance", "aio.thread_count", "steps_per_print",
}


def _zero3(device: str) -> dict:
    """DeepSpeed's ZeRO-3 tutorial config, with weights and optimizer states offloaded to `device`."""
    offload_to = {"device": device, **({"nvme_path": "/local_nvme"} if device == "nvme" else {})}
    return {"zero_optimization": {
        "stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7, "sub_group_size": 1e9,
        "offload_optimizer": dict(offload_to), "offload_param": dict(offload_to)}}


def _load(config) -> tuple[Config, list[str]]:
    """(Config, the DeepSpeed keys named in the warning) and checks there was at most one warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = Config.from_deepspeed(config)
    ours = [w for w in caught if issubclass(w.category, ds.DeepSpeedConfigWarning)]
    assert len(ours) <= 1, [str(w.message) for w in ours]
    lines = str(ours[0].message).splitlines()[1:] if ours else []
    return cfg, [line.strip().split(":")[0].split(" (")[0] for line in lines]


def _chunk(numel: int) -> int:
    return -(-numel * 4 // CHUNK_ALIGN_BYTES) * CHUNK_ALIGN_BYTES


def test_hf_zero3_nvme_config_maps_with_auto_values_left_to_us(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(HF_ZERO3_NVME))
    cfg, noted = _load(str(path))
    assert cfg.zero_stage == 3 and cfg.nvme_path == "/local_nvme"
    assert (cfg.offload_param.device, cfg.offload_optimizer.device) == ("nvme", "nvme")
    assert cfg.chunk_bytes == _chunk(10**9) and cfg.chunk_bytes % CHUNK_ALIGN_BYTES == 0
    assert (cfg.aio.block_bytes, cfg.aio.queue_depth, cfg.aio.threads) == (262144, 32, 4)
    assert cfg.loss_scale.initial == 2.0**16 and cfg.loss_scale.growth_interval == 1000
    assert cfg.lr_schedule.type == "constant"
    defaults = Config()  # "auto": ours (or the caller's) decides
    assert cfg.precision == defaults.precision and cfg.optimizer == defaults.optimizer
    assert cfg.gradient_accumulation_steps == 1 and cfg.gradient_clipping == 0.0
    assert cfg.lr_schedule.warmup_steps == 0 and cfg.prefetch_units == defaults.prefetch_units
    assert cfg.units.min_numel == defaults.units.min_numel
    assert sorted(noted) == sorted(HF_ZERO3_NVME_NOTED)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_deepspeed_docs_zero3_offload_configs(device):
    cfg, noted = _load(_zero3(device))
    assert cfg.zero_stage == 3 and cfg.precision == "fp32"  # no fp16/bf16 section: DeepSpeed trains in fp32
    assert (cfg.offload_param.device, cfg.offload_optimizer.device) == (device, device)
    assert cfg.nvme_path == ("/local_nvme" if device == "nvme" else None)
    assert cfg.units.min_numel == 100_000 and cfg.chunk_bytes == _chunk(10**9)
    assert cfg.prefetch_units == Config().prefetch_units  # elements ahead: no count of units to take from it
    assert set(noted) == {"zero_optimization." + k for k in (
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "reduce_bucket_size")}


def test_offloaded_weights_take_the_optimizer_states_along():
    cfg, noted = _load({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}})
    assert (cfg.offload_param.device, cfg.offload_optimizer.device) == ("nvme", "cpu")
    assert noted == ["zero_optimization.offload_optimizer"]


def test_deepspeed_docs_zero2_cpu_offload():
    cfg, noted = _load({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                              "contiguous_gradients": True, "overlap_comm": True},
                        "bf16": {"enabled": True}, "gradient_clipping": 1.0, "gradient_accumulation_steps": 4})
    assert cfg.zero_stage == 2 and cfg.precision == "bf16" and cfg.gradient_clipping == 1.0
    assert (cfg.offload_param.device, cfg.offload_optimizer.device) == ("none", "cpu")
    assert cfg.gradient_accumulation_steps == 4 and noted == []


def test_every_unsupported_key_is_named_once_with_what_we_do_instead():
    config = {"zero_optimization": {"stage": 1, "overlap_comm": False, "round_robin_gradients": False,
                                    "no_such_knob": 1, "offload_param": {"device": "cpu", "pin_memory": False},
                                    "offload_optimizer": {"device": "cpu", "pin_memory": True}},
              "tensorboard": {"enabled": True}, "communication_data_type": "fp32",
              "zero_allow_untested_optimizer": True, "ignored_auto": "auto",
              "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}
    cfg, noted = _load(config)
    assert sorted(noted) == sorted(["zero_optimization.overlap_comm", "zero_optimization.no_such_knob",
                                    "zero_optimization.offload_param.pin_memory", "tensorboard",
                                    "communication_data_type", "zero_allow_untested_optimizer",
                                    "activation_checkpointing"])
    assert cfg.activation_checkpointing is False  # DeepSpeed's section is not our key
    with pytest.warns(ds.DeepSpeedConfigWarning) as record:
        Config.from_deepspeed(config)
    text = str(record[0].message)
    assert "overlap_comm: False: transfers always overlap compute" in text
    assert "no_such_knob: no equivalent here; ignored" in text
    assert "our activation_checkpointing: true (--activation-checkpointing)" in text


def test_a_config_we_follow_entirely_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = Config.from_deepspeed({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}})
    assert cfg.zero_stage == 0


def test_sub_group_size_becomes_aligned_chunk_bytes():
    assert _load({"zero_optimization": {"sub_group_size": 1e8}})[0].chunk_bytes == 48_829 * 8192  # 4e8 bytes, rounded up
    assert _load({"zero_optimization": {"sub_group_size": 1000}})[0].chunk_bytes == CHUNK_ALIGN_BYTES
    cfg, noted = _load({"zero_optimization": {"sub_group_size": 0}})
    assert cfg.chunk_bytes == Config().chunk_bytes and noted == ["zero_optimization.sub_group_size"]


def test_precision_and_loss_scale():
    fp16 = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "min_loss_scale": 0.5,
            "hysteresis": 1}
    cfg, noted = _load({"fp16": fp16})
    assert cfg.precision == "fp16" and noted == []
    assert (cfg.loss_scale.initial, cfg.loss_scale.growth_interval, cfg.loss_scale.min_scale) == (4096, 500, 0.5)
    cfg, noted = _load({"fp16": {**fp16, "loss_scale": 128}})  # static: we start there and stay dynamic
    assert cfg.loss_scale.initial == 128 and "fp16.loss_scale" in noted
    cfg, noted = _load({"fp16": {"enabled": False, "hysteresis": 7}, "bf16": {"enabled": True}})
    assert cfg.precision == "bf16" and noted == []  # a disabled section means nothing, as in DeepSpeed
    assert _load({"fp16": {"enabled": False}})[0].precision == "fp32"
    with pytest.raises(ValueError, match="both true"):
        Config.from_deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


@pytest.mark.parametrize("kind, w_mode, ours", [
    ("Adam", None, "adamw"),   # DeepSpeed's Adam decouples weight decay unless adam_w_mode is false
    ("Adam", False, "adam"),
    ("AdamW", False, "adamw"),
    ("adamw", True, "adamw"),
])
def test_adam_w_mode(kind, w_mode, ours):
    params = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    if w_mode is not None:
        params["adam_w_mode"] = w_mode
    cfg, noted = _load({"optimizer": {"type": kind, "params": params}})
    assert cfg.optimizer == offload.plan.config.OptimizerConfig(ours, 3e-4, (0.9, 0.95), 1e-6, 0.1) and noted == []


def test_schedules():
    cfg, noted = _load({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                        "scheduler": {"type": "WarmupDecayLR", "params": {
                            "warmup_min_lr": 1e-5, "warmup_max_lr": 1e-4, "warmup_num_steps": 10,
                            "total_num_steps": 100, "warmup_type": "linear"}}})
    s = cfg.lr_schedule
    assert (s.type, s.warmup_steps, s.total_steps, cfg.optimizer.lr) == ("linear", 10, 100, 1e-4)
    assert s.min_ratio == pytest.approx(0.1) and noted == ["scheduler.params.warmup_min_lr"]
    cfg, noted = _load({"scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 50, "warmup_num_steps": 5, "warmup_type": "linear"}}})
    assert (cfg.lr_schedule.type, cfg.lr_schedule.min_ratio, cfg.lr_schedule.warmup_steps) == ("cosine", 1e-4, 5)
    cfg, noted = _load({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 20}}})
    assert (cfg.lr_schedule.type, cfg.lr_schedule.warmup_steps) == ("constant", 20)
    assert noted == ["scheduler.params.warmup_type"]  # DeepSpeed's default warmup is a log curve; ours linear
    cfg, noted = _load({"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": "auto", "warmup_num_steps": 3, "warmup_type": "linear", "warmup_max_lr": "auto"}}})
    assert cfg.lr_schedule.type == "constant" and noted == ["scheduler.params.total_num_steps"]
    data = ds.settings({"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": "auto", "warmup_type": "linear", "warmup_max_lr": "auto"}}}, Config, total_steps=40)
    assert data["lr_schedule"] == {"type": "linear", "warmup_steps": 1000, "total_steps": 40}


def test_every_row_sets_a_real_config_key():
    for key, row in ds.KEYS.items():
        if isinstance(row, ds.To):
            ds._hint(row.ours, Config)  # KeyError names a row that points nowhere


@pytest.mark.parametrize("text, message", [
    ('{"zero_optimization": {"stage": 3,}}', "not valid JSON"),
    ("[1, 2]", "expected a mapping of keys at the top level, got a list"),
    ('{"zero_optimization": 3}', "zero_optimization=3: expected an object"),
    ('{"zero_optimization": {"stage": "three"}}', "zero_optimization.stage='three': expected int"),
    ('{"zero_optimization": {"sub_group_size": "1e9"}}', "zero_optimization.sub_group_size='1e9': expected a number"),
    ('{"zero_optimization": {"offload_param": {"device": "disk"}}}',
     "offload_param.device='disk': unknown device; use one of ['none', 'cpu', 'nvme'] "
     "(from DeepSpeed's zero_optimization.offload_param.device)"),
    ('{"bf16": {"enabled": "yes"}}', "bf16.enabled='yes': expected true, false or \"auto\""),
    ('{"optimizer": {"type": "Lamb"}}', "optimizer.type='Lamb': not supported here"),
    ('{"scheduler": {"type": "OneCycle"}}', "scheduler.type='OneCycle': not supported here"),
    ('{"scheduler": {"type": "WarmupDecayLR", "params": {}}}', "total_num_steps: WarmupDecayLR needs it"),
])
def test_malformed_configs_name_the_file_and_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        Config.from_deepspeed(path)
    assert str(path) in str(e.value) and message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file():
    with pytest.raises(ValueError, match=r"deepspeed='/nonexistent/ds.json': no such file"):
        Config.from_deepspeed("/nonexistent/ds.json")


# --- the flag ------------------------------------------------------------------------------------------


def _args(*argv) -> argparse.Namespace:
    return offload.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_deepspeed_flag_and_its_precedence(tmp_path):
    dsfile = tmp_path / "ds.json"
    dsfile.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_optimizer": {"device": "nvme"}}, "aio": {"block_size": 1 << 20, "queue_depth": 8},
        "bf16": {"enabled": True}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key of this file has its equivalent: nothing to say
        cfg = offload.config_from_args(_args("--deepspeed", str(dsfile)))
    assert (cfg.zero_stage, cfg.offload_param.device, cfg.aio.block_bytes, cfg.precision) == (3, "nvme", 1 << 20, "bf16")
    ours = tmp_path / "offload.yaml"
    ours.write_text("aio: {queue_depth: 64}\nprecision: fp32\n")  # laid over the DeepSpeed config, key by key
    cfg = offload.config_from_args(_args("--deepspeed", str(dsfile), "--offload-config", str(ours),
                                         "--offload-param", "cpu", "--zero-stage", "1"))
    assert (cfg.aio.block_bytes, cfg.aio.queue_depth, cfg.precision) == (1 << 20, 64, "fp32")
    assert (cfg.offload_param.device, cfg.offload_optimizer.device, cfg.zero_stage) == ("cpu", "nvme", 1)


def test_offload_train_takes_batch_and_steps_from_a_deepspeed_config(tmp_path):
    dsfile = tmp_path / "ds.json"
    dsfile.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                                                          "warmup_num_steps": 2, "total_num_steps": "auto",
                                                          "warmup_type": "linear"}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    with pytest.warns(ds.DeepSpeedConfigWarning, match="train_micro_batch_size_per_gpu"):
        cfg, run = recipe.resolve(recipe.as_namespace({"deepspeed": str(dsfile), "steps": 12}))
    assert run["batch_size"] == 2 and cfg.gradient_accumulation_steps == 2
    assert (cfg.lr_schedule.type, cfg.lr_schedule.total_steps, cfg.lr_schedule.warmup_steps) == ("linear", 12, 2)
    assert cfg.optimizer.lr == recipe.RECIPE["lr"] and cfg.optimizer.weight_decay == 0.01  # "auto": the recipe's
    assert (cfg.offload_param.device, cfg.offload_optimizer.device) == ("none", "cpu")  # the file's placement
    with pytest.warns(ds.DeepSpeedConfigWarning):
        cfg, run = recipe.resolve(recipe.as_namespace({"deepspeed": str(dsfile), "batch_size": 3, "lr": 0.5}))
    assert run["batch_size"] == 3 and cfg.optimizer.lr == 0.5  # flags win


def test_the_warning_reads_as_a_message_on_the_command_line():
    line = _user_warning("ds.json: 1 DeepSpeed setting(s) ...", ds.DeepSpeedConfigWarning, "x.py", 3)
    assert line == "offload: warning: ds.json: 1 DeepSpeed setting(s) ...\n"
    assert "x.py:3" in _user_warning("other", UserWarning, "x.py", 3)


# --- the CLI's rough edges -----------------------------------------------------------------------------


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"offload {offload.__version__}"


def test_help_speaks_to_users(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "offload train" in out and "--version" in out
    for internal in ("offload/commands", "module", "parser", "hbm", "dram"):
        assert internal not in out, internal


@pytest.mark.parametrize("name, text, message", [
    ("bad.yaml", "a: [1\n", "not valid YAML (expected ',' or ']'"),
    ("bad.json", '{"precision": "bf16",', "not valid JSON"),
    ("list.json", "[1, 2]", "expected a mapping of keys at the top level, got a list"),
    ("list.yaml", "- 1\n- 2\n", "expected a mapping of keys at the top level, got a list"),
])
def test_malformed_offload_config_is_one_line_and_exit_code_2(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    assert main(["train", "--offload-config", str(path), "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"offload train: error: config='{path}': {message}") and len(err.splitlines()) == 1


def test_malformed_offload_config_from_a_real_process(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("a: [1\n")
    proc = subprocess.run([sys.executable, "-m", "offload", "train", "--offload-config", str(path), "--steps", "1"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("offload train: error: ") and len(proc.stderr.splitlines()) == 1
