"""Sampled decode bursts: requests that sample with a temperature and truncation only
(`SamplingParams.plain`, the OpenAI API's default of temperature 1) burst as greedy ones do,
each step's token the race of `Sampler.plain` with Exp(1) draws made before the call. A
seeded request's tokens equal those of bursts off: alone and beside greedy and other seeded
requests, through stop tokens (an interrupt that ends a burst early and a burst that fails,
where the generator must stand as one step at a time leaves it: test_decode_burst.py's
tests, seeded); the draws made ahead are capped
(`BURST_DRAW_BYTES`); top-k, top-p and min-p requests burst with the cut in the kernel,
penalised and biased ones with the processing in it."""

from __future__ import annotations

import pytest

from pagoda import SamplingParams
from pagoda.ops import quant_cpu
from pagoda.worker import model_runner
from tests.model.test_decode_burst import (
    BURST,
    _burst_rows,
    _check_equal_with_bursts,
    _engine,
    _needs_kernels,
    _prompts,
    check_concurrent_with_a_stop,
    run,
)


def test_smollm2_seeded_sampled_bursts_equal_step_by_step() -> None:
    """The default model, one request at a time: seeded requests at three temperatures,
    ending on eos or max_tokens, and a greedy one between them."""
    _needs_kernels()
    if quant_cpu.resolve() is None:
        pytest.skip("the quant CPU kernels do not run here")
    prompts = _prompts(4, seed=21)
    requests = [
        (prompts[0], SamplingParams(max_tokens=40, temperature=0.7, seed=1)),
        (prompts[1], SamplingParams(max_tokens=35, temperature=1.0, seed=2, ignore_eos=True)),
        (prompts[2], SamplingParams(max_tokens=30, temperature=0)),
        (prompts[3], SamplingParams(max_tokens=33, temperature=1.3, seed=3, ignore_eos=True)),
    ]
    _check_equal_with_bursts(None, requests)


def test_greedy_and_seeded_rows_burst_together(tiny_model, monkeypatch) -> None:
    """Four requests at once, two greedy and two seeded (one ending on a stop token inside
    a burst): 4-row bursts of the tokens of bursts off, in fewer steps."""
    _needs_kernels(dense=True)
    model = str(tiny_model("LlamaForCausalLM"))
    params = [SamplingParams(max_tokens=45, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.5, seed=6, ignore_eos=True),
              SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)]
    check_concurrent_with_a_stop(model, _prompts(4, seed=22), params, monkeypatch)


def test_sampled_draws_ahead_are_capped(tiny_model, monkeypatch) -> None:
    """BURST_DRAW_BYTES cuts a sampled burst's steps (the tokens stay those of bursts off);
    where fewer than 2 steps fit, it runs one token a step. Unseeded requests burst too."""
    _needs_kernels(dense=True)
    model = str(tiny_model("LlamaForCausalLM"))
    prompts = _prompts(2, seed=25)
    seeded = [(p, SamplingParams(max_tokens=30, temperature=1.0, seed=9 + i, ignore_eos=True))
              for i, p in enumerate(prompts)]
    want = run(_engine(model, 1), seeded)
    engine = _engine(model, BURST)
    vocab = engine.vocab_size
    monkeypatch.setattr(model_runner, "BURST_DRAW_BYTES", 3 * 2 * vocab * 4)
    calls = _burst_rows(monkeypatch)
    got = run(engine, seeded)
    assert got[0] == want[0] and got[1] < want[1]
    assert calls and max(steps for _, steps in calls) == 3
    monkeypatch.setattr(model_runner, "BURST_DRAW_BYTES", 2 * 2 * vocab * 4 - 1)
    calls.clear()
    assert run(engine, seeded)[1:] == (30, 60) and not calls  # 2 tokens a step
    monkeypatch.setattr(model_runner, "BURST_DRAW_BYTES", 64 << 20)
    unseeded = [(p, SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True))
                for p in prompts]
    results, steps, tokens = run(engine, unseeded)
    assert tokens == 60 and steps < 30 and calls
    assert all(0 <= t < vocab for r in results for t in r[0])


