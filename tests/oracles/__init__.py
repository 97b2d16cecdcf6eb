"""What the tests compare ckptflow's output with: DeepSpeed itself, loading a resharded checkpoint on
the new world size (``reshard``, ``parallel_reshard``, ``expert_reshard`` rank scripts; training resumed
by ``reshard_trainer``), and the tensor readers the tests use to read it back (``tensors``)."""
