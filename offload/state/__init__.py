"""The training state and where it lives: the tiers' memory, each unit's weights (residency), the optimizer
states (optim), kept activation inputs, the ranks' collectives, a unit's buffers read and written at their
homes (homes), and building all of it at the start (materialize, in a CPU build's init order: init_order).
Imports the plan, the kernels and the layers below."""
