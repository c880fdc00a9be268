"""The policy actor: the trained copy of the model, sharded with FSDP2."""
