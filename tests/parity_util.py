"""The parity tests' config and comparison (tests/test_engine_parity.py, tests/test_precision.py): an engine's
losses and states against the plain loop's."""

from tests.engine_util import max_state_err


def config(tmp_path, param, optim, precision, **extra):
    """reuse_bytes 0 unless given: backward fetches every unit again (the path with the most transfers)."""
    return {"precision": precision, "offload_param": {"device": param}, "offload_optimizer": {"device": optim},
            "nvme_path": str(tmp_path / "swap"), "units": {"min_numel": 512}, "reuse_bytes": 0,
            "optimizer": {"lr": 1e-2, **extra.pop("optimizer", {})}, **extra}


def check(losses, ref_losses, sd, ref_sd, precision=None, tol: float = 0.0):
    """Exact by default (same kernel); `tol` relative against the torch-optimizer reference."""
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= tol * abs(b), (losses, ref_losses)
    assert max_state_err(sd, ref_sd) <= tol
