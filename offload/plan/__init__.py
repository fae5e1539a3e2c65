"""The plan: what a model is cut into and where each part lives, decided before a step runs and from facts
alone (the config, the model's shapes, the host's limits): units, chunks, precision, quantized records, the
memory ledger and the placement. Imports offload.scheduler and offload.swap only."""
