"""layers/rejection_sampler.py: greedy verification, the exactness of speculative sampling
(a statistical test against the exact distribution, which deliberately broken acceptance
rules fail), seeded reproducibility, processed distributions and logprobs."""

from __future__ import annotations

import pytest
import torch

from pagoda.layers import rejection_sampler as rs
from pagoda.layers.rejection_sampler import RejectionSampler
from pagoda.layers.sampler import SamplingMetadata
from pagoda.sampling_params import SamplingParams

VOCAB = 6
# NOTE: the tolerance on the total variation distance between the sampled joint law of
# the first two tokens (36 cells) and the exact one. With 40,000 samples the expected TV
# of a correct sampler is about 0.012 (sum over cells of sqrt(p / N) * 0.4); every broken
# rule below lands at 0.10 or more (measured: correct 0.006-0.008, broken 0.10-0.99).
NUM_SAMPLES = 40_000
TV_TOLERANCE = 0.03


def _md(params: list[SamplingParams], outputs: list[list[int]] | None = None,
        vocab: int = VOCAB) -> SamplingMetadata:
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingMetadata.build(params, [[0]] * len(params), outputs, [None] * len(params),
                                  set(), vocab, torch.device("cpu"))


def _markov(seed: int = 0) -> torch.Tensor:
    """A tiny 'model': logits of the next token given the previous one, [V, V]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, VOCAB, generator=g) * 1.5


def _spec_step(table: torch.Tensor, prev: torch.Tensor, k: int, q_table: torch.Tensor | None,
               gen: torch.Generator) -> list[list[int]]:
    """One speculative step for every row: drafts (from q_table, or the deterministic
    (prev + 1) % V chain), the target's logits along the drafts, verification."""
    num_rows = len(prev)
    drafts = torch.empty(num_rows, k, dtype=torch.int64)
    q_list = []
    last = prev
    for j in range(k):
        if q_table is None:
            drafts[:, j] = (last + 1) % VOCAB
        else:
            drafts[:, j] = torch.multinomial(q_table[last], 1, generator=gen).squeeze(1)
            q_list.append(q_table[last])
        last = drafts[:, j]
    context = torch.cat([prev[:, None], drafts], dim=1)  # the token before each position
    logits = table[context].reshape(num_rows * (k + 1), VOCAB)
    params = [SamplingParams(temperature=1.0)] * (num_rows * (k + 1))
    draft_probs = None if q_table is None else list(torch.stack(q_list, dim=1))
    out = RejectionSampler()(logits, _md(params), drafts.tolist(), [None] * num_rows,
                             draft_probs)
    return out.token_ids


def _sample_two_tokens(table: torch.Tensor, k: int, q_table: torch.Tensor | None) -> torch.Tensor:
    """[N, 2]: the first two tokens after token 0, by speculative steps."""
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(2)
    prev = torch.zeros(NUM_SAMPLES, dtype=torch.int64)
    produced = [list(t) for t in _spec_step(table, prev, k, q_table, gen)]
    short = [i for i, t in enumerate(produced) if len(t) < 2]
    if short:
        last = torch.tensor([produced[i][-1] for i in short])
        for i, t in zip(short, _spec_step(table, last, k, q_table, gen)):
            produced[i].extend(t)
    return torch.tensor([t[:2] for t in produced])


def _tv_to_exact(table: torch.Tensor, samples: torch.Tensor) -> float:
    probs = table.softmax(dim=-1)
    exact = probs[0][:, None] * probs  # P(a, b) = p(a | 0) p(b | a)
    counts = torch.zeros(VOCAB, VOCAB)
    counts.index_put_((samples[:, 0], samples[:, 1]), torch.ones(len(samples)), accumulate=True)
    return float((counts / len(samples) - exact).abs().sum() / 2)


@pytest.mark.parametrize("proposer", ["one_hot", "sampled_q"])
def test_speculative_sampling_matches_the_target_distribution(proposer: str) -> None:
    table = _markov()
    q_table = None if proposer == "one_hot" else torch.softmax(_markov(7), dim=-1)
    assert _tv_to_exact(table, _sample_two_tokens(table, 2, q_table)) < TV_TOLERANCE


