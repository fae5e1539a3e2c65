"""The step: the runtime's resources, the module hooks that fetch and release weights, activation
checkpointing, gradients, prefetching and the optimizer's pipeline over a unit's states. Imports the state,
the plan and the layers below."""
