"""Opening the weights a trainer sends: ``/update_weights_from_tensor`` payloads (SGLang's serialised named tensors
or flattened buckets, shared memory on CPU or CUDA IPC handles) and ``/update_weights_from_distributed``
broadcasts, received into buffers reused from bucket to bucket."""

from __future__ import annotations

import base64
from typing import Any

import torch

from megarl.engines.cpu_engine.requests import RequestError
from megarl.engines.http_api import FLATTENED_BUCKET


class Payload:
    """One TP rank's ``serialized_named_tensors`` entry, opened (its shared memory mapped, or its CUDA IPC handle)."""

    def __init__(self, payload: Any, load_format: str | None) -> None:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        # A CUDA payload is pickled under SGLang's torch-reduction patch (the sender names its GPU by UUID): it
        # rebuilds through patch_torch._rebuild_cuda_tensor_modified, which calls
        # reductions._rebuild_cuda_tensor_original, an attribute only the patch creates. SGLang's scheduler
        # applies it before it opens payloads; so does this server (idempotent; it changes only how this process
        # would pickle tensors, which it never does).
        monkey_patch_torch_reductions()
        if load_format not in (None, "direct", FLATTENED_BUCKET):
            raise RequestError(f"/update_weights_from_tensor: load_format {load_format!r} is not supported here; "
                               f"use {FLATTENED_BUCKET!r} or none")
        self.flattened = load_format == FLATTENED_BUCKET
        data = base64.b64decode(payload) if isinstance(payload, str) else payload
        self.obj = MultiprocessingSerializer.deserialize(data)

    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of each tensor, without building them."""
        if self.flattened:
            return [(m.name, tuple(m.shape)) for m in self.obj["metadata"]]
        return [(n, tuple(t.shape)) for n, t in self.obj]

    def keep_open(self, opened: dict[int, Any], *, limit: int) -> None:
        """Hold this payload's flat buffer in ``opened`` (by address; the oldest beyond ``limit`` let go): a sender
        that reuses its bucket buffers sends the same handle again, which torch then opens from its cache of
        live shared storages instead of mapping the memory afresh (1.7 ms per handle and the page faults of every
        byte read). The server lets go of all at the end of the weight-update session."""
        if not self.flattened:
            return
        flat = self.obj["flattened_tensor"]
        key = flat.untyped_storage().data_ptr()
        opened.pop(key, None)
        opened[key] = flat
        while len(opened) > limit:
            opened.pop(next(iter(opened)))

    def named(self) -> list[tuple[str, Any]]:
        """The ``(name, tensor)`` pairs."""
        if self.flattened:
            from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

            return FlattenedTensorBucket(flattened_tensor=self.obj["flattened_tensor"],
                                         metadata=self.obj["metadata"]).reconstruct_tensors()
        return list(self.obj)


class ReceiveBuffer:
    """A growing flat byte buffer, reused by one group member from bucket to bucket."""

    def __init__(self) -> None:
        self.data = torch.empty(0, dtype=torch.uint8)

    def take(self, nbytes: int) -> torch.Tensor:
        if self.data.numel() < nbytes:
            self.data = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self.data = torch.empty(nbytes, dtype=torch.uint8)
        return self.data[:nbytes]


def receive(group: Any, names: list[str], dtypes: list[str], shapes: list[list[int]],
             load_format: str | None, buffer: ReceiveBuffer) -> list[tuple[str, torch.Tensor]]:
    """The tensors rank 0 broadcasts: one per name, or one flattened bucket of them all (into ``buffer``; the
    tensors returned are views of it, valid until this member's next bucket)."""
    if load_format == FLATTENED_BUCKET:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        layout = FlattenedTensorBucket.empty(names, dtypes, shapes, "meta")  # its metadata (checks names, shapes)
        flat = buffer.take(layout.get_flattened_tensor().numel())
        group.broadcast(flat, 0).wait()
        return FlattenedTensorBucket(flattened_tensor=flat, metadata=layout.get_metadata()).reconstruct_tensors()
    if load_format is not None:
        raise RequestError(f"/update_weights_from_distributed: load_format {load_format!r}; use "
                           f"{FLATTENED_BUCKET!r} or none")
    tensors = [(name, torch.empty(shape, dtype=getattr(torch, str(dtype).removeprefix("torch."))))
               for name, dtype, shape in zip(names, dtypes, shapes, strict=True)]
    for work in [group.broadcast(tensor, 0) for _, tensor in tensors]:
        work.wait()
    return tensors
