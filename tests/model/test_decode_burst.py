"""Decode bursts (`decode_burst`, core/scheduler.py): while nothing waits, greedy requests
(sampled ones: test_decode_burst_sampled.py)
in decode run several decode steps in one engine step, in one extension call
(`decoder_decode_burst`), alone or several together. Its tokens
are those of one step at a time: token ids, text, finish and stop reasons equal with bursts
on and off, on the embedded SmolLM2 GGUF (quantized head and token table), tiny GGUF files
with Q4_0 / Q4_1 / Q8_0 tied tables, and tiny bf16 models (dense packed heads, tied and
untied, a sliding window, int4 projections in one OpenMP region), through stop tokens, max_tokens, max_model_len, a request arriving during a
run, an abort, prefix caching, a model step that declines a burst, and a row whose burst
slots the pool refuses. A raised interrupt flag (a command in the serving loop) ends a
burst after its step. The block accounting
holds after every step and nothing is left when the requests end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs
from pagoda.engine.output_processor import OutputKind
from pagoda.ops import cpu_kernels, quant_cpu
from tests.helpers import bf16_packs

BURST = 8


def _needs_kernels(dense: bool = False) -> None:
    if cpu_kernels.kernels_disabled() or cpu_kernels.kernel_for("fused_ops") is None:
        pytest.skip("the fused-op kernels do not run here: no decode stack, so no bursts")
    if dense and not bf16_packs():
        pytest.skip("oneDNN packs no bf16 weight on this CPU: a dense model has no stack")


def _engine(model: str | None, burst: int, **kwargs):
    engine = LLM(model, dtype="bfloat16", enable_prefix_caching=kwargs.pop("prefix", False),
                 decode_burst=burst, **kwargs).llm_engine
    return engine


def run(engine, requests, arrivals=None, abort_at=None):
    """requests: [(prompt ids, SamplingParams)]; request i joins once arrivals[i] holds:
    None (at once), (j, n) (request j holds n tokens) or (j, None) (request j has ended);
    it is aborted once it holds abort_at[i] tokens. check_integrity after every step.
    Returns (per request (tokens, text, finish_reason, stop_reason), engine steps run,
    tokens produced).

    NOTE: conditions on token counts of the form 1 + 8 k hold at the same step with bursts
    on and off (a burst of 8 follows the first token), so the requests share the same
    steps in both runs and bf16 rounding cannot tell the runs apart."""
    arrivals = arrivals or [None] * len(requests)
    abort_at = abort_at or {}
    finals, counts, steps, added = {}, {}, 0, set()

    def due(cond) -> bool:
        if cond is None:
            return True
        j, n = cond
        return str(j) in finals if n is None else counts.get(str(j), 0) >= n

    while len(added) < len(requests) or engine.has_unfinished_requests():
        for i, (prompt, params) in enumerate(requests):
            if i not in added and due(arrivals[i]):
                engine.add_request(str(i), {"prompt_token_ids": prompt}, params,
                                   output_kind=OutputKind.CUMULATIVE)
                added.add(i)
        for out in engine.step():
            n = counts[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finals[out.request_id] = out
            elif n >= abort_at.get(int(out.request_id), 1 << 30):
                (finals[out.request_id],) = engine.abort_request(out.request_id)
        steps += 1
        engine.check_integrity()
        for req in engine.scheduler.running:
            # NOTE: past its prompt a request has computed every token but its last: a
            # burst's extra tokens count as computed (none is computed twice).
            if req.num_computed_tokens >= req.num_prompt_tokens:
                assert req.num_computed_tokens == req.num_tokens - 1
    assert engine.kv_cache_manager.usage == 0.0
    results = [(list(c.token_ids), c.text, c.finish_reason, c.stop_reason)
               for c in (finals[str(i)].outputs[0] for i in range(len(requests)))]
    return results, steps, sum(len(r[0]) for r in results)


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (int(k),), generator=gen).tolist()
            for k in torch.randint(5, 60, (n,), generator=gen)]


def _one_at_a_time(engine, requests):
    """Each request alone (arrivals far apart), so every one of them may burst."""
    got = []
    for prompt, params in requests:
        results, steps, tokens = run(engine, [(prompt, params)])
        got.append((results[0], steps, tokens))
    return got


def _check_equal_with_bursts(model: str | None, requests, **kwargs) -> list[list[int]]:
    on = _engine(model, BURST, **kwargs)
    assert on.scheduler.decode_burst == BURST, "the model should run decode bursts here"
    burst = _one_at_a_time(on, requests)
    off = _engine(model, 1, **kwargs)
    assert off.scheduler.decode_burst == 1
    plain = _one_at_a_time(off, requests)
    assert [r for r, _, _ in burst] == [r for r, _, _ in plain]
    # Without bursts every decode step is one token; with them, a run of many tokens
    # takes fewer steps than it has tokens.
    assert all(steps == tokens for _, steps, tokens in plain)
    long_runs = [(steps, tokens) for _, steps, tokens in burst if tokens > 2 * BURST]
    assert long_runs and all(steps < tokens for steps, tokens in long_runs)
    return [r[0] for r, _, _ in burst]  # each request's tokens


def test_smollm2_gguf_bursts_equal_step_by_step() -> None:
    """The default model: a Q8_0 tied head (the token table's lookups through the quant
    extension's dequant_rows) and Q4_1 projections in one OpenMP region."""
    _needs_kernels()
    if quant_cpu.resolve() is None:
        pytest.skip("the quant CPU kernels do not run here")
    reference = _engine(None, 1)
    prompt = reference.tokenizer.encode("The capital of France is")
    (free_run,), _, _ = run(reference, [(prompt, SamplingParams(max_tokens=40,
                                                                temperature=0))])
    # NOTE: a token that first appears mid-run, past the first burst: a stop inside one.
    tokens = free_run[0]
    stop = next(t for i, t in enumerate(tokens) if i >= 10 and i % 8 != 1
                and t not in tokens[:i])
    requests = [
        (prompt, SamplingParams(max_tokens=40, temperature=0)),
        (prompt, SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop])),
        (prompt, SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)),
        (prompt, SamplingParams(max_tokens=1, temperature=0)),
        (reference.tokenizer.encode("1, 2, 3,"), SamplingParams(max_tokens=30, temperature=0,
                                                                stop=[" 9"])),
    ]
    del reference
    _check_equal_with_bursts(None, requests)


