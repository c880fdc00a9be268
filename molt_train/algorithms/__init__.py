"""RL algorithms as pure functions over tensors: estimators, losses, KL, off-policy control."""
