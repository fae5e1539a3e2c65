"""ZeRO over ranks with CUDA tensors, checked where no GPU is: what the engine's groups are built on, and
that stages 1-3 on CUDA run (with a warning that they never ran over NCCL) instead of being refused."""

import logging

import torch
import torch.distributed as dist

from offload.plan.config import Config
from offload.engine import _check_ranks
from offload.state.ranks import groups_backend


def test_the_engines_groups_add_gloo_beside_a_bare_nccl_for_host_tensors(monkeypatch):
    for default, ours in [("nccl", "cpu:gloo,cuda:nccl"), ("gloo", "gloo"),
                          ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl")]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, d=default: d)
        assert groups_backend() == ours


def test_stages_1_to_3_on_cuda_run_and_say_they_never_ran_over_nccl(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for stage in (0, 1, 2, 3):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="offload"):
            _check_ranks(Config(zero_stage=stage), 2)  # no error
        assert ("never run over NCCL" in caplog.text) == (stage > 0), caplog.text