def _always_accept(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(p)


def _accept_by_p_only(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p


def _residual_is_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p


@pytest.mark.parametrize(("name", "attr", "broken", "proposer"), [
    ("accept every draft", "acceptance_probs", _always_accept, "one_hot"),
    ("accept with p(d), ignoring q", "acceptance_probs", _accept_by_p_only, "sampled_q"),
    ("resample from p, not p - q", "residual_distribution", _residual_is_p, "one_hot"),
])
def test_the_statistical_check_detects_a_broken_rule(
    monkeypatch: pytest.MonkeyPatch, name: str, attr: str, broken, proposer: str
) -> None:
    monkeypatch.setattr(rs, attr, broken)
    table = _markov()
    q_table = None if proposer == "one_hot" else torch.softmax(_markov(7), dim=-1)
    assert _tv_to_exact(table, _sample_two_tokens(table, 2, q_table)) > TV_TOLERANCE, name


def test_greedy_accepts_while_the_draft_is_the_argmax() -> None:
    logits = torch.full((8, VOCAB), -5.0)
    argmax = [3, 1, 4, 2, 5, 0, 2, 2]
    logits[torch.arange(8), torch.tensor(argmax)] = 5.0
    drafts = [[3, 1, 0], [5, 0, 2]]  # row 0: 2 accepted, then 4; row 1: all 3, bonus 2
    out = RejectionSampler()(logits, _md([SamplingParams(temperature=0.0)] * 8), drafts,
                             [None, None])
    assert out.token_ids == [[3, 1, 4], [5, 0, 2, 2]]
    assert out.num_accepted == [2, 3]


def test_greedy_verifies_against_processed_logits() -> None:
    """logit_bias moves the argmax: the draft equal to the raw argmax is rejected."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 1] = 3.0
    params = SamplingParams(temperature=0.0, logit_bias={4: 10.0})
    out = RejectionSampler()(logits, _md([params] * 2), [[1]], [None])
    assert out.token_ids == [[4]]


def test_penalties_see_the_drafts_before_each_position() -> None:
    """Position 1's history includes draft 0: a presence penalty on it flips the argmax."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 1.0
    logits[:, 3] = 0.5
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    md = _md([params] * 3, outputs=[[], [2], [2, 3]])
    out = RejectionSampler()(logits, md, [[2, 3]], [None])
    # p0: argmax 2 (draft ok); p1: 2 penalised -> 3 (draft ok); p2: 2, 3 penalised -> 0.
    assert out.token_ids == [[2, 3, 0]]


def test_seeded_rows_are_reproducible_and_batch_independent() -> None:
    table = _markov()
    params = SamplingParams(temperature=1.0, seed=5)
    drafts = [[1, 2, 3]]
    logits = table[torch.tensor([0, 1, 2, 3])]
    runs = [RejectionSampler()(logits, _md([params] * 4), drafts,
                               [torch.Generator().manual_seed(5)]).token_ids[0]
            for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    # The same row beside an unseeded one, placed second.
    other = table[torch.tensor([4, 5])]
    both = RejectionSampler()(torch.cat([other, logits]), _md([params] * 6), [[0], *drafts],
                              [None, torch.Generator().manual_seed(5)])
    assert both.token_ids[1] == runs[0]


def test_logprobs_of_the_emitted_tokens() -> None:
    logits = torch.randn(4, VOCAB)
    argmax = logits.argmax(dim=-1).tolist()
    params = SamplingParams(temperature=0.0, logprobs=2)
    out = RejectionSampler()(logits, _md([params] * 4), [[argmax[0], (argmax[1] + 1) % VOCAB,
                                                          0]], [None])
    assert out.token_ids == [[argmax[0], argmax[1]]]
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprob_token_ids[0, 0] == argmax[0] and out.logprob_token_ids[1, 0] == argmax[1]
    torch.testing.assert_close(out.logprobs[1, 0], expected[1, argmax[1]])
    assert out.sampled_token_ranks[:2].tolist() == [1, 1]
