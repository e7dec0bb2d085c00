"""The engine's only way to its workers: one call per step, `execute_model(scheduler_output)
-> ModelRunnerOutput`, plus the KV cache sizing at start-up.

Executors live in a registry by name (`EngineConfig.distributed_executor_backend`): "uni"
holds one Worker in this process (with async scheduling on its own thread,
worker/step_thread.py). A multi-process executor (one worker per rank) plugs in
behind the same calls; so nothing in the engine touches a worker's model or tensors except
through these methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from pagoda.config import EngineConfig
from pagoda.core.kv_cache_spec import KVCacheSpec
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.models.loader import Checkpoint
from pagoda.worker.burst_interrupt import BurstInterrupt
from pagoda.worker.model_runner import ModelRunnerOutput
from pagoda.worker.step_thread import StepThread
from pagoda.worker.worker import Worker

T = TypeVar("T")


class Executor(ABC):
    """Start-up: `kv_cache_specs()`, `determine_num_blocks()`, `initialize_kv_cache(...)`;
    then `execute_model(...)` (or `submit_model(...)`, async scheduling) once per step;
    `shutdown()` at the end."""

    def __init__(
        self, config: EngineConfig, ckpt: Checkpoint, max_model_len: int, eos_token_ids: set[int]
    ) -> None:
        self.config = config

    @abstractmethod
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """The model's KV cache layer groups (identical on every worker)."""

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """Device blocks every worker can hold (the smallest over workers)."""

    @abstractmethod
    def initialize_kv_cache(
        self, num_blocks: int, num_swap_blocks: int | None, num_host_tier_blocks: int | None
    ) -> None:
        """Allocate the KV tensors: `num_blocks` on the device, and the host buffers of the
        swap pool and of the prefix cache's host tier (None: no such buffer)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the block copies it lists happen first."""

    def supports_decode_burst(self) -> bool:
        """Whether the workers run decode bursts (`SchedulerOutput.decode_bursts`); after
        `initialize_kv_cache`."""
        return False

    def burst_interrupt(self) -> BurstInterrupt | None:
        """The flag that ends the workers' decode bursts early, which any thread may raise
        (worker/burst_interrupt.py); None where bursts do not run."""
        return None

    def submit_model(self, scheduler_output: SchedulerOutput) -> Future:
        """Start one step and return the future of its ModelRunnerOutput: steps run one
        after another in submission order, each after the previous one's forward (the
        scheduler's accounting relies on it). Here: run at once."""
        future: Future = Future()
        try:
            future.set_result(self.execute_model(scheduler_output))
        except Exception as e:  # noqa: BLE001 - raised by future.result()
            future.set_exception(e)
        return future

    def cancel_pending(self) -> None:
        """Drop the submitted steps that have not started (after a failed step); the
        steps submitted afterwards run as usual. Here: none is ever pending."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device the (first) worker runs on."""

    def kv_pools(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """This process's KV tensors by pool ("kv_pool", "swap_pool", "host_tier_pool"),
        for memory reports; an executor whose workers run elsewhere has none here."""
        return {}

    def shutdown(self) -> None:
        """Release the workers (nothing to do in-process)."""


ExecutorClass = type[Executor]
EXECUTORS: dict[str, ExecutorClass] = {}


def register_executor(name: str) -> Callable[[ExecutorClass], ExecutorClass]:
    def wrap(cls: ExecutorClass) -> ExecutorClass:
        EXECUTORS[name] = cls
        return cls

    return wrap


def get_executor_class(name: str) -> ExecutorClass:
    if name not in EXECUTORS:
        raise ValueError(
            f"distributed_executor_backend must be one of {sorted(EXECUTORS)}, got {name!r}"
        )
    return EXECUTORS[name]


@register_executor("uni")
class UniProcExecutor(Executor):
    """One Worker in this process; with async scheduling it lives on a StepThread, which
    runs every call that touches it (the model is built there too)."""

    def __init__(
        self, config: EngineConfig, ckpt: Checkpoint, max_model_len: int, eos_token_ids: set[int]
    ) -> None:
        super().__init__(config, ckpt, max_model_len, eos_token_ids)
        self.step_thread = StepThread() if config.scheduler.async_scheduling else None
        self.worker = self._on_worker(Worker, config, ckpt, max_model_len, eos_token_ids)

    def _on_worker(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args) if self.step_thread is None else self.step_thread.call(fn, *args)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return self._on_worker(self.worker.kv_cache_specs)

    def determine_num_blocks(self) -> int:
        return self._on_worker(self.worker.determine_num_blocks)

    def supports_decode_burst(self) -> bool:
        return self._on_worker(self.worker.supports_decode_burst)

    def burst_interrupt(self) -> BurstInterrupt | None:
        # NOTE: with a step thread (async scheduling) the scheduler never bursts.
        if self.step_thread is not None or not self.supports_decode_burst():
            return None
        return self.worker.burst_interrupt()

    def initialize_kv_cache(
        self, num_blocks: int, num_swap_blocks: int | None, num_host_tier_blocks: int | None
    ) -> None:
        self._on_worker(self.worker.initialize_kv_cache, num_blocks, num_swap_blocks,
                        num_host_tier_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._on_worker(self.worker.execute_model, scheduler_output)

    def submit_model(self, scheduler_output: SchedulerOutput) -> Future:
        if self.step_thread is None:
            return super().submit_model(scheduler_output)
        return self.step_thread.submit(self.worker.execute_model, scheduler_output)

    def cancel_pending(self) -> None:
        if self.step_thread is not None:
            self.step_thread.cancel_pending()

    def shutdown(self) -> None:
        if self.step_thread is not None:
            self.step_thread.shutdown()

    @property
    def device(self) -> torch.device:
        return self.worker.device

    def kv_pools(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        w = self.worker
        return {"kv_pool": w.kv_caches, "swap_pool": w.host_kv_caches,
                "host_tier_pool": w.host_tier_kv_caches}
