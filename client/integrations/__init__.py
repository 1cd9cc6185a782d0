"""`timeslice.integrations`: glue between the client and the frameworks RL jobs train with.

Owned by the client package. Each submodule imports its framework and is imported only by
jobs that use it, so `import timeslice` still needs only `grpcio` and `protobuf`:

- `timeslice.integrations.transformers`: `TimeSliceCallback`, a `transformers.TrainerCallback`
  that holds the group for each optimizer step of a `Trainer` (and of TRL's trainers, which
  subclass it), with `released()` to give the GPUs back inside a step (CPU reward functions);
- `timeslice.integrations.ray`: `on_accelerators`, a decorator for Ray actor methods whose
  client is made in the actor's own process.

This package imports neither; importing it imports no framework.
"""
