"""Sampler: greedy, the sampled distribution (chi-square against an independent numpy
expectation), seeds, penalties, min_tokens, logprobs, and processed_probs == what is drawn."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from outrider.core import Request, SamplingParams, ScheduledSeq
from outrider.executor.sampler import (
    GRAMMAR_TOPK,
    Sampler,
    SamplingRow,
    apply_min_tokens,
    apply_penalties,
    make_generator,
    processed_probs,
    sample_from_probs_no_sync,
    top_candidates_no_sync,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Distinct values (ties make top-k/top-p edges ambiguous), shuffled so that sorting matters.
LOGITS12 = np.array([0.3, 2.0, -1.0, 1.3, -0.3, 0.8, 1.6, -1.5, 0.0, 1.0, -0.6, 0.5])


def seq(
    params: SamplingParams,
    prompt: tuple[int, ...] = (1, 2, 3),
    output: tuple[int, ...] = (),
    eos: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
) -> ScheduledSeq:
    req = Request(list(prompt), params, eos_token_ids=frozenset(eos))
    req.output_token_ids = list(output)
    req.generator = generator
    return ScheduledSeq(req, token_ids=[0], start_pos=0, block_ids=[], sample=True)


def expected_probs(logits: np.ndarray, t: float, k: int, p: float, min_p: float) -> np.ndarray:
    """softmax(logits / t), restricted by top-k, then top-p, then min-p, each renormalised."""
    z = logits / t
    q = np.exp(z - z.max())
    q /= q.sum()
    order = np.argsort(-q)
    keep = np.ones_like(q, dtype=bool)
    if k > 0:
        keep[order[k:]] = False
    q = np.where(keep, q, 0.0)
    q /= q.sum()
    mass = 0.0
    for i in order:
        if mass >= p:
            keep[i] = False
        mass += q[i]
    q = np.where(keep, q, 0.0)
    q /= q.sum()
    q = np.where(q >= min_p * q.max(), q, 0.0)
    return q / q.sum()


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    n = counts.sum()
    exp = n * probs[support]
    chi2 = float(((counts[support] - exp) ** 2 / exp).sum())
    df = int(support.sum()) - 1
    if df == 0:
        return 1.0
    half = torch.tensor([df / 2, chi2 / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))  # survival function of chi2(df)


def draw(logits: np.ndarray, params: SamplingParams, n: int, device: str) -> np.ndarray:
    rows = torch.tensor(logits, dtype=torch.float32, device=device).expand(n, -1).contiguous()
    ids = Sampler()(rows, [seq(params)] * n).token_ids
    return np.bincount(ids, minlength=len(logits))


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_and_fast_path_returns_no_logprobs(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 300, device=device)
    out = Sampler()(logits, [seq(SamplingParams(temperature=0))] * 7)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None
    bf16 = logits.bfloat16()
    out = Sampler()(bf16, [seq(SamplingParams(temperature=0))] * 7)
    assert out.token_ids == bf16.float().argmax(-1).tolist()


def test_mixed_batch_greedy_rows_take_argmax_sampled_rows_follow_their_masks() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    greedy = SamplingParams(temperature=0)
    only_top = SamplingParams(temperature=1.5, top_k=1)  # a sampled row that must pick argmax
    top3 = SamplingParams(temperature=2.0, top_k=3)
    seqs = [seq(greedy), seq(top3), seq(only_top), seq(greedy), seq(top3), seq(SamplingParams())]
    top3_sets = logits.topk(3, -1).indices
    for _ in range(20):
        ids = Sampler()(logits, seqs).token_ids
        assert ids[0] == logits[0].argmax() and ids[3] == logits[3].argmax()
        assert ids[2] == logits[2].argmax()
        assert ids[1] in top3_sets[1].tolist() and ids[4] in top3_sets[4].tolist()


CASES = [  # temperature, top_k, top_p, min_p
    (1.0, -1, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, -1, 0.8, 0.0),
    (1.0, 8, 0.7, 0.0),
    (0.9, -1, 1.0, 0.17),
    (1.2, 9, 0.9, 0.3),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("t", "k", "p", "min_p"), CASES)
def test_sampled_distribution_matches_independent_expectation(
    device: str, t: float, k: int, p: float, min_p: float
) -> None:
    torch.manual_seed(1234)
    params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=min_p)
    counts = draw(LOGITS12, params, 20000, device)
    want = expected_probs(LOGITS12, t, k, p, min_p)
    assert counts[want == 0].sum() == 0, "an excluded token was sampled"
    assert chi2_pvalue(counts, want) > 0.001
    # Power: the same samples reject an expectation that ignores one of the knobs.
    wrong = expected_probs(LOGITS12, 1.0 if t != 1.0 else 1.5, k, p, min_p)
    assert chi2_pvalue(counts, wrong) < 1e-6


def test_chi_square_rejects_an_expectation_that_ignores_top_p() -> None:
    torch.manual_seed(5)
    counts = draw(LOGITS12, SamplingParams(top_p=0.8), 20000, "cpu")
    assert chi2_pvalue(counts, expected_probs(LOGITS12, 1.0, -1, 0.8, 0.0)) > 0.001
    assert chi2_pvalue(counts, expected_probs(LOGITS12, 1.0, -1, 1.0, 0.0)) < 1e-6


def test_seeded_rows_follow_the_distribution_too() -> None:
    n = 4000
    params = SamplingParams(temperature=0.9, top_p=0.9)
    seqs = [seq(params, generator=make_generator(s, "cpu")) for s in range(n)]
    logits = torch.tensor(LOGITS12, dtype=torch.float32).expand(n, -1).contiguous()
    counts = np.bincount(Sampler()(logits, seqs).token_ids, minlength=12)
    want = expected_probs(LOGITS12, 0.9, -1, 0.9, 0.0)
    assert counts[want == 0].sum() == 0
    assert chi2_pvalue(counts, want) > 0.001


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_tokens_do_not_depend_on_the_batch(device: str) -> None:
    torch.manual_seed(7)
    vocab, steps = 400, 12
    target_logits = torch.randn(steps, vocab, device=device) * 2

    def run(seed: int, position: int, others: int) -> list[int]:
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        gen = make_generator(seed, device)
        neighbours = [
            SamplingParams(temperature=0.5, top_k=20),
            SamplingParams(temperature=0),
            SamplingParams(min_p=0.1, seed=3),
        ]
        tokens = []
        for step in range(steps):
            rows = torch.randn(others + 1, vocab, device=device)
            rows[position] = target_logits[step]
            seqs = [
                seq(neighbours[i % 3], generator=make_generator(i, device) if i % 3 == 2 else None)
                for i in range(others + 1)
            ]
            seqs[position] = seq(params, generator=gen)
            tokens.append(Sampler()(rows, seqs).token_ids[position])
        return tokens

    alone = run(42, 0, 0)
    assert run(42, 0, 0) == alone
    assert run(42, 2, 4) == alone
    assert run(42, 5, 5) == alone
    assert run(43, 1, 3) != alone


def test_penalties_match_hand_computed_logits() -> None:
    raw = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0], [2.0, -1.0, 0.5, -3.0, 1.0]])
    pen = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    rows = [
        SamplingRow(pen, prompt_token_ids=[0, 3], output_token_ids=[2, 2, 4]),
        SamplingRow(SamplingParams(), prompt_token_ids=[0, 3], output_token_ids=[2, 2, 4]),
    ]
    out = apply_penalties(raw.clone(), rows)
    # token 0: seen in the prompt, 2 / 2; token 1: unseen; token 2: 0.5 / 2 - 0.5 * 2 - 0.25;
    # token 3: -3 * 2 (negative logits are multiplied); token 4: 1 / 2 - 0.5 * 1 - 0.25.
    assert out[0].tolist() == [1.0, -1.0, -1.0, -6.0, -0.25]
    assert torch.equal(out[1], raw[1])


def test_greedy_takes_argmax_of_penalised_logits_and_leaves_input_intact() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0]])
    before = logits.clone()
    params = SamplingParams(temperature=0, frequency_penalty=0.5)
    assert Sampler()(logits, [seq(params, output=(0, 0))]).token_ids == [1]  # 2 - 0.5 * 2 = 1
    assert Sampler()(logits, [seq(params, output=(2,))]).token_ids == [0]
    assert torch.equal(logits, before)


def test_min_tokens_masks_eos_and_stop_ids_then_stops_masking() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.5, 4.0]])  # EOS 4 best, stop id 1 second
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[1])

    def row(output: tuple[int, ...], p: SamplingParams = params) -> SamplingRow:
        return SamplingRow(p, [9], list(output), eos_token_ids=frozenset({4}))

    masked = apply_min_tokens(logits.clone(), [row((2, 2))])
    assert masked[0].tolist() == [0.0, float("-inf"), 1.0, 0.5, float("-inf")]
    assert Sampler()(logits, [row((2, 2))]).token_ids == [2]
    assert Sampler()(logits, [row((2, 2, 2))]).token_ids == [4]  # min_tokens reached
    no_eos = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[1], ignore_eos=True)
    masked = apply_min_tokens(logits.clone(), [row((2,), no_eos)])
    assert masked[0].tolist() == [0.0, float("-inf"), 1.0, 0.5, 4.0]
    probs = processed_probs(logits, [row((), SamplingParams(min_tokens=1, stop_token_ids=[1]))])
    assert probs[0, 1] == 0 and probs[0, 4] == 0 and probs[0].sum().item() == pytest.approx(1)


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax_top_n_sorted_with_sampled_token(device: str) -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 64, device=device) * 3
    seqs = [
        seq(SamplingParams(temperature=0.5, logprobs=5, repetition_penalty=1.3), output=(1, 2)),
        seq(SamplingParams()),  # did not ask
        seq(SamplingParams(temperature=0, logprobs=0)),
        seq(
            SamplingParams(temperature=3.0, logprobs=3, seed=1), generator=make_generator(1, device)
        ),
    ]
    ref = logits.float().log_softmax(-1).cpu()
    for _ in range(10):
        out = Sampler()(logits, seqs)
        assert out.logprobs is not None and out.logprobs[1] == {}
        assert list(out.logprobs[2]) == [out.token_ids[2]]
        for i, n in ((0, 5), (3, 3)):
            lp = out.logprobs[i]
            top = list(lp.items())[:n]
            assert [t for t, _ in top] == ref[i].topk(n).indices.tolist()
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            assert out.token_ids[i] in lp
            assert len(lp) in (n, n + 1)
            for t, v in lp.items():
                assert v == pytest.approx(ref[i, t].item(), abs=1e-5)


def test_processed_probs_sum_to_one_and_match_what_is_drawn() -> None:
    torch.manual_seed(11)
    raw = torch.randn(3, 16)
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05, presence_penalty=0.7)
    seqs = [
        seq(SamplingParams(temperature=0, repetition_penalty=1.5), output=(int(raw[0].argmax()),)),
        seq(params, output=(3, 3, 5)),
        seq(SamplingParams(top_p=0.5)),
    ]
    probs = processed_probs(raw, seqs)
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    penalised = apply_penalties(raw[:1].clone(), [SamplingRow.of(seqs[0])])
    assert probs[0].tolist() == torch.eye(16)[penalised.argmax()].tolist()

    n = 20000
    many = raw[1].expand(n, -1).contiguous()
    counts = np.bincount(Sampler()(many, [seqs[1]] * n).token_ids, minlength=16)
    want = probs[1].double().numpy()
    assert counts[want == 0].sum() == 0 and (want == 0).sum() >= 6
    assert chi2_pvalue(counts, want) > 0.001


def test_shape_mismatch_names_both_sizes() -> None:
    with pytest.raises(ValueError, match=r"\(3, 10\).*2 sequences"):
        Sampler()(torch.zeros(3, 10), [seq(SamplingParams())] * 2)


def test_a_seeded_row_draws_by_its_seed_and_position_alone() -> None:
    """No generator needed: the noise is keyed by (seed, output position), so the same logits
    give the same token, and another position or seed its own draw."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)).repeat(40, 1)

    def draws(seed: int, output: tuple[int, ...]) -> list[int]:
        rows = [SamplingRow(SamplingParams(seed=seed + i), (1, 2), output) for i in range(40)]
        return Sampler()(logits, rows).token_ids

    first = draws(5, ())
    assert draws(5, ()) == first
    assert draws(5, (9,)) != first and draws(6, ()) != first
    assert draws(6, ())[:-1] == first[1:]  # row i of seed 6 is seed 7 + i - 1's draw


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_generator_on_the_wrong_device_is_refused() -> None:
    logits = torch.zeros(1, 10, device="cuda")
    s = seq(SamplingParams(seed=1), generator=make_generator(1, "cpu"))
    with pytest.raises(ValueError, match="make_generator"):
        Sampler()(logits, [s])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_processing_and_drawing_never_wait_for_the_gpu() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 1000, device="cuda")
    seqs = [
        seq(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5]), eos=(0,)),
        seq(SamplingParams(top_k=50, top_p=0.9, frequency_penalty=0.3), output=(1, 2, 2)),
        seq(SamplingParams(min_p=0.1, seed=4), generator=make_generator(4, "cuda")),
        seq(SamplingParams(top_k=7, repetition_penalty=1.2)),
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        probs = processed_probs(logits, seqs)
        sample_from_probs_no_sync(probs, [None, None, seqs[2].request.generator, None])
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70])
def test_seed_outside_64_bits_is_refused_at_validation(seed) -> None:
    from outrider.core import SamplingParams

    with pytest.raises(ValueError, match=r"invalid seed=.*64 bits"):
        SamplingParams(seed=seed)
    SamplingParams(seed=2**63 - 1)  # the largest one is fine


