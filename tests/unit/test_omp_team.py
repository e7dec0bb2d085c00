"""The adaptive OpenMP team (worker/omp_team.py): its rule on given counters, its place in
the worker, and outputs that do not change when the team does."""

from __future__ import annotations

import pytest
import torch

from pagoda.worker import omp_team
from pagoda.worker.omp_team import OmpTeam, idle_core_seconds, omp_team_for, run_delay_seconds

ARCH = "LlamaForCausalLM"


class Counters:
    """A clock and the two counters, advanced by hand."""

    def __init__(self) -> None:
        self.now = self.wait = self.idle = 0.0
        self.threads: list[int] = []

    def team(self, max_threads: int = 2) -> OmpTeam:
        return OmpTeam(max_threads, window_s=0.25, wait_frac=0.5, idle_frac=0.6, windows=2,
                       run_delay=lambda: self.wait, idle=lambda: self.idle,
                       clock=lambda: self.now, set_threads=self.threads.append)

    def advance(self, seconds: float, wait: float = 0.0, idle: float = 0.0) -> None:
        self.now += seconds
        self.wait += wait
        self.idle += idle


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    omp_team._lowered_from = None


def test_full_team_kept_while_the_threads_get_their_cores() -> None:
    c = Counters()
    team = c.team()
    for _ in range(8):
        c.advance(0.3, wait=0.12, idle=0.0)  # 40% waiting: below half
        team.tick()
    for _ in range(4):  # above half, but never two windows in a row
        c.advance(0.3, wait=0.27)
        team.tick()
        c.advance(0.3, wait=0.03)
        team.tick()
    assert team.threads == 2 and c.threads == [] and team.switches == 0


def test_drops_to_one_thread_when_the_threads_wait_for_cores_then_comes_back() -> None:
    c = Counters()
    team = c.team()
    c.advance(0.1, wait=0.1)
    team.tick()  # NOTE: within the window: nothing is judged yet
    assert c.threads == []
    c.advance(0.2, wait=0.1)  # 0.2 s of waiting over 0.3 s: one window
    team.tick()
    assert c.threads == []
    c.advance(0.3, wait=0.25)  # the second in a row
    team.tick()
    assert team.threads == 1 and c.threads == [1]
    for _ in range(3):  # the other cores stay busy
        c.advance(0.3, idle=0.05)
        team.tick()
    assert team.threads == 1 and c.threads == [1]
    c.advance(0.3, idle=0.25)  # 0.83 of a core idle
    team.tick()
    assert team.threads == 2 and c.threads == [1, 2] and team.switches == 2


def test_restoring_needs_the_idle_share_of_every_other_core() -> None:
    c = Counters()
    team = c.team(max_threads=4)
    for _ in range(2):
        c.advance(0.5, wait=0.5)
        team.tick()
    assert team.threads == 1
    c.advance(0.5, idle=0.6)  # 1.2 cores idle of the 3 others: below 0.6 x 3
    team.tick()
    assert team.threads == 1
    c.advance(0.5, idle=1.0)  # 2 cores idle
    team.tick()
    assert c.threads == [1, 4]


def test_one_thread_cannot_adapt() -> None:
    with pytest.raises(ValueError, match="at least 2 threads"):
        OmpTeam(1)


def test_the_counters_read_on_linux() -> None:
    wait, idle = run_delay_seconds(), idle_core_seconds()
    assert wait >= 0.0 and idle > 0.0
    sum(range(200_000))  # NOTE: some time passes; the counters never go back
    assert run_delay_seconds() >= wait and idle_core_seconds() >= idle


def test_omp_team_for(monkeypatch, restore_threads) -> None:
    torch.set_num_threads(2)
    assert omp_team_for(torch.device("cpu")) is not None
    assert omp_team_for(torch.device("cuda")) is None
    monkeypatch.setenv(omp_team.ENV, "0")
    assert omp_team_for(torch.device("cpu")) is None
    monkeypatch.delenv(omp_team.ENV)
    torch.set_num_threads(1)
    assert omp_team_for(torch.device("cpu")) is None


def test_a_new_engine_starts_from_the_team_a_dropped_one_lowered(restore_threads) -> None:
    torch.set_num_threads(2)
    c = Counters()
    team = OmpTeam(2, run_delay=lambda: c.wait, idle=lambda: c.idle, clock=lambda: c.now)
    for _ in range(2):
        c.advance(0.5, wait=0.5)
        team.tick()
    assert torch.get_num_threads() == 1
    fresh = omp_team_for(torch.device("cpu"))
    assert torch.get_num_threads() == 2 and fresh is not None and fresh.max_threads == 2


@pytest.mark.parametrize("model, dtype", [("tiny", "float32"), ("tiny", "bfloat16"),
                                          ("embedded", "auto")])
def test_outputs_equal_across_a_team_switch(tiny_model, restore_threads, model, dtype) -> None:
    """Greedy tokens and their logprobs, with the team dropped to one thread and back in
    the middle of decoding, equal those of a run on a fixed team (the embedded SmolLM2:
    its native Q4_1 / Q8_0 kernels and decode attention at the sizes they split)."""
    from pagoda import LLM, SamplingParams

    torch.set_num_threads(2)
    path = str(tiny_model(ARCH)) if model == "tiny" else None
    llm = LLM(model=path, dtype=dtype, max_model_len=128, seed=0)
    worker = llm.llm_engine.executor.worker
    assert worker.omp_team is not None and worker.omp_team.max_threads == 2
    prompts = ["The capital of France", "1, 2, 3, 4,", "def f(x):"]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3)

    def run() -> list:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    worker.omp_team = None  # NOTE: the fixed team's run
    fixed = run()
    c = Counters()
    team = c.team()
    team._set_threads = torch.set_num_threads
    seen: list[int] = []

    def tick() -> None:  # every step: contended for 3 steps, then the cores free up
        step = len(seen)
        c.advance(0.3, wait=0.25 if 2 <= step < 5 else 0.0, idle=0.3 if step >= 8 else 0.0)
        OmpTeam.tick(team)
        seen.append(torch.get_num_threads())

    team.tick = tick
    worker.omp_team = team
    switched = run()
    assert 1 in seen and seen[-1] == 2 and team.switches == 2
    assert switched == fixed
