"""Weight sync: the trainer's weights to the engines in buckets, over a broadcast channel.

After each optimizer step every trainer rank gathers the full tensors one at
a time (FSDP2's `full_tensor`, a collective of the trainer group). Rank 0
packs them into flat byte buckets of about `bucket_mb` and broadcasts each
bucket on a channel that joins it to every rollout worker: NCCL on GPU, gloo
on CPU, the same code. A worker unpacks a bucket as it arrives and its engine
loads the tensors between two engine steps, so neither side ever holds more
than one bucket beyond the model itself.

The channel is a process group of its own (its own TCP store on trainer rank
0's node), independent of the trainer's FSDP group and of the engine's:
channel rank 0 is trainer rank 0, ranks 1..W are the workers. Every sender
and receiver computes the same bucket plan from the same tensor list, so
nothing but the bytes crosses the wire.

Floating-point weights travel in the engine's dtype (`sync_metas`; an fp32
engine gets fp32): the engine casts every weight it loads to its own dtype
anyway, so casting on the trainer's side gives the engine the same bits,
while a bf16 engine receives and stages half the bytes. The bucket plan is
made from these metas, and `Channel.send` casts to them.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass, replace
from datetime import timedelta

import torch

ALIGN = 16  # bytes: every tensor starts aligned, so a byte slice can be viewed as its dtype


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class Bucket:
    size: int  # bytes
    entries: tuple[tuple[TensorMeta, int], ...]  # (tensor, byte offset)


def tensor_meta(named_tensors) -> list[TensorMeta]:
    """Names, full shapes and dtypes of `(name, tensor)` pairs (sharded DTensors report their full shape)."""
    return [TensorMeta(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
            for name, tensor in named_tensors]


def sync_dtype(dtype: torch.dtype, engine_dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of `dtype` travels in to an engine of `engine_dtype`: floating-point weights in the
    engine's, other tensors (integer buffers) as they are."""
    return engine_dtype if dtype.is_floating_point else dtype


def sync_metas(metas: list[TensorMeta], engine_dtype: torch.dtype) -> list[TensorMeta]:
    """`metas` as the tensors travel to an engine of `engine_dtype` (`sync_dtype`)."""
    return [replace(meta, dtype=str(sync_dtype(getattr(torch, meta.dtype), engine_dtype)).removeprefix("torch."))
            for meta in metas]


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Consecutive tensors packed into buckets of at most `bucket_bytes`; a larger tensor travels alone."""
    buckets, entries, offset = [], [], 0
    for meta in metas:
        if entries and offset + meta.nbytes > bucket_bytes:
            buckets.append(Bucket(offset, tuple(entries)))
            entries, offset = [], 0
        entries.append((meta, offset))
        offset += -(-meta.nbytes // ALIGN) * ALIGN
    if entries:
        buckets.append(Bucket(offset, tuple(entries)))
    return buckets


def free_endpoint() -> tuple[str, int]:
    """This node's address and a free port on it, for the channel's TCP store."""
    import ray

    host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    with socket.socket() as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]


class Channel:
    """A broadcast group from channel rank 0 (trainer rank 0) to the rollout workers."""

    def __init__(self, host: str, port: int, rank: int, size: int, device: torch.device,
                 timeout: float = 1800.0):
        import torch.distributed as dist

        self.rank, self.device = rank, torch.device(device)
        store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timedelta(seconds=timeout))
        if self.device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, rank, size)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))

    def broadcast(self, buffer: torch.Tensor) -> None:
        self.group.broadcast(buffer, 0).wait()

    def send(self, bucket: Bucket, tensors: dict[str, torch.Tensor]) -> int:
        """Broadcast one bucket of full tensors (channel rank 0), each cast to its dtype in the plan; returns
        the bytes sent."""
        buffer = torch.empty(bucket.size, dtype=torch.uint8, device=self.device)
        for meta, offset in bucket.entries:
            tensor = tensors[meta.name].detach().to(self.device, getattr(torch, meta.dtype))
            flat = tensor.contiguous().view(-1).view(torch.uint8)
            buffer[offset: offset + meta.nbytes].copy_(flat)
        self.broadcast(buffer)
        return buffer.numel()

    def receive(self, buckets: list[Bucket]):
        """Yield `(name, tensor)` as each bucket arrives (views into that bucket's buffer)."""
        for bucket in buckets:
            buffer = torch.empty(bucket.size, dtype=torch.uint8, device=self.device)
            self.broadcast(buffer)
            for meta, offset in bucket.entries:
                flat = buffer[offset: offset + meta.nbytes].view(getattr(torch, meta.dtype))
                yield meta.name, flat.view(meta.shape)
