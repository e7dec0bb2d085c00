"""Sampler: every stage against a hand-made reference, seeds independent of the batch."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda import ops
from pagoda.layers.sampler import (
    Penalties,
    Sampler,
    SamplingMetadata,
    compute_topk_logprobs,
)
from pagoda.ops import reference
from pagoda.ops.truncation import apply_min_p, apply_top_k_top_p
from pagoda.sampling_params import SamplingParams, SamplingType

CPU = torch.device("cpu")
EOS = 0


def build(
    params: list[SamplingParams],
    vocab_size: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts or [[1]] * n,
        outputs or [[] for _ in range(n)],
        generators or [None] * n,
        {EOS},
        vocab_size,
        CPU,
    )


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_and_leaves_logits_alone(dtype: torch.dtype) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = logits.clone()
    md = build([SamplingParams(temperature=0.0)] * 6, 50)
    assert md.all_greedy and not md.needs_processing
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None
    assert torch.equal(logits, before)


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    md = build([SamplingParams(temperature=1.3, top_k=1)] * 8, 100)
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert torch.equal(logits, before)


def test_mixed_greedy_and_random_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=5.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=5.0),
    ]
    md = build(params, 30)
    assert md.greedy_mask is not None and md.greedy_mask.tolist() == [True, False, True, False]
    out = Sampler()(logits, md)
    assert out.sampled_token_ids[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()


# Row probabilities 0.5, 0.2, 0.15, 0.1, 0.05, scattered over the vocabulary so that the
# masks must follow the sort, not the positions.
PROBS = [0.1, 0.5, 0.05, 0.15, 0.2]


def kept(logits_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits_row)).flatten().tolist())


def test_top_k_top_p_masks() -> None:
    logits = probs_logits(PROBS).repeat(5, 1)
    top_k = torch.tensor([2, 5, 5, 3, 5])
    top_p = torch.tensor([1.0, 0.45, 0.6, 0.75, 1.0])
    out = apply_top_k_top_p(logits.clone(), top_k, top_p)
    assert kept(out[0]) == {1, 4}  # top-2
    assert kept(out[1]) == {1}  # 0.5 already reaches 0.45
    assert kept(out[2]) == {1, 4}  # 0.5 < 0.6 <= 0.7
    # top-p acts on the top-k renormalised distribution: 0.7 / 0.85 > 0.75.
    assert kept(out[3]) == {1, 4}
    assert kept(out[4]) == set(range(5))
    # Surviving logits are unchanged.
    assert torch.equal(out[0, [1, 4]], logits[0, [1, 4]])


def test_top_p_applies_after_top_k_renormalises() -> None:
    logits = probs_logits(PROBS).repeat(2, 1)
    # After top-3 the masses above each token are 0, 0.5/0.85, 0.7/0.85 (= 0.82).
    out = apply_top_k_top_p(logits.clone(), torch.tensor([3, 3]), torch.tensor([0.85, 0.8]))
    assert kept(out[0]) == {1, 4, 3}
    assert kept(out[1]) == {1, 4}
    only_p = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.75, 0.95]))
    assert kept(only_p[0]) == {1, 4, 3}
    assert kept(only_p[1]) == {1, 4, 3, 0}


def test_min_p_mask() -> None:
    logits = probs_logits(PROBS).repeat(3, 1)
    apply_min_p(logits, torch.tensor([0.35, 0.0, 0.25]))
    assert kept(logits[0]) == {1, 4}  # threshold 0.175
    assert kept(logits[1]) == set(range(5))
    assert kept(logits[2]) == {1, 4, 3}  # threshold 0.125


def test_min_p_applies_before_top_p_as_in_vllm() -> None:
    # min-p 0.3 keeps tokens 0 and 1 (threshold 0.12); top-p 0.5 on what is left
    # (0.57, 0.43) keeps token 0 only. Applied the other way round, top-p 0.5 on the full
    # distribution keeps 0 and 1 (the mass above token 1 is 0.4), and min-p keeps both.
    num_rows = 2000
    torch.manual_seed(0)
    logits = probs_logits([0.4, 0.3, 0.1, 0.1, 0.1]).repeat(num_rows, 1)
    params = SamplingParams(temperature=1.0, min_p=0.3, top_p=0.5)
    out = Sampler()(logits, build([params] * num_rows, 5))
    assert out.sampled_token_ids.eq(0).all()


def frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).double()


def chi_square(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs.double() * observed.sum()
    mask = expected > 0
    assert observed[~mask].sum() == 0, "sampled a token of probability zero"
    return float(((observed[mask] - expected[mask]) ** 2 / expected[mask]).sum())


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"temperature": 0.7}, torch.softmax(probs_logits(PROBS) / 0.7, -1)),
        ({"temperature": 1.0, "top_p": 0.75}, torch.tensor([0, 0.5, 0, 0.15, 0.2]) / 0.85),
        ({"temperature": 1.0, "top_k": 2}, torch.tensor([0, 0.5, 0, 0, 0.2]) / 0.7),
        ({"temperature": 1.0, "min_p": 0.25}, torch.tensor([0, 0.5, 0, 0.15, 0.2]) / 0.85),
    ],
)
def test_sampling_frequencies_follow_the_distribution(kwargs: dict, expected: torch.Tensor) -> None:
    num_rows = 20000
    torch.manual_seed(1234)
    logits = probs_logits(PROBS).repeat(num_rows, 1)
    out = Sampler()(logits, build([SamplingParams(**kwargs)] * num_rows, 5))
    # df <= 4: P(chi2 > 30) < 1e-5; a wrong distribution at this size scores in the hundreds.
    assert chi_square(frequencies(out.sampled_token_ids, 5), expected) < 30.0


def run_steps(
    rows: list[tuple[SamplingParams, bool]], logits_per_step: list[torch.Tensor]
) -> torch.Tensor:
    """Sample several steps; rows marked True get a fresh generator from their seed."""
    generators = [torch.Generator().manual_seed(p.seed) if seeded else None for p, seeded in rows]
    params = [p for p, _ in rows]
    md = build(params, logits_per_step[0].shape[1], generators=generators)
    return torch.stack([Sampler()(logits, md).sampled_token_ids for logits in logits_per_step])


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    vocab_size, num_steps = 64, 6
    gen = torch.Generator().manual_seed(5)
    target = [torch.randn(1, vocab_size, generator=gen) * 2 for _ in range(num_steps)]
    seeded_a = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    seeded_b = SamplingParams(temperature=1.1, top_k=20, seed=11)
    alone = run_steps([(seeded_a, True)], target)[:, 0]

    others = [
        (SamplingParams(temperature=1.0), False),
        (seeded_b, True),
        (SamplingParams(temperature=0.0), False),
        (SamplingParams(temperature=0.5, min_p=0.1), False),
    ]
    for position in range(len(others) + 1):
        rows = others[:position] + [(seeded_a, True)] + others[position:]
        steps = []
        for t in target:
            batch = torch.randn(len(rows), vocab_size, generator=gen) * 2
            batch[position] = t[0]
            steps.append(batch)
        in_batch = run_steps(rows, steps)[:, position]
        assert torch.equal(in_batch, alone), f"seeded row at position {position}"
    # A different seed gives a different sequence (guards against ignoring the generator).
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, seed=8)
    assert not torch.equal(run_steps([(other_seed, True)], target)[:, 0], alone)


def test_penalties_against_reference() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.5, 3.0], [2.0, -1.0, 0.5, -0.5, 1.5, 3.0]])
    prompt, output = [1, 2], [2, 3, 3]
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    md = build([p, SamplingParams()], 6, prompts=[prompt, prompt], outputs=[output, output])
    expected = logits[0].tolist()
    for t in set(prompt + output):
        expected[t] = expected[t] / 1.5 if expected[t] > 0 else expected[t] * 1.5
    for t in set(output):
        expected[t] -= 0.5 * output.count(t) + 0.25
    for penalize in (ops.penalize_rows, reference.penalize_rows):  # the kernel, the reference
        got = penalize(logits.clone(), *Penalties.of(md))
        assert torch.allclose(got[0], torch.tensor(expected))
        assert got[1].tolist() == [2.0, -1.0, 0.5, -0.5, 1.5, 3.0]


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.9]])
    rep = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert Sampler()(logits, build([rep], 3, prompts=[[1]])).sampled_token_ids.tolist() == [2]
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.05)
    md = build([freq], 3, outputs=[[1, 1, 1]])
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [2]


def test_logit_bias() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 4] = 5.0
    params = [
        SamplingParams(temperature=0.0, logit_bias={"7": 6.0}),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler()(logits, build(params, 10))
    assert out.sampled_token_ids.tolist() == [7, 4]
    assert logits[0, 7] == 0.0


def test_min_tokens_bans_stop_tokens() -> None:
    logits = torch.zeros(4, 10)
    logits[:, EOS] = 10.0
    logits[:, 5] = 9.0
    logits[:, 6] = 1.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=3),
    ]
    outputs = [[2, 2], [2], [], [2, 2, 2]]
    out = Sampler()(logits, build(params, 10, outputs=outputs))
    assert out.sampled_token_ids.tolist() == [5, 6, EOS, EOS]


def test_compute_topk_logprobs_matches_log_softmax() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    token_ids = torch.tensor([0, 7, 39, 12, 3])
    ids, lps, ranks = compute_topk_logprobs(logits, token_ids, 4)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert ids.shape == lps.shape == (5, 5)
    assert torch.equal(ids[:, 0], token_ids)
    assert torch.allclose(lps[:, 0], ref.gather(1, token_ids[:, None])[:, 0])
    ref_top, ref_ids = ref.topk(4, dim=-1)
    assert torch.equal(ids[:, 1:], ref_ids) and torch.allclose(lps[:, 1:], ref_top)
    order = ref.argsort(dim=-1, descending=True)
    expected_ranks = (order == token_ids[:, None]).nonzero()[:, 1] + 1
    assert torch.equal(ranks, expected_ranks)
    ids0, lps0, _ = compute_topk_logprobs(logits, token_ids, 0)
    assert ids0.shape == (5, 1) and torch.allclose(lps0[:, 0], lps[:, 0])


def test_sampler_logprobs_come_from_raw_logits() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 20)
    params = [
        SamplingParams(temperature=0.5, logprobs=2, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    md = build(params, 20, prompts=[[1, 2, 3]] * 3)
    assert md.max_num_logprobs == 2
    out = Sampler()(logits, md)
    ref = torch.log_softmax(logits, -1)
    assert out.logprob_token_ids.shape == (3, 3) and out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(out.logprobs[:, 0], ref.gather(1, out.sampled_token_ids[:, None])[:, 0])
    assert torch.allclose(out.logprobs[:, 1:], ref.topk(2, dim=-1).values)
    assert out.sampled_token_ranks[1].item() == 1
    assert math.isclose(out.logprobs[1, 0].item(), ref[1].max().item(), rel_tol=1e-6)


def test_partial_top_k_equals_full_sort() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(4)) * 3
    top_k = torch.tensor([1, 5, 17, 40, 40, 2])
    top_p = torch.tensor([1.0, 0.3, 0.9, 0.5, 1.0, 0.99])
    full = apply_top_k_top_p(logits.clone(), top_k, top_p)
    partial = apply_top_k_top_p(logits.clone(), top_k, top_p, max_top_k=40)
    assert torch.equal(full, partial)
    assert [len(kept(row)) for row in full][:5:4] == [1, 40]


def test_max_top_k_ignores_greedy_rows() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=7), SamplingParams(top_k=3)]
    md = build(params, 100)
    assert md.max_top_k == 7 and md.top_k.tolist() == [1, 7, 3]
    md = build([SamplingParams(temperature=0.0), SamplingParams()], 100)
    assert md.top_k is None and md.max_top_k == 100


def test_plain_params() -> None:
    """`plain`: only a temperature and truncation touch the logits (greedy: the raw
    argmax); nothing that reads the request's tokens or reports logprobs."""
    assert SamplingParams(temperature=0.0).plain
    # NOTE: greedy switches truncation off: top-k cannot change an argmax.
    assert SamplingParams(temperature=0.0, min_tokens=4, top_k=3).plain
    assert SamplingParams(temperature=0.7).plain
    assert SamplingParams(temperature=0.7).sampling_type != SamplingType.GREEDY
    for changed in ({"logprobs": 0}, {"logit_bias": {3: 1.0}},
                    {"repetition_penalty": 1.1}, {"frequency_penalty": 0.5},
                    {"presence_penalty": -0.5}):
        assert not SamplingParams(**{"temperature": 0.0, **changed}).plain, changed
        assert not SamplingParams(**{"temperature": 0.7, **changed}).plain, changed
    for changed in ({"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.1},
                    {"top_p": 0.9, "top_k": 20, "min_p": 0.1}):
        assert SamplingParams(**{"temperature": 0.7, **changed}).plain, changed
        assert not SamplingParams(**{"temperature": 0.7, "logprobs": 2, **changed}).plain
    assert SamplingParams(temperature=0.0, logit_bias={}).plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_shortcut_samples_what_the_sampler_does(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 300, generator=g).to(dtype)
    logits[1, 10] = logits[1, 20] = logits[1].max() + 1  # a tie: the first index
    logits[2, 33] = float("nan")  # NaN counts as the maximum
    full = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 7, 300))
    assert torch.equal(Sampler.greedy(logits), full.sampled_token_ids)