@pytest.mark.parametrize("width", [100, 5000, 49152])
def test_top_candidates_are_each_rows_top_values_and_their_ids(width):
    """top_candidates_no_sync gives each row's GRAMMAR_TOPK highest values, best first, as
    topk does, and k distinct ids that hold those values: in random rows, rows with many ties,
    a row whose best sit at its end, and rows of equal values."""
    g = torch.Generator().manual_seed(width)
    rows = torch.randn(6, width, generator=g).to(torch.bfloat16)
    rows[1, ::7] = 9.0  # ties along the row
    rows[2, -3:] = torch.tensor([11.0, 12.0, 13.0])  # the best at the end
    rows[3] = 1.0  # all tied
    rows[4, : GRAMMAR_TOPK + 5] = 20.0  # more tied at the top than candidates
    packed = top_candidates_no_sync(rows)
    k = min(GRAMMAR_TOPK, width)
    assert packed.shape == (6, 2 * k) and packed.dtype == torch.float64
    ids, values = packed[:, :k].long(), packed[:, k:]
    want, _ = rows.float().topk(k, dim=-1)
    assert torch.equal(values, want.double())
    assert torch.equal(rows.float().gather(1, ids).double(), values)
    assert all(len(set(r.tolist())) == k for r in ids)  # k distinct ids a row
    assert ids[2, :3].tolist() == [width - 1, width - 2, width - 3]
