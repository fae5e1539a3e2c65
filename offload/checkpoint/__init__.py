"""Checkpoints: the sharded, verified on-disk format (format), the engine's save (saving) and load (loading)
through it, resumable at another world size, torch's state dicts of the engine (state_dict) and its
parameters' whole values (values). Imports the step, the state, the plan and the layers below."""
