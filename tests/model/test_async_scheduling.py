"""`--async-scheduling` on real models: greedy float32 and seeded sampling outputs are
identical with it on and off (tiny llama, the embedded SmolLM2), with n > 1, stop strings,
max_tokens, prefix caching, a host tier, preemption by recompute and swap, and aborts
mid-stream, offline and served; check_integrity after every step, no block left after
the requests end; a failed or interrupted step rolls back every step in flight."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs
from pagoda.engine.async_engine import AsyncLLMEngine, EngineRequest
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.output_processor import OutputKind
from pagoda.models import llama
from tests.helpers import TINY_CONFIG
from tests.model.test_step_failure import ENGINE as FAULT_ENGINE
from tests.model.test_step_failure import NUM_LAYERS, arm_fault

TIGHT = {"num_gpu_blocks_override": 12, "max_model_len": 160}
BLOCK_BYTES = 2 * TINY_CONFIG["num_hidden_layers"] * 16 * (
    TINY_CONFIG["num_key_value_heads"] * TINY_CONFIG["head_dim"]) * 4


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("LlamaForCausalLM")


def random_prompts(n: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 49152) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 49152) for _ in range(rng.randint(3, 60))]
            for _ in range(n)]


def serve(model: str | None, prompts, params, abort_at: dict[str, int] | None = None,
          **engine_kwargs):
    """Every prompt through LLMEngine.step, check_integrity after each step; request i is
    aborted once its output holds abort_at[str(i)] tokens. Returns (per request its
    samples' (tokens, text, finish_reason, stop_reason), the engine)."""
    engine = LLM(model, dtype="float32", **engine_kwargs).llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": prompt} if isinstance(prompt, list)
                           else prompt, p, output_kind=OutputKind.CUMULATIVE)
    finals = {}
    abort_at = abort_at or {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
            elif len(out.outputs[0].token_ids) >= abort_at.get(out.request_id, 1 << 30):
                (finals[out.request_id],) = engine.abort_request(out.request_id)
        engine.check_integrity()
    assert engine.kv_cache_manager.usage == 0.0
    pool = engine.scheduler.preemptor.host_pool
    assert pool is None or pool.num_free_blocks == pool.num_blocks
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason)
             for c in finals[str(i)].outputs] for i in range(len(prompts))], engine


def both(model, prompts, params, abort_at=None, **engine_kwargs):
    """serve() with async scheduling off, then on; asserts identical outputs."""
    expected, sync_engine = serve(model, prompts, params, abort_at, **engine_kwargs)
    got, async_engine = serve(model, prompts, params, abort_at, async_scheduling=True,
                              **engine_kwargs)
    assert async_engine.pipeline is not None and sync_engine.pipeline is None
    assert got == expected
    return expected, async_engine


def test_greedy_and_seeded_match_with_stops_lengths_and_n(path) -> None:
    prompts = random_prompts(10, seed=3)
    rng = random.Random(4)
    lengths = [rng.randint(1, 24) for _ in prompts]
    plain = [SamplingParams(temperature=0.0, max_tokens=m) for m in lengths]
    texts, _ = serve(str(path), prompts, plain)
    # NOTE: stop strings taken from the outputs themselves, so that they do fire.
    params = []
    for i, (m, samples) in enumerate(zip(lengths, texts)):
        text = samples[0][1]
        stop = [text[4:7]] if i % 2 == 0 and len(text) > 10 else []
        if i % 3 == 0:
            params.append(SamplingParams(temperature=1.0, seed=i, n=3, max_tokens=m, stop=stop))
        else:
            params.append(SamplingParams(temperature=0.0, n=1 + i % 2, max_tokens=m, stop=stop))
    expected, _ = both(str(path), prompts, params)
    reasons = {s[2] for samples in expected for s in samples}
    assert {"stop", "length"} <= reasons
    assert any(isinstance(s[3], str) for samples in expected for s in samples)


@pytest.mark.parametrize("engine_kwargs", [
    {"shared": 40, "max_num_seqs": 4},
    {"shared": 40, **TIGHT, "kv_offloading_size": 64 * BLOCK_BYTES / (1 << 30)},
    {**TIGHT, "preemption_mode": "recompute"},
    # NOTE: a small host pool: the check after every step walks all of it (4 GiB by default).
    {**TIGHT, "preemption_mode": "swap", "swap_space": 64 * BLOCK_BYTES / (1 << 30)},
    {**TIGHT, "scheduling_policy": "priority"},
], ids=["prefix-caching", "host-tier", "recompute", "swap", "priority"])
def test_prefix_caching_and_preemption_match(path, engine_kwargs) -> None:
    kwargs = dict(engine_kwargs)
    prompts = random_prompts(24, seed=5, shared=kwargs.pop("shared", 0))
    # NOTE: seeded rows too: a preempted request must not draw its stream's token twice.
    params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, max_tokens=4 + i % 9,
                             ignore_eos=True) for i in range(len(prompts))]
    _, engine = both(str(path), prompts, params, **kwargs)
    stats = engine.get_stats()
    if "shared" in engine_kwargs:
        assert stats.prefix_cache_hits > 0
    if "num_gpu_blocks_override" in engine_kwargs and "shared" not in engine_kwargs:
        assert stats.num_preemptions > 0
    assert (stats.num_swaps > 0) == ("swap_space" in engine_kwargs)


