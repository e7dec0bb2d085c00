"""A step that fails inside the model's forward, or is interrupted there by Ctrl-C
(KeyboardInterrupt in `LLM.generate`), leaves no prefix-cache entry for K/V it did not
write: the same LLM then serves the same long prompt exactly as a fresh engine does.
The fault hits the second decoder layer of the second forward, when the first layer has
already written part of that chunk's K/V; the first chunk's blocks, committed a step
earlier, stay cached and are reused."""

from __future__ import annotations

import random
import signal

import pytest

from pagoda import LLM, SamplingParams
from pagoda.models import llama

# NOTE: a 70-token prompt in chunks of 32: blocks 1-2 are committed by the first step;
# the second step (tokens 32..63, blocks 3-4) is the one that fails.
ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 32,
          "kv_cache_memory_bytes": 1 << 20}
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
NUM_LAYERS = 2  # the tiny config's


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model("LlamaForCausalLM")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 49152) for _ in range(70)] for _ in range(2)]


@pytest.fixture(scope="module")
def expected(model_path, prompts) -> list[list[int]]:
    llm = LLM(str(model_path), **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def arm_fault(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> list[int]:
    """Make the second decoder layer of the next engine's second forward raise `exc`
    (once); returns the call counter."""
    calls = [0]
    forward = llama.LlamaDecoderLayer.forward

    def faulty(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == NUM_LAYERS + 2:
            raise exc
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(llama.LlamaDecoderLayer, "forward", faulty)
    return calls


def assert_rolled_back(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.usage == 0.0
    # Only the first chunk's two full blocks were committed.
    assert len(engine.kv_cache_manager.block_pool.cached_block_hash_to_block) == 2


@pytest.mark.parametrize("exc", [RuntimeError("injected fault"), KeyboardInterrupt()],
                         ids=["fault", "ctrl-c"])
def test_failed_step_then_same_prompt_matches_a_fresh_engine(
    model_path, prompts, expected, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    llm = LLM(str(model_path), **ENGINE)
    calls = arm_fault(monkeypatch, exc)
    with pytest.raises(type(exc)):
        llm.generate([{"prompt_token_ids": prompts[0]}], PARAMS, use_tqdm=False)
    assert calls[0] == NUM_LAYERS + 2, "the fault did not fire inside the second forward"
    assert_rolled_back(llm)
    monkeypatch.undo()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert outs[0].num_cached_tokens == 32  # the committed chunk was reused
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.kv_cache_manager.usage == 0.0


def test_engine_step_rolls_back_and_names_the_failed_requests(
    model_path, prompts, expected, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below LLM.generate: the failed step's requests wait to be computed again, holding
    no blocks, and stepping on (the fault gone) finishes them with the right tokens."""
    llm = LLM(str(model_path), **ENGINE)
    engine = llm.llm_engine
    arm_fault(monkeypatch, RuntimeError("injected fault"))
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, PARAMS)
    engine.step()
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    assert engine.failed_request_ids == ["a"]
    (req,) = engine.scheduler.waiting
    assert req.num_computed_tokens == 0 and engine.kv_cache_manager.usage == 0.0
    engine.check_integrity()
    monkeypatch.undo()
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert engine.failed_request_ids == []
    assert [o.outputs[0].token_ids for o in finals] == [expected[0]]
    engine.check_integrity()


def test_ctrl_c_during_the_commit_is_held_until_the_scheduler_is_consistent(
    model_path, prompts, expected, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT delivered while the commit frees a finished request (after it left the
    running list, before its blocks are freed): the KeyboardInterrupt surfaces once the
    commit is done, so aborting leaves nothing half-finished, and the same LLM then gives
    a fresh engine's output. Without the hold the abort finds the request in no queue."""
    from pagoda.core.preemption import Preemptor

    llm = LLM(str(model_path), **ENGINE)
    free = Preemptor.free
    calls = [0]

    def interrupted_free(self, req):
        calls[0] += 1
        if calls[0] == 1:
            signal.raise_signal(signal.SIGINT)
        return free(self, req)

    monkeypatch.setattr(Preemptor, "free", interrupted_free)
    # NOTE: a process started in the background (`cmd &`) inherits SIGINT ignored, and
    # Python then leaves it ignored; Ctrl-C is what this test is about, so give it
    # Python's handler for the test.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([{"prompt_token_ids": prompts[0]}], PARAMS, use_tqdm=False)
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert calls[0] == 1
    engine = llm.llm_engine
    engine.check_integrity()
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.usage == 0.0
    monkeypatch.undo()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def seeded_llm(model_path, prompts):
    """`seeded_llm(async_scheduling) -> (LLM, prompt, its fault-free SEEDED tokens)`, one
    LLM per setting for the module."""
    built: dict[bool, tuple[LLM, list[int], list[int]]] = {}
    prompt = prompts[1][:20]  # one prefill step, then one token a step

    def get(async_scheduling: bool) -> tuple[LLM, list[int], list[int]]:
        if async_scheduling not in built:
            llm = LLM(str(model_path), **ENGINE, async_scheduling=async_scheduling)
            (out,) = llm.generate([{"prompt_token_ids": prompt}], SEEDED, use_tqdm=False)
            built[async_scheduling] = llm, prompt, out.outputs[0].token_ids
        return built[async_scheduling]

    return get


def run_with_one_fault(engine, prompt: list[int]) -> list[int]:
    """Serve `prompt` with SEEDED, stepping on after the one failure; its tokens."""
    engine.add_request("s", {"prompt_token_ids": prompt}, SEEDED)
    finals, failures = [], 0
    while engine.has_unfinished_requests():
        try:
            finals += [o for o in engine.step() if o.finished]
        except RuntimeError:
            failures += 1
            assert engine.failed_request_ids == ["s"]
            engine.check_integrity()
    assert failures == 1 and len(finals) == 1
    return finals[0].outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling,after_sampling",
                         [(False, False), (False, True), (True, True)],
                         ids=["before-sampling", "after-sampling", "async-after-sampling"])
def test_retried_seeded_request_continues_its_stream(
    seeded_llm, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool, after_sampling: bool,
) -> None:
    """The fourth token's step fails (before or after it sampled) and the engine steps on:
    the seeded request's tokens equal a fault-free run's, so its generator neither restarts
    from the seed (the runner used to drop it as if the request had finished) nor keeps
    the failed step's draws."""
    from pagoda.worker.model_runner import ModelRunner

    llm, prompt, fault_free = seeded_llm(async_scheduling)
    sample, calls = ModelRunner._sample, [0]

    def faulty_sample(self, *args):
        calls[0] += 1
        if calls[0] == 4 and not after_sampling:
            raise RuntimeError("injected fault")
        sample(self, *args)
        if calls[0] == 4:
            raise RuntimeError("injected fault")

    monkeypatch.setattr(ModelRunner, "_sample", faulty_sample)
    assert run_with_one_fault(llm.llm_engine, prompt) == fault_free
    assert llm.llm_engine.kv_cache_manager.usage == 0.0
