"""FP8 GEMM and MoE layers run by the backend of their row count's bucket, as the measured table ranks them: a
decode step of one token and a prefill of thousands may want different kernels. Each distinct backend packs every
weight once in its own form; most of those forms are the checkpoint's tensors as they are (no extra memory), and
`extra_bytes` counts the rest."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from plugserve.core.interfaces import Backend, Fp8GemmBackend, MoEBackend, MoEWeights

B = TypeVar("B", bound=Backend)


@dataclass(frozen=True)
class Bucket(Generic[B]):
    """A backend for batches (or GEMMs) up to `max_size` requests, tokens or rows."""

    max_size: int
    backend: B


def in_bucket(buckets: list[Bucket[B]], size: int) -> B:
    """The backend of the first bucket holding `size` (a size beyond the last bucket uses it)."""
    return next((b.backend for b in buckets if size <= b.max_size), buckets[-1].backend)


def merged(buckets: list[Bucket[B]]) -> list[Bucket[B]]:
    """`buckets` (ascending) with each run of one backend as a single bucket, its largest bound."""
    out: list[Bucket[B]] = []
    for bucket in buckets:
        if out and out[-1].backend is bucket.backend:
            out[-1] = bucket
        else:
            out.append(bucket)
    return out


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor a packed weight holds: in dataclass fields, tuples, lists and dict values."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, field.name))
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)


class ByRows(Generic[B]):
    """The buckets of one kind (at least two distinct backends, one spec) and the packing they share."""

    def __init__(self, buckets: list[Bucket[B]]) -> None:
        self.buckets = merged(buckets)
        self.backends: list[B] = list({id(b.backend): b.backend for b in self.buckets}.values())
        if len(self.backends) < 2:
            raise ValueError("rows are bucketed only between two backends or more")
        first = self.backends[0]
        if any(b.spec != first.spec for b in self.backends):
            raise ValueError("every bucket's backend must run one spec: the model packs and calls them alike")
        self.extra_bytes = 0  # packed bytes beyond the weights and the first backend's packs

    def describe(self) -> str:
        """e.g. 'triton up to 64 rows, torch_scaled_mm above'."""
        parts = [f"{b.backend.name} up to {b.max_size} rows" for b in self.buckets[:-1]]
        return ", ".join([*parts, f"{self.buckets[-1].backend.name} above"])

    def pack(self, weights: Any, prepare: Callable[[B], Any]) -> dict[str, Any]:
        """Each backend's `prepare` of one weight, by backend name; counts what the packs beyond the first add."""
        packs = {b.name: prepare(b) for b in self.backends}
        first = packs[self.backends[0].name]
        seen = {t.untyped_storage().data_ptr() for t in [*tensors_in(weights), *tensors_in(first)]}
        for backend in self.backends[1:]:
            for tensor in tensors_in(packs[backend.name]):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    self.extra_bytes += storage.nbytes()
        return packs

    def of(self, rows: int) -> B:
        return in_bucket(self.buckets, rows)


def adopt(backend: Backend, buckets: list[Bucket[B]]) -> ByRows[B]:
    """The buckets of `backend` (a GemmByRows or MoEByRows being built), which takes their spec and device, their names
    joined, and their first's capabilities (CUDA graphs where every one of them runs in graphs)."""
    rows = ByRows(buckets)
    first = rows.backends[0]
    Backend.__init__(backend, first.spec, first.device)
    backend.name = "+".join(b.name for b in rows.backends)  # type: ignore[misc]
    backend.capabilities = dataclasses.replace(  # type: ignore[misc]
        first.capabilities, cuda_graph=all(b.capabilities.cuda_graph for b in rows.backends))
    return rows


class GemmByRows(Fp8GemmBackend):
    """Block-FP8 linear layers through the backend of x's row count's bucket (see the module docstring)."""

    name = "by-rows"

    def __init__(self, buckets: list[Bucket[Fp8GemmBackend]]) -> None:
        self.rows = adopt(self, buckets)

    def prepare(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> dict[str, Any]:
        return self.rows.pack((weight, weight_scale_inv), lambda b: b.prepare(weight, weight_scale_inv))

    def apply(self, x: torch.Tensor, packed: dict[str, Any]) -> torch.Tensor:
        """x [M, K] -> [M, N] by the backend of M's bucket."""
        backend = self.rows.of(x.shape[0])
        return backend.apply(x, packed[backend.name])

    def quantize_activation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.of(x.shape[0]).quantize_activation(x)


class MoEByRows(MoEBackend):
    """Routed experts through the backend of the token count's bucket: the same backend routes and runs a call's
    tokens, so its top-k layout never meets another backend's kernels."""

    name = "by-rows"

    def __init__(self, buckets: list[Bucket[MoEBackend]]) -> None:
        self.rows = adopt(self, buckets)

    def route(self, router_logits: torch.Tensor, correction_bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.of(router_logits.shape[0]).route(router_logits, correction_bias)

    def route_hidden(self, x: torch.Tensor, gate: torch.Tensor, correction_bias: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.of(x.shape[0]).route_hidden(x, gate, correction_bias)

    def prepare(self, weights: MoEWeights) -> dict[str, Any]:
        return self.rows.pack(weights, lambda b: b.prepare(weights))

    def forward(self, x: torch.Tensor, packed: dict[str, Any], topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                routed_scaling_factor: float) -> torch.Tensor:
        """x [T, H] -> [T, H] by the backend of T's bucket."""
        backend = self.rows.of(x.shape[0])
        return backend.forward(x, packed[backend.name], topk_ids, topk_weights, routed_scaling_factor)
