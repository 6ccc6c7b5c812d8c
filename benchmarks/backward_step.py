"""The Adasum step bucket by bucket during the backward pass: the design issue N asks to measure before the
strategies get it (``benchmarks/loops.py --impl plain_adasum_backward``; results in docs/benchmarks.md).

Horovod's ``_DistributedAdasumOptimizer`` (``horovod/torch/optimizer.py``) steps each parameter as soon as
its gradient is accumulated and starts the Adasum allreduce of its delta while backward goes on. Here the
same with buckets: the trainable parameters, in reverse registration order (roughly the order backward
finishes them, as in DDP), are cut into buckets of one dtype and device of up to ``bucket_bytes``; when a
bucket's last gradient is accumulated (``register_post_accumulate_grad_hook``) the bucket's parameters are
copied into its ``before`` buffer, the wrapped optimizer steps those parameters alone (its param groups cut
down to them for the call: per-parameter optimizers only, e.g. SGD with momentum, Adam, AdamW), and the
delta is written into the bucket's flat buffer; a worker thread reduces the buckets strictly in bucket
order (every rank issues the same exchanges in the same order, whichever gradients arrive first) with
:func:`adasum_lightning.allreduce.adasum_allreduce_flat` on a process group of its own, and writes
``before + Adasum`` back. :meth:`BackwardAdasum.finish` steps the buckets backward did not complete
(unused parameters: zero delta) and waits for the worker.

Result: the parameters of :func:`adasum_lightning.step.adasum_step` bitwise when each bucket is reduced on
whole tensors (below ``TREE_MAX_BYTES``: the binomial tree), and to the float64 summation order of the dot
products otherwise (``tests/workers/step_paths.py`` checks the first at 2, 3 and 4 ranks). Memory: two
flat copies of the trainable parameters (``before``, deltas), as the whole step.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from adasum_lightning.allreduce import adasum_allreduce_flat
from adasum_lightning.step import _views


class _Bucket:
    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        total = sum(p.numel() for p in params)
        self.before = torch.empty(total, dtype=params[0].dtype, device=params[0].device)
        self.delta = torch.empty_like(self.before)
        self.counts = [p.numel() for p in params]
        # per parameter, its piece of each buffer (the buffers are kept between steps, so are the views)
        self.starts, self.deltas = _views(self.before, params), _views(self.delta, params)
        self.ids = {id(p) for p in params}
        self.arrived = 0
        self.ready = threading.Event()  # the delta is in ``delta``: the worker may reduce it
        self.done = threading.Event()  # ``before + Adasum`` is written back


class BackwardAdasum:
    """Steps ``optimizer`` and Adasum-reduces its deltas bucket by bucket during ``loss.backward()``.

    Per training step: ``optimizer.zero_grad()``, ``loss.backward()``, then :meth:`finish` instead of
    ``optimizer.step()``. Every rank of the default group must build it for the same model.

    Args:
        params: the model's parameters (the frozen ones are left out: their delta is zero).
        optimizer: a per-parameter optimizer holding ``params``.
        bucket_bytes: the largest bucket, in bytes (a larger parameter is a bucket of its own).
    """

    def __init__(
        self, params: list[torch.Tensor], optimizer: Optimizer, bucket_bytes: int = 25 << 20
    ) -> None:
        self.optimizer = optimizer
        self.group = dist.new_group(backend="gloo")  # collective: every rank builds one
        trainable = [p for p in params if p.requires_grad][::-1]
        self.buckets: list[_Bucket] = []
        current: list[torch.Tensor] = []
        size = 0
        for p in trainable:
            if current and (p.dtype, p.device) != (current[0].dtype, current[0].device):
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._on_gradient)
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._reduce_in_order, daemon=True)
        self._worker.start()

    def _on_gradient(self, param: torch.Tensor) -> None:
        bucket = self._bucket_of[id(param)]
        bucket.arrived += 1
        if bucket.arrived == len(bucket.params):
            self._step(bucket)

    @torch.no_grad()
    def _step(self, bucket: _Bucket) -> None:
        torch.cat([p.reshape(-1) for p in bucket.params], out=bucket.before)
        groups = self.optimizer.param_groups
        kept = [g["params"] for g in groups]
        for g in groups:
            g["params"] = [p for p in g["params"] if id(p) in bucket.ids]
        try:
            self.optimizer.step()
        finally:
            for g, params in zip(groups, kept, strict=True):
                g["params"] = params
        for p, start, d in zip(bucket.params, bucket.starts, bucket.deltas, strict=True):
            torch.sub(p, start, out=d)
        bucket.ready.set()

    @torch.no_grad()
    def _reduce_in_order(self) -> None:
        while True:
            for bucket in self.buckets:
                bucket.ready.wait()
                bucket.ready.clear()
                try:
                    adasum_allreduce_flat(bucket.delta, bucket.counts, group=self.group)
                    for p, start, d in zip(bucket.params, bucket.starts, bucket.deltas, strict=True):
                        torch.add(start, d, out=p.data)
                except BaseException as error:  # noqa: BLE001  (re-raised by finish() in the main thread)
                    self._error = error
                bucket.done.set()

    def finish(self) -> None:
        """Step the buckets backward left incomplete, wait until every bucket is reduced and written back.

        Raises:
            RuntimeError: from ``torch.distributed`` in the worker (a peer lost, a timeout).
        """
        for bucket in self.buckets:
            if bucket.arrived < len(bucket.params):
                self._step(bucket)
        for bucket in self.buckets:
            bucket.done.wait()
            bucket.done.clear()
            bucket.arrived = 0
        if self._error is not None:
            raise self._error
