"""The training state and where it lives: the tiers' memory, each unit's weights (residency), the optimizer
states (optim), kept activation inputs, the ranks' collectives, and building all of it at the start
(materialize). Imports the plan, the kernels and the layers below."""