# (arch, config overrides, engine kwargs): dense bf16 models, whose stack runs the per-op
# calls inside the burst, with an untied and a tied head and a sliding window.
DENSE_CASES = [
    ("LlamaForCausalLM", {}, {}),
    ("LlamaForCausalLM", {"tie_word_embeddings": True}, {}),
    ("MistralForCausalLM", {"sliding_window": 32}, {}),
]


@pytest.mark.parametrize(("arch", "overrides", "kwargs"), DENSE_CASES)
def test_dense_bf16_bursts_equal_step_by_step(arch, overrides, kwargs, tiny_model) -> None:
    _needs_kernels(dense=True)
    model = str(tiny_model(arch, **overrides))
    prompts = _prompts(3, seed=5)
    requests = [(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                for p, n in zip(prompts, (70, 19, 2), strict=True)]
    _check_equal_with_bursts(model, requests, max_model_len=256, **kwargs)


def test_int4_one_region_bursts_equal_step_by_step(tiny_model, tmp_path: Path) -> None:
    """RTN int4 projections (one OpenMP region a step) with a dense head."""
    from pagoda.quant.calibrate.command import quantize_to_dir

    _needs_kernels()
    if quant_cpu.resolve() is None:
        pytest.skip("the quant CPU kernels do not run here")
    out = tmp_path / "rtn"
    quantize_to_dir(str(tiny_model("LlamaForCausalLM")), out, "rtn", 4, 32)
    requests = [(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
                for p in _prompts(2, seed=6)]
    _check_equal_with_bursts(str(out), requests, max_model_len=256)


def test_bursts_with_arrivals_aborts_max_model_len_and_prefix_cache(tiny_model) -> None:
    """Requests that overlap (no burst while two run), one aborted, one that ends at
    max_model_len inside a burst, and prefix caching with a prompt repeated after its
    first run (blocks its bursts computed, registered at commit): the same outputs as
    without bursts."""
    _needs_kernels(dense=True)
    model = str(tiny_model("LlamaForCausalLM"))
    a, b = _prompts(2, seed=7)
    greedy = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    requests = [(a, greedy), (b, greedy), (a, greedy), (a[:40] + b[:20], greedy),
                (b, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))]
    # 1 joins once 0 holds 17 tokens; 2 repeats 0's prompt once 0 has ended; 3 (aborted at
    # 17 tokens) once 1 has ended; 4 runs alone into max_model_len (128) once 3 has ended.
    arrivals = [None, (0, 17), (0, None), (1, None), (3, None)]
    kwargs = {"max_model_len": 128, "prefix": True}
    got = run(_engine(model, BURST, **kwargs), requests, arrivals, {3: 17})
    want = run(_engine(model, 1, **kwargs), requests, arrivals, {3: 17})
    assert got[0] == want[0]
    assert got[1] < want[1], "no step ran a burst"
    assert got[0][3][2] == "abort" and len(got[0][3][0]) == 17
    assert got[0][4][2] == "length" and len(b) + len(got[0][4][0]) == 128
    assert got[0][2][0] == got[0][0][0]  # the prefix hit changes nothing


def test_declined_burst_gives_its_slots_back(tiny_model, monkeypatch) -> None:
    """A model step that declines the burst (one token back): the scheduler frees the
    blocks it allocated ahead, so a request holds only the blocks its computed tokens
    fill, and the output is unchanged."""
    _needs_kernels(dense=True)
    model = str(tiny_model("LlamaForCausalLM"))
    prompt = _prompts(1, seed=8)[0]
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    want = run(_engine(model, 1), [(prompt, params)])[0]
    engine = _engine(model, BURST, block_size=16)
    monkeypatch.setattr(type(engine.executor.worker.model), "decode_burst",
                        lambda self, *args: None)
    engine.add_request("0", {"prompt_token_ids": prompt}, params,
                       output_kind=OutputKind.CUMULATIVE)
    final = None
    while engine.has_unfinished_requests():
        req = engine.scheduler.requests["0"]
        for out in engine.step():
            final = out
        if not req.is_finished:
            blocks = engine.kv_cache_manager.get_block_ids("0")
            assert len(blocks) == -(-req.num_computed_tokens // 16)
        engine.check_integrity()
    assert engine.kv_cache_manager.usage == 0.0
    assert list(final.outputs[0].token_ids) == want[0][0]


def test_no_bursts_where_the_logits_are_reported_or_banned(tiny_model) -> None:
    """Logprobs and min_tokens' bans see every step's logits: one token a step (requests
    that burst with penalties and truncation: test_decode_burst_sampled.py)."""
    _needs_kernels(dense=True)
    model = str(tiny_model("LlamaForCausalLM"))
    engine = _engine(model, BURST)
    prompt = _prompts(1, seed=9)[0]
    for params in (SamplingParams(max_tokens=20, temperature=0.8, seed=1, logprobs=0,
                                  ignore_eos=True),
                   SamplingParams(max_tokens=20, temperature=0, logprobs=1, ignore_eos=True),
                   SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3,
                                  logprobs=0, ignore_eos=True),
                   SamplingParams(max_tokens=20, temperature=0, min_tokens=20)):
        _, steps, tokens = run(engine, [(prompt, params)])
        assert steps == tokens == 20


def test_decode_burst_checks_its_block_table(tiny_model) -> None:
    """The extension call refuses a block table that does not hold every step's position,
    an interrupt flag that is not one byte, a sampled burst's temperature without draws or
    draws for fewer steps, and truncation without a temperature or of the wrong shape."""
    _needs_kernels(dense=True)
    engine = _engine(str(tiny_model("LlamaForCausalLM")), BURST)
    model = engine.executor.worker.model
    stack = model.fused_stack()
    kv = engine.executor.worker.kv_caches
    x = torch.zeros(1, model.spec.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="do not hold position"):
        stack.decode_burst(stack.decode, x, model.rotary.cos, model.rotary.sin,
                           torch.tensor([15]), kv,
                           torch.ones(1, 1, dtype=torch.int64), 16, model.model.norm.weight,
                           1e-5, *model._token_weights(), torch.zeros(0, dtype=torch.int64),
                           2, None, None, None, None)
    with pytest.raises(RuntimeError, match="interrupt must be a uint8"):
        stack.decode_burst(stack.decode, x, model.rotary.cos, model.rotary.sin,
                           torch.tensor([0]), kv,
                           torch.ones(1, 1, dtype=torch.int64), 16, model.model.norm.weight,
                           1e-5, *model._token_weights(), torch.zeros(0, dtype=torch.int64),
                           2, torch.zeros(1, dtype=torch.int32), None, None, None)
    vocab = engine.vocab_size
    two_steps = torch.zeros(2, 1, dtype=torch.int64)
    top_k = torch.ones(1, dtype=torch.int64)
    for temps, exps, seeds, cut, match in (
            (torch.ones(1), None, None, None, "temperature comes with exps or seeds"),
            (None, None, two_steps, None, "temperature comes with exps or seeds"),
            (torch.ones(1), torch.ones(1, 1, vocab), None, None, "exps must be"),
            (torch.ones(1), torch.ones(2, 2, vocab), None, None, "exps must be"),
            (torch.ones(1), None, two_steps[:1], None, "seeds must be"),
            (None, None, None, top_k, "top_k, top_p and min_p come with a temperature"),
            (torch.ones(1), None, two_steps, top_k[:0], "top_k must be a contiguous int64")):
        with pytest.raises(RuntimeError, match=match):
            stack.decode_burst(stack.decode, x, model.rotary.cos, model.rotary.sin,
                               torch.tensor([0]), kv, torch.ones(1, 1, dtype=torch.int64), 16,
                               model.model.norm.weight, 1e-5, *model._token_weights(),
                               torch.zeros(0, dtype=torch.int64), 2, None, temps, exps, seeds,
                               top_k=cut)


def test_decode_burst_must_be_positive() -> None:
    with pytest.raises(ValueError, match="decode_burst must be >= 1"):
        EngineArgs(decode_burst=0).create_engine_config()


# A greedy request, and a seeded sampled one: its burst draws ahead, and its generator must
# stand where one step at a time leaves it after a fault or an interrupt.
GREEDY_AND_SEEDED = [
    pytest.param({"temperature": 0}, id="greedy"),
    pytest.param({"temperature": 1.1, "seed": 8}, id="seeded"),
]


@pytest.mark.parametrize("sampling", GREEDY_AND_SEEDED)
def test_failed_burst_rolls_back_and_the_request_goes_on(sampling, tiny_model,
                                                         monkeypatch) -> None:
    """A burst that raises after writing its K/V (as a kernel error would; a seeded one
    after its draws): the step rolls back, no block it wrote is findable in the prefix
    cache, the generator stands before the burst's draws, and the request, computed again
    from its committed tokens, ends with a fault-free run's tokens."""
    from pagoda.models.fused_decoder import FusedDecoderStack

    _needs_kernels(dense=True)
    model = str(tiny_model("LlamaForCausalLM"))
    prompt = _prompts(1, seed=10)[0]
    params = SamplingParams(max_tokens=40, ignore_eos=True, **sampling)
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
            assert engine.failed_request_ids == ["0"]
        engine.check_integrity()
    assert failed and len(calls) > 2  # NOTE: bursts ran again after the fault
    assert engine.kv_cache_manager.usage == 0.0
    assert list(final.outputs[0].token_ids) == want[0]


@pytest.mark.parametrize("table_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_token_tables_burst_equal_step_by_step(table_type, tiny_model,
                                                    tmp_path: Path) -> None:
    """A tied GGUF head of each type the layout rebuilds (its lookups through the quant
    extension's dequant_rows inside the burst) over Q8_0 projections (one OpenMP region)."""
    from gguf import GGMLQuantizationType

    from tests.gguf_helpers import write_llama_gguf

    _needs_kernels()
    if quant_cpu.resolve() is None:
        pytest.skip("the quant CPU kernels do not run here")
    hf_dir = tiny_model("LlamaForCausalLM", tie_word_embeddings=True)
    path = write_llama_gguf(hf_dir, tmp_path / "tiny.gguf", qtype=GGMLQuantizationType.Q8_0,
                            qtypes={"token_embd.weight": GGMLQuantizationType[table_type]})
    requests = [(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
                for p in _prompts(2, seed=11)]
    _check_equal_with_bursts(str(path), requests, max_model_len=256, gguf_native="on")
    engine = _engine(str(path), BURST, max_model_len=256, gguf_native="on")
    model = engine.executor.worker.model
    assert model.fused_stack().decode.one_region
    head, table = model._token_weights()
    assert type(table).__name__ == "QuantWeight" and type(head).__name__ == "QuantWeight"


@pytest.mark.parametrize("sampling", GREEDY_AND_SEEDED)
def test_interrupt_ends_a_burst_after_its_step(sampling, tiny_model, monkeypatch) -> None:
    """The engine's `burst_interrupt` raised as a burst starts (a command came): the call
    ends after one step; once the flag is lowered the next burst runs whole; the tokens
    are those of one step at a time (a seeded request's generator is set back to where
    one step leaves it, though the burst drew for all its steps)."""
    from pagoda.models.fused_decoder import FusedDecoderStack

    _needs_kernels(dense=True)
    model = str(tiny_model("LlamaForCausalLM"))
    prompt = _prompts(1, seed=11)[0]
    params = SamplingParams(max_tokens=50, ignore_eos=True, **sampling)
    (want,), _, _ = run(_engine(model, 1), [(prompt, params)])
    engine = _engine(model, BURST)
    flag = engine.burst_interrupt
    assert flag is not None and not flag.is_set()
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
    assert got == want
    assert calls[:4] == [BURST, 1, BURST, 1]
    assert _engine(model, 1).burst_interrupt is None  # no bursts, no flag


class _Sink:
    """An EngineCore sink that keeps every request's outputs (cumulative token counts)."""

    def __init__(self) -> None:
        self.outputs: dict[str, list] = {}
        self.errors: list[BaseException] = []

    def deliver(self, items) -> None:
        for rid, item in items:
            if isinstance(item, BaseException):
                self.errors.append(item)
            else:
                self.outputs.setdefault(rid, []).append(item)

    def reply(self, token, result, exc) -> None:
        if exc is not None:
            self.errors.append(exc)

    def publish_stats(self, stats, added_through) -> None:
        pass

    def flush(self) -> None:
        pass

    def died(self, exc) -> None:
        self.errors.append(exc)

    def finished(self, rid: str) -> bool:
        return any(out.finished for out in self.outputs.get(rid, ()))


def test_serving_loop_commands_end_bursts(tiny_model, monkeypatch) -> None:
    """In the serving loop (engine_core.EngineCore): an abort or an add queued while a
    burst runs ends it after its step, so the new request waits one decode step, not the
    burst; a query does not; the loop lowers the flag as it takes its commands, so the
    next burst runs whole. Both requests end with their lengths and no block is left."""
    import threading
    import time

    from pagoda.engine.engine_core import (
        AbortCommand,
        AddCommand,
        CallCommand,
        EngineCore,
        EngineRequest,
    )
    from pagoda.models.fused_decoder import FusedDecoderStack

    _needs_kernels(dense=True)
    engine = _engine(str(tiny_model("LlamaForCausalLM")), BURST)
    a, b = _prompts(2, seed=12)
    greedy = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    sink = _Sink()
    core = EngineCore(engine, sink, gather_s=0.0)
    # Burst call i first sends commands[i], as if it had come from the server meanwhile.
    commands = {
        1: CallCommand(lambda e: None, token=1),
        2: AbortCommand(["not-a-request"]),
        4: AddCommand([EngineRequest("b", {"prompt_token_ids": b},
                                     SamplingParams(max_tokens=3, temperature=0,
                                                    ignore_eos=True))],
                      time.monotonic(), token=2),
    }
    real, calls = FusedDecoderStack.burst, []

    def with_arrivals(self, *args, **kwargs):
        if len(calls) in commands:
            core.send(commands[len(calls)])
        tokens = real(self, *args, **kwargs)
        calls.append(len(tokens[0]))
        return tokens

    monkeypatch.setattr(FusedDecoderStack, "burst", with_arrivals)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    try:
        core.send(AddCommand([EngineRequest("a", {"prompt_token_ids": a}, greedy)],
                             time.monotonic(), token=0))
        end = time.monotonic() + 120
        while not (sink.finished("a") and sink.finished("b")) and not sink.errors:
            assert time.monotonic() < end, "timed out"
            time.sleep(0.01)
    finally:
        core.stop()
        loop.join(30)
    assert not sink.errors
    assert calls[:5] == [BURST, BURST, 1, BURST, 1]
    # Then a and b burst together through b's last 2 tokens, and a goes on alone.
    assert calls[5:7] == [2, BURST]
    tokens = {rid: sum(len(o.outputs[0].token_ids) for o in outs)
              for rid, outs in sink.outputs.items()}
    assert tokens == {"a": 60, "b": 3}
    engine.check_integrity()
    assert engine.kv_cache_manager.usage == 0.0


def _burst_rows(monkeypatch) -> list[tuple[int, int]]:
    """Records (rows, steps) of every burst call from now on."""
    from pagoda.models.fused_decoder import FusedDecoderStack

    real, calls = FusedDecoderStack.burst, []

    def recorded(self, *args, **kwargs):
        tokens = real(self, *args, **kwargs)
        if tokens is not None:
            calls.append((len(tokens), len(tokens[0])))
        return tokens

    monkeypatch.setattr(FusedDecoderStack, "burst", recorded)
    return calls


def check_concurrent_with_a_stop(model: str, prompts, params: list[SamplingParams],
                                 monkeypatch) -> None:
    """The requests (prompts[i], params[i]) at once, request 1 given a stop token inside a
    burst (its 21st token of a run without it): the outputs of bursts off, request 1 ending
    on that token, in fewer steps, with bursts of every row and of BURST steps."""
    first = run(_engine(model, 1), list(zip(prompts, params, strict=True)))[0]
    stop = first[1][0][20]
    params = list(params)
    params[1] = params[1].clone()
    params[1].stop_token_ids = [stop]
    requests = list(zip(prompts, params, strict=True))
    want = run(_engine(model, 1), requests)
    calls = _burst_rows(monkeypatch)
    got = run(_engine(model, BURST), requests)
    assert got[0] == want[0]
    assert got[0][1][2] == "stop" and got[0][1][3] == stop
    assert got[1] < want[1]
    assert max(rows for rows, _ in calls) == len(requests)
    assert max(steps for _, steps in calls) == BURST


def test_concurrent_requests_burst_together(tiny_model, monkeypatch) -> None:
    """Requests that all decode with nothing waiting burst together, as many steps as the
    shortest allows; one ends on a stop token inside a burst (which ends the burst for
    all), others at different max_tokens: the outputs of bursts off, in fewer steps."""
    _needs_kernels(dense=True)
    model = str(tiny_model("LlamaForCausalLM"))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
              for n in (45, 30, 12, 60)]
    check_concurrent_with_a_stop(model, _prompts(4, seed=13), params, monkeypatch)


def test_smollm2_concurrent_bursts_equal_step_by_step(monkeypatch) -> None:
    """The default model (Q4_1 projections, a Q8_0 tied head and table): three requests
    that end on eos or max_tokens burst together with the tokens of bursts off."""
    _needs_kernels()
    if quant_cpu.resolve() is None:
        pytest.skip("the quant CPU kernels do not run here")
    prompts = _prompts(3, seed=14)
    requests = [(p, SamplingParams(max_tokens=n, temperature=0))
                for p, n in zip(prompts, (40, 25, 33), strict=True)]
    want = run(_engine(None, 1), requests)
    calls = _burst_rows(monkeypatch)
    got = run(_engine(None, BURST), requests)
    assert got[0] == want[0]
    assert got[1] < want[1] and max(rows for rows, _ in calls) == 3


def test_burst_given_up_by_one_row_gives_every_row_its_slots_back(tiny_model) -> None:
    """The pool cannot hold one request's burst (its slots for more than one token are
    refused): that request and those after it take one token, the runner declines the
    burst (it needs every row's), and the rows allocated for it before get their blocks
    back at commit, so every request holds only the blocks its computed tokens fill; the
    outputs are those of bursts off."""
    _needs_kernels(dense=True)
    model = str(tiny_model("LlamaForCausalLM"))
    requests = [(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
                for p in _prompts(3, seed=15)]
    want = run(_engine(model, 1), requests)[0]
    engine = _engine(model, BURST, block_size=16)
    kv = engine.kv_cache_manager
    real, refused = kv.allocate_slots, []

    def short_pool(request, num_new_tokens, *args, **kwargs):
        if request.req_id == "1" and num_new_tokens > 1 and not args:
            refused.append(num_new_tokens)
            return None
        return real(request, num_new_tokens, *args, **kwargs)

    kv.allocate_slots = short_pool
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params,
                           output_kind=OutputKind.CUMULATIVE)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = list(out.outputs[0].token_ids)
        for req in engine.scheduler.running:
            assert len(kv.get_block_ids(req.req_id)) == -(-req.num_computed_tokens // 16)
        engine.check_integrity()
    assert refused, "no burst was asked for"
    assert engine.kv_cache_manager.usage == 0.0
    assert [finals[str(i)] for i in range(3)] == [r[0] for r in want]
