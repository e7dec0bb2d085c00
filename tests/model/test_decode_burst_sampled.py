"""Sampled decode bursts: requests that sample with only a temperature
(`SamplingParams.plain`, the OpenAI API's default of temperature 1) burst as greedy ones do,
each step's token the race of `Sampler.plain` with Exp(1) draws made before the call. A
seeded request's tokens equal those of bursts off: alone and beside greedy and other seeded
requests, through stop tokens, an interrupt that ends a burst early and a burst that fails
(its generator stands where one step at a time leaves it); the draws made ahead are capped
(`BURST_DRAW_BYTES`); top-k, top-p and min-p keep one token a step."""

from __future__ import annotations

import pytest

from pagoda import SamplingParams
from pagoda.engine.output_processor import OutputKind
from pagoda.ops import quant_cpu
from pagoda.worker import model_runner
from tests.model.test_decode_burst import (
    BURST,
    _burst_rows,
    _check_equal_with_bursts,
    _engine,
    _needs_kernels,
    _prompts,
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
    prompts = _prompts(4, seed=22)
    params = [SamplingParams(max_tokens=45, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.5, seed=6, ignore_eos=True),
              SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)]
    first = run(_engine(model, 1), list(zip(prompts, params, strict=True)))[0]
    stop = first[1][0][20]  # request 1's 21st token: inside a burst
    params[1] = SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True,
                               stop_token_ids=[stop])
    requests = list(zip(prompts, params, strict=True))
    want = run(_engine(model, 1), requests)
    calls = _burst_rows(monkeypatch)
    got = run(_engine(model, BURST), requests)
    assert got[0] == want[0]
    assert got[0][1][2] == "stop" and got[0][1][3] == stop
    assert got[1] < want[1]
    assert max(rows for rows, _ in calls) == 4 and max(steps for _, steps in calls) == BURST


def test_interrupted_sampled_burst_keeps_the_seeded_stream(tiny_model, monkeypatch) -> None:
    """A burst ended after one step by the interrupt flag drew for all its steps ahead: the
    request's generator is set back to where one step leaves it, so the tokens after it
    are still those of bursts off."""
    from pagoda.models.fused_decoder import FusedDecoderStack

    _needs_kernels(dense=True)
    model = str(tiny_model("LlamaForCausalLM"))
    prompt = _prompts(1, seed=23)[0]
    params = SamplingParams(max_tokens=50, temperature=0.9, seed=7, ignore_eos=True)
    (want,), _, _ = run(_engine(model, 1), [(prompt, params)])
    engine = _engine(model, BURST)
    flag = engine.burst_interrupt
    real, calls = FusedDecoderStack.burst, []

    def interrupted(self, *args, **kwargs):
        if len(calls) in (1, 3):
            flag.set()
        tokens = real(self, *args, **kwargs)
        calls.append(len(tokens[0]))
        flag.clear()
        return tokens

    monkeypatch.setattr(FusedDecoderStack, "burst", interrupted)
    (got,), _, _ = run(engine, [(prompt, params)])
    assert calls[:4] == [BURST, 1, BURST, 1]
    assert got == want


def test_failed_sampled_burst_keeps_the_seeded_stream(tiny_model, monkeypatch) -> None:
    """A burst that raises after its draws and its K/V writes: the step rolls back, the
    generator stands before the burst's draws, and the request ends with a fault-free
    run's tokens."""
    from pagoda.models.fused_decoder import FusedDecoderStack

    _needs_kernels(dense=True)
    model = str(tiny_model("LlamaForCausalLM"))
    prompt = _prompts(1, seed=24)[0]
    params = SamplingParams(max_tokens=40, temperature=1.1, seed=8, ignore_eos=True)
    (want,), _, _ = run(_engine(model, 1, prefix=True), [(prompt, params)])
    engine = _engine(model, BURST, prefix=True)
    real, calls = FusedDecoderStack.burst, []

    def failing(self, *args, **kwargs):
        tokens = real(self, *args, **kwargs)
        calls.append(tokens)
        if len(calls) == 2:
            raise RuntimeError("injected burst fault")
        return tokens

    monkeypatch.setattr(FusedDecoderStack, "burst", failing)
    engine.add_request("0", {"prompt_token_ids": prompt}, params,
                       output_kind=OutputKind.CUMULATIVE)
    final, failed = None, False
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                final = out
        except RuntimeError as e:
            assert "injected burst fault" in str(e) and not failed
            failed = True
        engine.check_integrity()
    assert failed and len(calls) > 2
    assert engine.kv_cache_manager.usage == 0.0
    assert list(final.outputs[0].token_ids) == want[0]


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


def test_no_bursts_where_sampling_cuts_the_distribution(tiny_model) -> None:
    """top-k, top-p and min-p see every step's sorted or scaled distribution: one token a
    step."""
    _needs_kernels(dense=True)
    model = str(tiny_model("LlamaForCausalLM"))
    engine = _engine(model, BURST)
    prompt = _prompts(1, seed=26)[0]
    for params in (SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=1,
                                  ignore_eos=True),
                   SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=1,
                                  ignore_eos=True),
                   SamplingParams(max_tokens=20, temperature=0.8, min_p=0.1, seed=1,
                                  ignore_eos=True)):
        _, steps, tokens = run(engine, [(prompt, params)])
        assert steps == tokens == 20
