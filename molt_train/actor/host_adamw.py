"""AdamW with its states and fp32 master weights in host memory (`--actor.offload optimizer`).

ZeRO-Offload's split of the work: the parameters and gradients stay on the
training device, sharded by FSDP2, so forward and backward never wait for
the host; the three fp32 tensors per parameter the optimizer keeps (the
master weights it steps, exp_avg, exp_avg_sq) live in host memory. A step
copies this rank's gradient shards to the host, runs torch's own AdamW update
there, and copies the updated shards back into the device parameters.
Gradient clipping runs before, on the device gradients, so the global norm
across ranks is computed as without offload.

To torch it is an ordinary optimizer over the model's parameters: the lr
scheduler sets its param groups' `lr`, and `state_dict` gives torch AdamW's
format, the moments sharded like their parameters, so
`get/set_optimizer_state_dict` save and restore it, and a checkpoint loads
with either offload setting. For that gather the moments visit the device
while a checkpoint is saved. The master weights are not saved: after every
step they equal the device parameters (fp32 whatever the compute dtype), and
a restore takes them from there.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

MOMENTS = ("exp_avg", "exp_avg_sq")


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of an FSDP-sharded tensor (a view, not a copy); a plain tensor is its own."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """An fp32 copy in host memory, pinned when there is a GPU so that copies to it run asynchronously."""
    host = torch.empty(tensor.shape, dtype=torch.float32, pin_memory=torch.cuda.is_available())
    return host.copy_(tensor.detach())


def sharded_like(host: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A host shard of a state as its parameter is held: on the parameter's device and, for a DTensor,
    on its mesh with its placements and global shape."""
    local = host.to(local_shard(param).device)
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


class HostAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW, stepping host copies of this rank's parameter shards."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def _state(self, param: torch.Tensor) -> dict:
        """The parameter's host state; at its first step, master weights copied from it and zero moments."""
        state = self.state[param]
        if not state:
            master = host_copy(local_shard(param))
            state.update(step=torch.tensor(0.0), master=master, exp_avg=torch.zeros_like(master),
                         exp_avg_sq=torch.zeros_like(master))
        return state

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Gradient shards to the host, AdamW on the master weights there, the result into the parameters."""
        if closure is not None:
            raise ValueError("HostAdamW.step takes no closure")
        for group in self.param_groups:
            params = [param for param in group["params"] if param.grad is not None]
            states = [self._state(param) for param in params]
            # From a GPU the copies land in pinned memory asynchronously; wait for all of them at once.
            grads = [local_shard(param.grad).to("cpu", torch.float32, non_blocking=True) for param in params]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            beta1, beta2 = group["betas"]
            adamw([state["master"] for state in states], grads, [state["exp_avg"] for state in states],
                  [state["exp_avg_sq"] for state in states], [], [state["step"] for state in states],
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                  eps=group["eps"], maximize=False)
            for param, state in zip(params, states):
                local_shard(param).copy_(state["master"], non_blocking=True)

    def state_dict(self) -> dict:
        """torch AdamW's format: per parameter the step and the moments, sharded like the parameter."""
        saved = super().state_dict()
        params = [param for group in self.param_groups for param in group["params"]]
        saved["state"] = {index: {"step": state["step"], **{key: sharded_like(state[key], params[index])
                                                            for key in MOMENTS}}
                          for index, state in saved["state"].items()}
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        """From torch AdamW's format (as `state_dict` gives it): the moments to the host, the master
        weights copied from the parameters."""
        super().load_state_dict(state_dict)
        for param, state in self.state.items():
            state.update({key: host_copy(local_shard(state[key])) for key in MOMENTS},
                         master=host_copy(local_shard(param)))