def test_truncated_requests_burst(tiny_model, monkeypatch) -> None:
    """top-k, top-p and min-p requests burst: the kernel cuts each step's distribution as
    the sampler does (ops.truncate_rows' kernel), so seeded ones give the tokens of bursts
    off. top-k 1 at temperature 1.5 is greedy, which it would not be without the cut."""
    _needs_kernels(dense=True)
    model = str(tiny_model("LlamaForCausalLM"))
    prompts = _prompts(5, seed=26)

    def params(**kwargs) -> SamplingParams:
        return SamplingParams(max_tokens=30, ignore_eos=True, **kwargs)

    requests = [(prompts[0], params(temperature=0.8, top_p=0.9, seed=1)),
                (prompts[1], params(temperature=0.8, top_k=20, seed=2)),
                (prompts[2], params(temperature=1.0, min_p=0.1, seed=3)),
                (prompts[3], params(temperature=1.2, top_k=40, top_p=0.8, min_p=0.05, seed=4)),
                (prompts[4], params(temperature=1.5, top_k=1, seed=5))]
    _check_equal_with_bursts(model, requests)
    engine = _engine(model, BURST)
    calls = _burst_rows(monkeypatch)
    greedy = run(engine, [(prompts[4], params(temperature=0))])[0]
    assert run(engine, [requests[4]])[0][0][0] == greedy[0][0] and calls
    # Greedy, plain and truncated rows in one burst, one ending on a stop token inside it.
    mixed = [params(temperature=0), params(temperature=0.9, top_p=0.85, seed=7),
             SamplingParams(max_tokens=12, temperature=1.1, top_k=15, seed=8, ignore_eos=True),
             params(temperature=1.0, seed=9)]
    check_concurrent_with_a_stop(model, prompts[:4], mixed, monkeypatch)


def test_penalised_requests_burst(tiny_model, monkeypatch) -> None:
    """Repetition, frequency and presence penalties and logit_bias burst: the kernel
    processes each step's logits as the sampler does (ops.penalize_rows' kernel) and counts
    each step's token for the next, so greedy and seeded requests give the tokens of bursts
    off. Greedy requests whose bias puts two tokens ahead of the rest, and whose penalty
    then steers between them, depend on the counting inside a burst (these equalities fail
    where the burst leaves its tables as they were); a bias of 100 wins every step."""
    _needs_kernels(dense=True)
    model = str(tiny_model("LlamaForCausalLM"))
    prompts = [[t for t in p if t not in (5, 17)] for p in _prompts(7, seed=27)]

    def params(**kwargs) -> SamplingParams:
        return SamplingParams(max_tokens=30, ignore_eos=True, **kwargs)

    requests = [
        (prompts[0], params(temperature=0, frequency_penalty=1.0,
                            logit_bias={5: 20.0, 17: 19.5})),
        (prompts[1], params(temperature=0, repetition_penalty=1.5,
                            logit_bias={5: 20.0, 17: 15.0})),
        (prompts[2], params(temperature=0, presence_penalty=2.0,
                            logit_bias={5: 20.0, 17: 19.0})),
        (prompts[3], params(temperature=0, logit_bias={42: 100.0})),
        (prompts[4], params(temperature=0.9, frequency_penalty=0.7, seed=1)),
        (prompts[5], params(temperature=1.1, top_p=0.9, repetition_penalty=1.2,
                            frequency_penalty=-0.3, presence_penalty=0.4,
                            logit_bias={5: 3.0, 17: -2.0}, seed=2)),
        (prompts[6], params(temperature=0.8, repetition_penalty=0.8, min_tokens=12, seed=3))]
    outputs = _check_equal_with_bursts(model, requests)
    assert all(5 in out and 17 in out for out in outputs[:3])
    assert outputs[3] == [42] * 30
    # Penalised, plain and greedy rows in one burst, one ending on a stop token inside it.
    mixed = [params(temperature=0, frequency_penalty=1.0, logit_bias={5: 20.0, 17: 19.5}),
             params(temperature=0.9, repetition_penalty=1.1, seed=7),
             SamplingParams(max_tokens=12, temperature=1.1, top_k=15, seed=8, ignore_eos=True),
             params(temperature=1.0, logit_bias={3: 1.5}, seed=9)]
    check_concurrent_with_a_stop(model, prompts[:4], mixed, monkeypatch)

