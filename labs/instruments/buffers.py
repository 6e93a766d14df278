"""ZeRO's working memory besides the model states, measured on a live engine: the gradient buckets that
stages 1-3 reduce through, the parameters ZeRO-3 keeps whole on every rank (persistent), and the peak of
parameters ZeRO-3 holds gathered at one time.

    watch = BufferWatch(engine)     # on every rank, after deepspeed.initialize
    ...train...
    watch.report()                  # {"bucket_bytes": ..., "gathered_peak_bytes": ..., ...}

Each figure is read off the tensors DeepSpeed allocated, so it is the same on a CPU and on a GPU (a CPU's
resident memory would hide buffers that were allocated but not yet written).
"""
from __future__ import annotations

import functools

from labs.train import Instrument


class ZeroBuffers(Instrument):
    """The BufferWatch of a run's DeepSpeed engine; its report lands in summary["zero_buffers"] (one per rank)."""
    name = "zero_buffers"

    def __init__(self):
        self.watch = None

    def after_engine(self, engine):
        if hasattr(engine, "zero_optimization_stage"):      # a DeepSpeed engine (FSDP2 has no ZeRO buffers)
            self.watch = BufferWatch(engine)

    def summary(self) -> dict:
        return self.watch.report() if self.watch else None


class BufferWatch:
    def __init__(self, engine):
        self.engine = engine
        self.optimizer = getattr(engine, "optimizer", None)
        self.stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
        self.gathered_peak_elements = 0
        self.gathered_peak_bytes = 0
        self.bucket_peak_bytes = 0
        release = getattr(self.optimizer, "_release_ipg_buffers", None)
        if release is not None:
            # Stages 1-2 free their buckets after each backward: read them just before.
            @functools.wraps(release)
            def sample_and_release(*args, **kwargs):
                self.bucket_peak_bytes = max(self.bucket_peak_bytes, self.bucket_bytes())
                return release(*args, **kwargs)

            self.optimizer._release_ipg_buffers = sample_and_release
        coordinator = self._coordinator()
        if coordinator is not None:
            # Sample after every fetch: that is when the number of gathered parameters can grow.
            fetch = coordinator.fetch_sub_module

            @functools.wraps(fetch)
            def fetch_and_sample(*args, **kwargs):
                result = fetch(*args, **kwargs)
                self._sample()
                return result

            coordinator.fetch_sub_module = fetch_and_sample

    def _coordinator(self):
        offload = getattr(self.optimizer, "parameter_offload", None)
        return offload.get_param_coordinator() if offload is not None else None

    def _sample(self):
        """Parameters gathered whole right now, not counting the persistent ones (always whole)."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        elements = bytes_ = 0
        for param in self.engine.module.parameters():
            if getattr(param, "ds_status", None) == ZeroParamStatus.AVAILABLE and not param.ds_persist:
                elements += param.ds_numel
                bytes_ += param.ds_numel * param.element_size()
        if elements > self.gathered_peak_elements:
            self.gathered_peak_elements, self.gathered_peak_bytes = elements, bytes_

    def bucket_bytes(self) -> int:
        """The contiguous gradient buckets (stage 1-2: one, or two with overlap_comm; stage 3: one),
        each of reduce_bucket_size elements."""
        buckets = getattr(self.optimizer, "ipg_buckets", None) or {}
        total = 0
        for bucket in buckets.values():
            buffers = bucket.buffer if isinstance(bucket.buffer, list) else [bucket.buffer]
            total += sum(t.numel() * t.element_size() for t in buffers if t is not None)
        return total

    def persistent(self) -> tuple[int, int]:
        """(elements, bytes) of ZeRO-3 parameters below stage3_param_persistence_threshold: every rank
        keeps them whole and never gathers them."""
        params = [p for p in self.engine.module.parameters() if getattr(p, "ds_persist", False)]
        return sum(p.ds_numel for p in params), sum(p.ds_numel * p.element_size() for p in params)

    def report(self) -> dict:
        persistent_elements, persistent_bytes = self.persistent()
        inner = getattr(self.optimizer, "optimizer", self.optimizer)   # the optimizer that steps (AdamW, CPU Adam)
        return dict(stage=self.stage, step_optimizer=type(inner).__name__,
                    bucket_bytes=max(self.bucket_peak_bytes, self.bucket_bytes()),
                    gathered_peak_elements=self.gathered_peak_elements, gathered_peak_bytes=self.gathered_peak_bytes,
                    persistent_elements=persistent_elements, persistent_bytes=persistent_bytes)