def test_top_p_among_candidates_equals_the_full_sort(monkeypatch) -> None:
    """top-p without top-k looks for a row's nucleus among its 64, then 1,024 most likely
    tokens before sorting the row: the same logits kept as the full sort's, for rows whose
    nucleus fits each of the three (peaked to flat) and rows of p == 1 beside them."""
    from pagoda.ops import truncation as sampler

    vocab = 49152
    gen = torch.Generator().manual_seed(3)
    sizes = set()
    for scale in (0.3, 3.0, 8.0, 20.0):
        for p in (0.5, 0.9, 0.99):
            logits = torch.randn(8, vocab, generator=gen) * scale
            top_p = torch.full((8,), p)
            top_p[5] = 1.0
            got = sampler.apply_top_k_top_p(logits.clone(), None, top_p)
            with monkeypatch.context() as m:
                m.setattr(sampler, "NUCLEUS_CANDIDATES", ())
                want = sampler.apply_top_k_top_p(logits.clone(), None, top_p)
            assert torch.equal(got, want), (scale, p)
            assert torch.equal(got[5], logits[5])
            kept = got.isfinite().sum(dim=-1)
            sizes.update(int(k) for k in kept[top_p < 1])
    assert min(sizes) < 64 and any(64 < k < 1024 for k in sizes) and max(sizes) > 1024
