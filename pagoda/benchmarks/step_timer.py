"""Timers around one engine's phases, for `pagoda bench profile`.

Nothing here runs unless a profile installs it: `StepInstrumentation` wraps the methods of
one engine's instances (scheduler, runner, model modules, attention backends) and, for
the duration of the `with` block only, a few class attributes (`Op.__call__`, `Op.select`,
the incremental detokenizer's two methods); leaving the block puts every original back.
The engine's code carries no instrumentation of its own, so profiling off costs nothing.

Times are exclusive: a region's seconds less those of the timed regions inside it (the
attention backend's time excludes the fused KV write it calls, the forward's "other"
is what remains after GEMMs, attention and fused ops: embedding, views, the layer loop).
With the fused decoder stack (models/fused_decoder.py) a layer's GEMMs and fused ops are
one C++ call, timed as "forward: layer calls"; its one-call decode path (every layer and
its attention in one call) is off inside the `with`, so attention stays a phase of its own.
CPU ops are synchronous, so wall-clock timers measure the work itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Self

from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.layers.linear import LinearBase
from pagoda.ops.registry import Op

PHASES = (
    "scheduling",
    "input preparation",
    "forward: GEMMs",
    "forward: attention",
    "forward: fused ops",
    "forward: layer calls",
    "forward: other",
    "lm_head",
    "sampling",
    "output processing",
    "detokenization",
    "step: other",
)
_ATTENTION_OPS = frozenset({"paged_attention", "paged_prefill_attention"})
# The quantized linears' ops: GEMM time wherever a layer calls them (not "fused ops").
_GEMM_OPS = frozenset({"gguf_linear", "wq_linear", "int8_linear", "fp8_linear"})


class PhaseClock:
    """Exclusive seconds per phase, accumulated over the wrapped calls."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._stack: list[list[float]] = []  # [start, seconds of timed children]

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn, timed under `phase`."""
        stack, clock = self._stack, time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [clock(), 0.0]
            stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()
                elapsed = clock() - frame[0]
                self.seconds[phase] += elapsed - frame[1]
                if stack:
                    stack[-1][1] += elapsed

        return timed


class StepInstrumentation:
    """`with StepInstrumentation(engine) as inst:` times the engine's steps into
    `inst.clock`; with `inst.record_dispatch` true it also notes which kernel each op ran
    (`inst.dispatch`: op name -> kernel names) and the last step's scheduled tokens."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.clock = PhaseClock()
        self.record_dispatch = False
        self.dispatch: dict[str, set[str]] = {}
        self.num_scheduled_tokens: list[int] = []
        self._in_head = False  # inside the model's compute_logits
        # (object, attribute, the instance's own value before: None if it had none)
        self._instance_patches: list[tuple[Any, str, Any]] = []
        self._class_patches: list[tuple[type, str, Any]] = []

    # ---- installing ------------------------------------------------------------------
    def _patch(self, obj: Any, name: str, phase: str, fn: Any = None) -> None:
        """obj.name (or fn in its place), timed, as an instance attribute."""
        self._instance_patches.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, self.clock.wrap(phase, fn or getattr(obj, name)))

    def _patch_class(self, cls: type, name: str, new: Any) -> None:
        self._class_patches.append((cls, name, cls.__dict__[name]))
        setattr(cls, name, new)

    def __enter__(self) -> Self:
        engine = self.engine
        runner = engine.executor.worker.runner
        self._patch(engine, "step", "step: other")
        self._patch(engine.scheduler, "update_from_output", "output processing")
        self._patch(engine.output_processor, "process", "output processing")
        schedule = engine.scheduler.schedule

        def counted_schedule() -> Any:
            out = schedule()
            self.num_scheduled_tokens.append(out.total_num_scheduled_tokens)
            return out

        self._patch(engine.scheduler, "schedule", "scheduling", counted_schedule)
        for name in ("_update_states", "_step_batch", "_prepare_inputs"):
            self._patch(runner, name, "input preparation")
        self._patch(runner, "_sample", "sampling")
        self._patch(runner, "sampler", "sampling")
        model = runner.model
        self._patch(model, "forward", "forward: other")
        compute_logits = model.compute_logits

        def head(*args: Any, **kwargs: Any) -> Any:
            # NOTE: the head's own op calls (a quantized head's gguf_linear) are lm_head time,
            # not "fused ops": `call` below leaves them untimed while this flag is set.
            self._in_head = True
            try:
                return compute_logits(*args, **kwargs)
            finally:
                self._in_head = False

        self._patch(model, "compute_logits", "lm_head", head)
        stack = model.fused_stack() if hasattr(model, "fused_stack") else None
        if stack is not None:
            # NOTE: the GEMMs and fused ops between two attention calls in one C++ call.
            for name in ("qkv", "mlp", "mlp_qkv"):
                self._patch(stack, name, "forward: layer calls")
            # NOTE: timed steps run decode layer by layer, so that attention is its own
            # phase; the one-call decode path's step is timed apart (step_profile.py).
            self._patch(stack, "_decodes_in_one_call", "forward: other",
                        lambda *args: False)
        for module in model.modules():
            if isinstance(module, LinearBase):
                self._patch(module, "forward", "forward: GEMMs")
            attn = getattr(module, "attn", None)
            if attn is not None and hasattr(attn, "forward"):
                self._patch(attn, "forward", "forward: attention")
        self._install_class_patches()
        return self

    def _install_class_patches(self) -> None:
        clock, original_call, original_select = self.clock, Op.__call__, Op.select
        fused = clock.wrap("forward: fused ops", original_call)
        attention = clock.wrap("forward: attention", original_call)
        gemm = clock.wrap("forward: GEMMs", original_call)

        def note(op: Op, args: tuple) -> None:
            if self.record_dispatch:
                chosen = op.select_kernel(*args)
                name = "reference (PyTorch)" if chosen is None else chosen[0].name
                self.dispatch.setdefault(op.name, set()).add(name)

        def call(op: Op, *args: Any) -> Any:
            note(op, args)
            if self._in_head:
                return original_call(op, *args)
            if op.name in _GEMM_OPS:
                return gemm(op, *args)
            return (attention if op.name in _ATTENTION_OPS else fused)(op, *args)

        def select(op: Op, *args: Any) -> Any:
            note(op, args)
            return original_select(op, *args)

        self._patch_class(Op, "__call__", call)
        self._patch_class(Op, "select", select)
        for name in ("update", "get_next_output_text"):
            method = IncrementalDetokenizer.__dict__[name]
            self._patch_class(IncrementalDetokenizer, name, clock.wrap("detokenization", method))

    def __exit__(self, *exc: object) -> None:
        for obj, name, own in reversed(self._instance_patches):
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)
        for cls, name, original in reversed(self._class_patches):
            setattr(cls, name, original)
        self._instance_patches.clear()
        self._class_patches.clear()

