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
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
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
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True)
class Bucket:
    size: int  # bytes
    entries: tuple[tuple[TensorMeta, int], ...]  # (tensor, byte offset)


def tensor_meta(named_tensors) -> list[TensorMeta]:
    """Names, full shapes and dtypes of `(name, tensor)` pairs (sharded DTensors report their full shape)."""
    return [TensorMeta(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
            for name, tensor in named_tensors]


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

    def send(self, bucket: Bucket, tensors: dict[str, torch.Tensor]) -> None:
        """Broadcast one bucket of full tensors (channel rank 0)."""
        buffer = torch.empty(bucket.size, dtype=torch.uint8, device=self.device)
        for meta, offset in bucket.entries:
            flat = tensors[meta.name].detach().to(self.device).contiguous().view(-1).view(torch.uint8)
            buffer[offset: offset + meta.nbytes].copy_(flat)
        self.broadcast(buffer)

    def receive(self, buckets: list[Bucket]):
        """Yield `(name, tensor)` as each bucket arrives (views into that bucket's buffer)."""
        for bucket in buckets:
            buffer = torch.empty(bucket.size, dtype=torch.uint8, device=self.device)
            self.broadcast(buffer)
            for meta, offset in bucket.entries:
                flat = buffer[offset: offset + meta.nbytes].view(getattr(torch, meta.dtype))
                yield meta.name, flat.view(meta.shape)
