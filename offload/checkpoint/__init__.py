"""Checkpoints: the sharded, verified on-disk format (format) and the engine's save and load through it
(sharded), resumable at another world size. Imports the state, the plan and the layers below."""
