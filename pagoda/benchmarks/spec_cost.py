"""The cost model of the adaptive rule (spec_decode/adaptive.py), fitted on the decode steps
of one `pagoda bench spec` run (every configuration's, so the ratios come from one machine
state; the absolute times move with the other jobs on it).

A decode step (every scheduled request decoding: one token, plus its drafts if it
verifies) is recorded with its requests B, tokens T, verifying requests V and its time,
the proposer's call timed apart. Least squares then give
    step time less proposing = t0 + t1 T + tv V
over all configurations' steps, and per proposer
    proposing time = a k + b k B + c B
(k: the drafts asked for). Divided by t0 these are the rule's ratios: rho = t1 / t0,
nu = tv / t0, and the proposer's (per_draft, per_draft_request, per_request).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class StepRecord:
    config: str
    num_reqs: int
    num_tokens: int
    num_verifying: int
    seconds: float  # the step's wall time less the proposer's call
    propose_s: float
    propose_k: int  # drafts asked of the proposer (0: not called)


class StepRecorder:
    """Wraps one engine's `schedule` and its proposer's `propose` to record each decode
    step; `finish_step(seconds)` after each `engine.step()`. `restore()` unwraps."""

    def __init__(self, engine: Any, config: str) -> None:
        self.config, self.records = config, []
        self._sched = engine.scheduler
        self._schedule = self._sched.schedule
        self._proposer = getattr(engine.executor.worker.runner, "proposer", None)
        self._propose = self._proposer.propose if self._proposer is not None else None
        self._current: tuple[int, int, int] | None = None
        self._propose_s, self._propose_k = 0.0, 0
        self._sched.schedule = self._timed_schedule
        if self._proposer is not None:
            self._proposer.propose = self._timed_propose

    def _timed_schedule(self) -> Any:
        out = self._schedule()
        spec = out.scheduled_spec_decode_tokens
        decode = not out.scheduled_new_reqs and all(
            n == 1 + len(spec.get(r, ())) for r, n in out.num_scheduled_tokens.items())
        self._current = (len(out.num_scheduled_tokens), out.total_num_scheduled_tokens,
                         len(spec)) if decode and out.num_scheduled_tokens else None
        self._propose_s, self._propose_k = 0.0, 0
        return out

    def _timed_propose(self, batch: Any, slots: Any, num_tokens: int) -> list[list[int]]:
        start = time.perf_counter()
        drafts = self._propose(batch, slots, num_tokens)
        self._propose_s += time.perf_counter() - start
        self._propose_k = num_tokens
        return drafts

    def finish_step(self, seconds: float) -> None:
        if self._current is not None:
            b, t, v = self._current
            self.records.append(StepRecord(self.config, b, t, v, seconds - self._propose_s,
                                           self._propose_s, self._propose_k))
        self._current = None

    def restore(self) -> None:
        self._sched.schedule = self._schedule
        if self._proposer is not None:
            self._proposer.propose = self._propose


def _lstsq(columns: list[np.ndarray], y: np.ndarray) -> list[float]:
    coef, *_ = np.linalg.lstsq(np.stack(columns, axis=1), y, rcond=None)
    return [float(c) for c in coef]


def fit_costs(records: list[StepRecord]) -> dict[str, Any]:
    """t0, t1, tv (seconds) and per configuration with a proposer its (a, b, c), with the
    ratios the rule reads; {} without enough steps."""
    if len(records) < 8:
        return {}
    tokens = np.array([r.num_tokens for r in records], dtype=np.float64)
    verifying = np.array([r.num_verifying for r in records], dtype=np.float64)
    y = np.array([r.seconds for r in records])
    t0, t1, tv = _lstsq([np.ones_like(y), tokens, verifying], y)
    result: dict[str, Any] = {"num_steps": len(records), "t0_s": t0, "t1_s": t1, "tv_s": tv,
                              "token_ratio": t1 / t0, "verify_ratio": tv / t0, "propose": {}}
    for config in sorted({r.config for r in records}):
        called = [r for r in records if r.config == config and r.propose_k > 0]
        if len(called) < 4:
            continue
        k = np.array([r.propose_k for r in called], dtype=np.float64)
        b = np.array([r.num_reqs for r in called], dtype=np.float64)
        a_, b_, c_ = _lstsq([k, k * b, b], np.array([r.propose_s for r in called]))
        result["propose"][config] = {"num_steps": len(called), "seconds": (a_, b_, c_),
                                     "ratios": (a_ / t0, b_ / t0, c_ / t0)}
    return result


def print_costs(fit: dict[str, Any]) -> None:
    if not fit:
        print("cost model: too few decode steps to fit")
        return
    print(f"cost model over {fit['num_steps']} decode steps: t0 = {fit['t0_s'] * 1e3:.2f} ms, "
          f"t1 = {fit['t1_s'] * 1e3:.3f} ms per token (rho = {fit['token_ratio']:.4f}), "
          f"tv = {fit['tv_s'] * 1e3:.3f} ms per verifying request "
          f"(nu = {fit['verify_ratio']:.4f})")
    for config, p in fit["propose"].items():
        a, b, c = p["ratios"]
        print(f"  propose, {config} ({p['num_steps']} steps): per draft {a:.4f}, per draft "
              f"per request {b:.4f}, per request {c:.4f} (units of t0)")