def test_aborts_mid_stream_match_and_free_their_blocks(path) -> None:
    prompts = random_prompts(8, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * len(prompts)
    expected, _ = both(str(path), prompts, params, abort_at={"1": 3, "4": 1, "6": 9})
    assert [expected[i][0][2] for i in (1, 4, 6)] == ["abort"] * 3
    assert [len(expected[i][0][0]) for i in (1, 4, 6)] == [3, 1, 9]


def test_the_forward_runs_on_the_worker_thread(path, monkeypatch) -> None:
    """The engine thread runs no OpenMP region: the model runs where it was built."""
    names = set()
    forward = llama.LlamaDecoderLayer.forward

    def recording(self, *args, **kwargs):
        names.add(threading.current_thread().name)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(llama.LlamaDecoderLayer, "forward", recording)
    llm = LLM(str(path), dtype="float32", async_scheduling=True)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert names == {"pagoda-worker"}


@pytest.mark.parametrize("exc", [RuntimeError("injected fault"), KeyboardInterrupt()],
                         ids=["fault", "ctrl-c"])
def test_a_failed_step_rolls_back_every_step_in_flight(path, monkeypatch, exc) -> None:
    """The second forward fails while the third step is already scheduled: both are
    rolled back (the third never runs), only the first step's chunk stays cached, and the
    same LLM then gives a fresh engine's output."""
    rng = random.Random(7)
    prompt = [rng.randrange(3, 49152) for _ in range(70)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    fresh = LLM(str(path), **FAULT_ENGINE).generate([prompt], params, use_tqdm=False)
    llm = LLM(str(path), **FAULT_ENGINE, async_scheduling=True)
    calls = arm_fault(monkeypatch, exc)
    with pytest.raises(type(exc)):
        llm.generate([prompt], params, use_tqdm=False)
    assert calls[0] == NUM_LAYERS + 2, "the step after the failed one ran"
    engine = llm.llm_engine
    engine.check_integrity()
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.usage == 0.0
    assert len(engine.kv_cache_manager.block_pool.cached_block_hash_to_block) == 2
    monkeypatch.undo()
    outs = llm.generate([prompt], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == fresh[0].outputs[0].token_ids
    assert outs[0].num_cached_tokens == 32
    engine.check_integrity()


def test_served_streams_match_and_an_abort_frees_its_blocks(path) -> None:
    prompts = random_prompts(6, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def run(async_scheduling: bool) -> tuple[list, float, list]:
        args = EngineArgs(model=str(path), dtype="float32", async_scheduling=async_scheduling)
        engine = AsyncLLMEngine.build(lambda: LLMEngine(args.create_engine_config()))
        engine.start()

        async def collect(i: int, prompt: list[int]) -> tuple[list[int], str | None]:
            stream = await engine.generate([EngineRequest(f"r{i}", {"prompt_token_ids": prompt},
                                                          params)])
            tokens, reason = [], None
            async for out in stream:
                tokens += out.outputs[0].token_ids
                reason = out.outputs[0].finish_reason
                if i == 0 and len(tokens) >= 2:
                    engine.abort(stream.request_ids)
            return tokens, reason

        results = await asyncio.gather(*(collect(i, p) for i, p in enumerate(prompts)))

        def usage(e: LLMEngine) -> float:
            while e.has_unfinished_requests():
                e.step()
            e.check_integrity()
            return e.kv_cache_manager.usage

        kv_usage = await engine.call(usage)
        orphans = await engine.orphan_request_ids()
        await engine.shutdown()
        return list(results), kv_usage, orphans

    expected, _, _ = asyncio.run(run(False))
    got, kv_usage, orphans = asyncio.run(run(True))
    assert got[0][1] == "abort"
    assert got[1:] == expected[1:]
    assert kv_usage == 0.0 and orphans == []


def test_smollm2_greedy_matches() -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "Three primary colors:"]
    params = [SamplingParams(temperature=0.0, max_tokens=16)] * len(prompts)
    both(None, prompts, params, max_model_len=256, kv_cache_memory_bytes=64 << 20)
