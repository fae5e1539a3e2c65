"""ZeRO over ranks with CUDA tensors, checked where no GPU is: what the engine's groups are built on, what
`offload train` under torchrun builds the default group on, and that the engine admits stages 1-3 on a CUDA host
(with a warning that they never ran over NCCL) instead of refusing them, still refusing what is not built."""

import logging

import pytest
import torch
import torch.distributed as dist

from offload import train as recipe
from offload.engine import _check_unsupported
from offload.plan.config import Config
from offload.state.ranks import groups_backend


def test_the_engines_groups_add_gloo_beside_a_bare_nccl_for_host_tensors(monkeypatch):
    for default, ours in [("nccl", "cpu:gloo,cuda:nccl"), ("gloo", "gloo"),
                          ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl")]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, d=default: d)
        assert groups_backend() == ours


@pytest.fixture
def cuda_host(monkeypatch):
    """torch.cuda.is_available() says yes; the returned function sets the default group's world size (1: none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def ranks(world: int) -> None:
        monkeypatch.setattr(dist, "is_initialized", lambda: world > 1)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: world - 1)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    return ranks


def test_stages_1_to_3_on_cuda_run_and_say_they_never_ran_over_nccl(cuda_host, caplog):
    """The engine's check of its config against the default group (Engine.__init__'s first) admits every stage
    over 2 ranks on a CUDA host; stages 1-3 warn once, naming the stage and the ranks, stage 0 and one
    process do not; delayed_update with partitioned states is refused there as on CPUs."""
    for world, stage in [(2, 0), (2, 1), (2, 2), (2, 3), (1, 3)]:
        cuda_host(world)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="offload"):
            assert _check_unsupported(Config(zero_stage=stage)) == (world - 1, world)  # admitted
        warned = [r for r in caplog.records if "never run over NCCL" in r.getMessage()]
        assert len(warned) == (world > 1 and stage > 0), caplog.text
        assert all(r.levelno == logging.WARNING and f"zero_stage={stage} over 2 ranks with CUDA tensors"
                   in r.getMessage() for r in warned), caplog.text
    cuda_host(2)
    with pytest.raises(ValueError, match="delayed_update=true: not implemented with zero_stage=2 over 2 ranks"):
        _check_unsupported(Config(zero_stage=2, delayed_update=True))


@pytest.mark.parametrize("cuda,backend", [(True, "cpu:gloo,cuda:nccl"), (False, "gloo")])
def test_offload_train_under_torchrun_builds_the_default_group_for_host_tensors_too(monkeypatch, cuda, backend):
    """On a CUDA host the default group is gloo beside NCCL: its rank agreements are CPU tensors, which a bare
    NCCL cannot send."""
    made = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert recipe._join_torchrun(30.0) == (1, 2) and made == [backend]
