"""SpecController and StepProfile: the E(k) formula, the acceptance averages, turning speculation
off on a slow verify table and back on with a fast one, the never-lose bound for a drafter that
never matches, reaching the best k for one that always does, hysteresis, and the profile's
padding, extrapolation and JSON cache."""

from __future__ import annotations

import random

import pytest

from outrider.speculative.controller import SpecController, expected_tokens
from outrider.speculative.step_profile import StepProfile

SIZES = (1, 4, 16)


def table(plain: float, per_k: float, max_k: int = 4, square: float = 0.0) -> StepProfile:
    """ms(B, k) = (plain + per_k * k + square * k^2) * (1 + B / 64): a step dearer with k and B."""
    return StepProfile(
        {
            b: {k: (plain + per_k * k + square * k * k) * (1 + b / 64) for k in range(max_k + 1)}
            for b in SIZES
        }
    )


FAST = table(10.0, 1.5)  # verify barely dearer than plain: speculation pays at decent acceptance
SLOW = StepProfile({b: {k: 10.0 * (10.0 if k else 1.0) for k in range(5)} for b in SIZES})


def throughput(profile: StepProfile, batch: int, k: int, accept: float) -> float:
    """Tokens per ms of a batch whose requests all have conditional acceptance `accept`."""
    return batch * expected_tokens([accept] * k, k) / profile.step_ms(batch, k)


def test_expected_tokens_by_hand():
    a = [0.8, 0.5, 0.25]
    assert expected_tokens(a, 0) == 1.0
    assert expected_tokens(a, 1) == pytest.approx(1.8)
    assert expected_tokens(a, 2) == pytest.approx(1 + 0.8 + 0.8 * 0.5)  # 2.2
    assert expected_tokens(a, 3) == pytest.approx(2.2 + 0.8 * 0.5 * 0.25)  # 2.3
    with pytest.raises(ValueError, match="k=4"):
        expected_tokens(a, 4)


def test_observe_updates_accepts_then_one_reject_and_nothing_after():
    c = SpecController(FAST, 4, ema=0.5, prior=0.6)
    assert c.expected("r", 4) == pytest.approx(expected_tokens([0.6] * 4, 4))
    # 3 drafts, first accepted: position 1 accept, position 2 reject, position 3 unseen.
    c.observe("r", 3, 1)
    a1, a2 = 0.6 + 0.5 * (1 - 0.6), 0.6 + 0.5 * (0 - 0.6)
    # Positions never observed read as the deepest observed one.
    assert c.expected("r", 4) == pytest.approx(expected_tokens([a1, a2, a2, a2], 4))
    # All 2 drafts accepted: positions 1 and 2 accept, no reject.
    c.observe("r", 2, 2)
    b1, b2 = a1 + 0.5 * (1 - a1), a2 + 0.5 * (1 - a2)
    assert c.expected("r", 4) == pytest.approx(expected_tokens([b1, b2, b2, b2], 4))
    assert c.snapshot()["acceptance"] == pytest.approx([b1, b2, b2, b2])
    c.observe("r", 0, 0)  # nothing verified: nothing learned
    assert c.expected("r", 4) == pytest.approx(expected_tokens([b1, b2, b2, b2], 4))
    with pytest.raises(ValueError, match="num_accepted=3 of num_drafts=2"):
        c.observe("r", 2, 3)


def test_unseen_request_uses_the_global_average():
    c = SpecController(FAST, 4, prior=0.6)
    for _ in range(20):
        c.observe("good", 4, 4)
    # Only "good" was observed, so the engine-wide average followed the same path.
    for k in range(5):
        assert c.expected("new", k) == pytest.approx(c.expected("good", k))
    good = [c.expected("good", k) for k in range(5)]
    for _ in range(20):
        c.observe("bad", 4, 0)
        c.observe("other", 4, 4)  # a second request, so that the global is not just "bad"
    # "bad" moved the global average but not "good"'s own.
    assert [c.expected("good", k) for k in range(5)] == good
    assert c.expected("bad", 2) < c.expected("new", 2) < c.expected("good", 2)
    assert SpecController(FAST, 4).choose(["x"]) > 0  # the prior alone pays on FAST
    assert c.choose(["good"]) > 0
    c2 = SpecController(FAST, 4)
    for _ in range(40):
        c2.observe("bad", 4, 0)
    assert c2.choose(["bad"]) == 0
    c.forget("good")
    assert c.expected("good", 3) == c.expected("new", 3)


def test_slow_verify_turns_speculation_off_and_a_fast_one_back_on():
    batch = [f"r{i}" for i in range(4)]
    c = SpecController(FAST, 4)
    for rid in batch:
        for _ in range(50):
            c.observe(rid, 4, 4)
    assert c.choose(batch) > 0
    c.set_profile(SLOW)  # a verify 10x plain: even 5 tokens a step cannot pay
    assert all(c.choose(batch) == 0 for _ in range(500)), "slow verify must stay off, probes too"
    assert c.snapshot()["probes"] == 0
    c.set_profile(FAST)
    assert c.choose(batch) > 0
    fresh = SpecController(SLOW, 4, prior=1.0)
    assert fresh.choose(batch) == 0


def test_ties_with_plain_lose():
    # Full acceptance at k = 1 gives 2 tokens for exactly twice the time: no gain, so plain.
    profile = StepProfile({b: {0: 5.0, 1: 10.0} for b in SIZES})
    c = SpecController(profile, 1, prior=1.0, hysteresis=0.0)
    assert [c.choose(["a", "b"]) for _ in range(300)] == [0] * 300


def test_drafter_that_never_matches_stays_within_5_percent_of_plain():
    batch, probe_every = [f"r{i}" for i in range(8)], 64
    c = SpecController(FAST, 4, probe_every=probe_every)
    tokens = ms = 0.0
    chosen = []
    for _ in range(1000):
        k = c.choose(batch)
        chosen.append(k)
        tokens += len(batch)  # nothing accepted: one token per request, whatever k
        ms += FAST.step_ms(len(batch), k)
        for rid in batch:
            if k:
                c.observe(rid, k, 0)
    plain = len(batch) / FAST.step_ms(len(batch), 0)
    assert tokens / ms >= 0.95 * plain
    # It turned off, then only probed: at most one k > 0 per probe_every plain steps.
    late = sum(k > 0 for k in chosen[100:])
    assert 1 <= late <= len(chosen[100:]) // probe_every + 1
    assert c.snapshot()["probes"] >= 1

    # The drafter starts matching: probes notice, and speculation comes back on.
    for _ in range(600):
        k = c.choose(batch)
        for rid in batch:
            if k:
                c.observe(rid, k, k)
    assert all(c.choose(batch) > 0 for _ in range(20))


@pytest.mark.parametrize("profile", [table(10.0, 3.0), table(10.0, 0.0, square=1.5)])
def test_drafter_that_always_matches_reaches_the_best_k(profile):
    batch = [f"r{i}" for i in range(4)]
    rates = {k: throughput(profile, len(batch), k, 1.0) for k in range(5)}
    best = max(rates, key=rates.__getitem__)
    runner_up = max(t for k, t in rates.items() if k != best)
    assert rates[best] > 1.05 * runner_up, "the test needs a best k that hysteresis cannot hide"
    c = SpecController(profile, 4)
    chosen = []
    for _ in range(300):
        k = c.choose(batch)
        chosen.append(k)
        for rid in batch:
            c.observe(rid, k, k)
    assert chosen[-100:] == [best] * 100
    snap = c.snapshot()
    assert snap["k"] == c.last_k == best
    assert max(snap["tokens_per_s"], key=snap["tokens_per_s"].__getitem__) == best
    assert sum(snap["steps"].values()) == 300


def flips(hysteresis: float) -> int:
    """Switches of k over a run where k = 2 and k = 3 nearly tie at acceptance 0.7."""
    profile = table(10.0, 2.3)
    rng = random.Random(0)
    batch = [f"r{i}" for i in range(4)]
    c = SpecController(profile, 4, hysteresis=hysteresis)
    chosen = []
    for _ in range(500):
        k = c.choose(batch)
        chosen.append(k)
        for rid in batch:
            m = 0
            while m < k and rng.random() < 0.7:
                m += 1
            c.observe(rid, k, m)
    late = chosen[100:]
    return sum(a != b for a, b in zip(late, late[1:]))


def test_hysteresis_keeps_the_choice_through_noise():
    profile = table(10.0, 2.3)
    assert throughput(profile, 4, 2, 0.7) == pytest.approx(throughput(profile, 4, 3, 0.7), rel=0.01)
    noisy = flips(0.0)
    assert noisy >= 10, "without hysteresis the noise should flip the choice (test premise)"
    assert flips(0.05) <= 2


def test_step_ms_pads_to_the_next_measured_size_and_extrapolates():
    p = StepProfile({4: {0: 2.0, 2: 3.0}, 1: {0: 1.0, 2: 1.5}, 8: {0: 3.0, 2: 5.0}})
    assert list(p.ms) == [1, 4, 8] and p.ks == [0, 2]
    assert p.step_ms(1, 0) == 1.0
    assert p.step_ms(2, 2) == 3.0  # padded up to 4
    assert p.step_ms(4, 2) == 3.0
    assert p.step_ms(5, 0) == 3.0
    assert p.step_ms(16, 2) == pytest.approx(5.0 + (16 - 8) * (5.0 - 3.0) / (8 - 4))
    assert p.step_ms(12, 0) == pytest.approx(3.0 + (12 - 8) * (3.0 - 2.0) / (8 - 4))
    with pytest.raises(ValueError, match=r"k=1 .*\[0, 2\]"):
        p.step_ms(4, 1)
    with pytest.raises(ValueError, match="batch_size=0"):
        p.step_ms(0, 0)
    # Noise can make the larger size faster; extrapolation never goes below the largest.
    noisy = StepProfile({4: {0: 3.0}, 8: {0: 2.5}})
    assert noisy.step_ms(64, 0) == 2.5


def test_profile_validation():
    with pytest.raises(ValueError, match="k = 0"):
        StepProfile({1: {1: 2.0}})
    with pytest.raises(ValueError, match="same k's"):
        StepProfile({1: {0: 1.0, 1: 2.0}, 8: {0: 1.0}})
    with pytest.raises(ValueError, match="invalid times"):
        StepProfile({1: {0: 0.0}})
    with pytest.raises(ValueError, match="batch sizes"):
        StepProfile({})
    with pytest.raises(ValueError, match=r"ks \[3\]"):
        SpecController(StepProfile({1: {0: 1.0, 1: 1.1}}), 4, ks=[1, 3])
    with pytest.raises(ValueError, match="none in 1..max_k=4"):
        SpecController(StepProfile({1: {0: 1.0}}), 4)


def test_profile_json_round_trip_and_load(tmp_path):
    key = {"machine": "h200", "model": "llama-3.1-8b", "drafter": "eagle3", "dtype": "bfloat16"}
    p = StepProfile({1: {0: 1.0, 1: 1.25}, 8: {0: 1.5, 1: 2.0}}, key=key)
    q = StepProfile.from_json(p.to_json())
    assert q == p and all(isinstance(b, int) for b in q.ms) and list(q.ms[8]) == [0, 1]
    path = tmp_path / "cache" / "profile.json"
    assert StepProfile.load(path) is None  # missing
    p.save(path)
    assert StepProfile.load(path) == p
    assert StepProfile.load(path, key) == p
    assert StepProfile.load(path, {**key, "dtype": "float16"}) is None
    path.write_text("not json")
    with pytest.raises(ValueError, match="delete it"):
        StepProfile.load(path)


def test_monotone_profile_removes_dips_in_k_and_batch_size():
    noisy = StepProfile({1: {0: 1.5, 1: 1.6, 2: 1.5, 3: 2.2, 4: 1.8}, 8: {0: 1.4, 1: 2.0, 2: 2.1,
                                                                        3: 2.3, 4: 2.4}})  # fmt: skip
    clean = noisy.monotone()
    assert clean.ms[1] == {0: 1.5, 1: 1.6, 2: 1.6, 3: 2.2, 4: 2.2}
    assert clean.ms[8] == {0: 1.5, 1: 2.0, 2: 2.1, 3: 2.3, 4: 2.4}
    for row in clean.ms.values():
        values = list(row.values())
        assert values == sorted(values)


def test_measured_steps_refine_the_profile_and_turn_a_losing_k_off():
    """A start-up table that makes k=2 look cheap picks it; steps measured at three times that
    cost make the controller go back to plain, and a new table forgets the measurements."""
    table = StepProfile({4: {0: 10.0, 1: 11.0, 2: 12.0}})
    ctl = SpecController(table, max_k=2, hysteresis=0.0, prior=0.6)
    ids = [f"r{i}" for i in range(4)]
    assert ctl.choose(ids) == 2  # E(2) = 1.96 per 12 ms beats 1 per 10 ms
    for _ in range(30):
        ctl.record_step(4, 2, 36.0)
        ctl.record_step(4, 1, 33.0)
    assert ctl.choose(ids) == 0  # 1.96 / 36 < 1 / 10
    ctl.record_step(3, 0, float("nan"))  # ignored, not a poisoned table
    ctl.set_profile(table)
    assert ctl.choose(ids) == 2


def test_host_work_timed_at_one_k_is_assumed_for_the_ks_not_yet_timed():
    """One speculative step timed at 40 ms where the table said 12 (a slow host lookup) makes
    the controller assume the other k cost 28 ms more too, so it goes to plain at once rather
    than trying each k in turn; plain's own entry is untouched by it."""
    table = StepProfile({4: {0: 10.0, 1: 11.0, 2: 12.0}})
    ctl = SpecController(table, max_k=2, hysteresis=0.0, prior=0.9)
    ids = [f"r{i}" for i in range(4)]
    assert ctl.choose(ids) == 2
    ctl.record_step(4, 2, 40.0)
    assert ctl._step_ms(4, 1) == 11.0 + 28.0 and ctl._step_ms(4, 0) == 10.0
    assert ctl.choose(ids) == 0  # E(1) = 1.9 per 39 ms and E(2) = 2.71 per 40 ms < 1 per 10
    ctl.record_step(4, 0, 12.0)  # plain's host work raises plain alone
    assert ctl._step_ms(4, 0) == 12.0 and ctl._step_ms(4, 1) == 39.0


@pytest.mark.parametrize("exact", [False, True])
def test_steps_of_other_batch_sizes_in_a_bucket_price_it_only_where_steps_are_padded(exact):
    """Steps padded to the profile's batch sizes (CUDA graphs) cost their bucket's time, so a
    2-row step's time is the 4-row bucket's; eager steps (exact_batches: the CPU) cost their
    own rows', and slow 2-row steps (a wave's tail) must not make plain look dear at 4 rows,
    where k=1 would then be chosen at a loss."""
    table = StepProfile({1: {0: 30.0, 1: 35.0}, 4: {0: 40.0, 1: 50.0}})
    ctl = SpecController(table, max_k=1, hysteresis=0.0, prior=0.3, exact_batches=exact)
    four = [f"r{i}" for i in range(4)]
    for _ in range(5):
        ctl.record_step(4, 0, 38.0)
        ctl.record_step(4, 1, 50.0)
    assert ctl.choose(four) == 0  # 4 x 1.3 / 50 < 4 / 38
    for _ in range(9):
        ctl.record_step(2, 0, 50.0)
    assert ctl._step_ms(2, 0) == 50.0
    if exact:  # 4 rows keep their own time
        assert ctl._step_ms(4, 0) == 38.0 and ctl.choose(four) == 0
        assert ctl.live_table()[2] == {0: 50.0} and ctl.live_table()[4][0] == 38.0
    else:  # one bucket: what a step of it costs now
        assert ctl._step_ms(4, 0) == 50.0 and ctl.choose(four) == 1


def test_one_stalled_step_does_not_hold_a_k_off():
    """Live times are the median of the recent steps (the least of fewer than 3): a stalled step
    among normal ones moves nothing, a stalled first step is undone by the next normal one (and
    dropped: a step under half what the window said replaces it)."""
    table = StepProfile({4: {0: 10.0, 1: 11.0, 2: 12.0}})
    ctl = SpecController(table, max_k=2, hysteresis=0.0, prior=0.9)
    ids = [f"r{i}" for i in range(4)]
    ctl.record_step(4, 2, 200.0)
    assert ctl.choose(ids) == 0  # seen once, at 200 ms
    ctl.record_step(4, 2, 12.5)
    assert ctl._step_ms(4, 2) == 12.5 and ctl.choose(ids) == 2
    for ms in (12.0, 300.0, 13.0, 12.5):
        ctl.record_step(4, 2, ms)
    assert ctl._step_ms(4, 2) == 12.5 and ctl.choose(ids) == 2  # of 12.5 12 300 13 12.5
    for _ in range(9):  # slow every time now: the window turns over
        ctl.record_step(4, 2, 60.0)
    assert ctl._step_ms(4, 2) == 60.0 and ctl.choose(ids) == 0


def test_the_controller_says_why_it_speculates_or_not():
    """The line a user reads when speculation stayed off names the figures it was decided on,
    where each came from, and the verdict; once steps are timed live and drafts verified, it
    says so and may turn."""
    table = StepProfile({1: {0: 50.0, 4: 120.0}})  # k=4 at 2.4x a plain step
    c = SpecController(table, max_k=4, ks=[0, 4])
    why = c.explain(1)
    assert why.startswith("k=4: 2.31 tokens a step") and "assumed" in why
    assert "2.40x plain's 50.0 ms" in why and "start-up profile" in why
    assert why.endswith("plain decoding is faster") and c.choose(["r"]) == 0
    for _ in range(3):  # the live k=4 step is cheaper than the profile said ...
        c.record_step(1, 4, 70.0)
    for _ in range(30):  # ... and every draft is accepted
        c.observe("r", 4, 4)
    why = c.explain(1)
    assert "timed live" in why and "seen" in why and why.endswith("speculation pays")
    assert c.choose(["r"]) == 4


def test_a_profile_that_overstates_plain_is_corrected_by_plain_probes():
    """A start-up table measured on a busy machine says a plain step costs 250 ms where it
    costs 60: the controller speculates, and being timed, takes a plain step now and then
    until plain's cost was seen live; then it goes plain where speculation loses."""
    table = StepProfile({1: {0: 250.0, 4: 120.0}})
    ctl = SpecController(table, max_k=4, hysteresis=0.0, prior=0.3, probe_every=8)
    true_ms = {0: 60.0, 4: 120.0}
    ks = []
    for _ in range(120):
        k = ctl.choose(["r"])
        ks.append(k)
        ctl.record_step(1, k, true_ms[k])
        if k:
            ctl.observe("r", k, 0)  # nothing accepted: E(4) = 1 token per 120 ms
    first_plain = ks.index(0)
    assert all(k == 4 for k in ks[:first_plain]) and 4 <= first_plain <= 20
    # Plain from then on but for the usual probes back: one a 8 x 120 ms of plain steps.
    assert ks[-40:].count(4) <= 3 and ks[first_plain + 1 : first_plain + 11] == [0] * 10
    assert ctl._step_ms(1, 0) == 60.0


@pytest.mark.parametrize("ahead", [True, False])
def test_plain_probes_time_a_plain_step_run_ahead_where_steps_run_ahead(ahead):
    """A start-up table that overstates plain (30 ms, where a plain step run ahead takes 10 and
    the first one after a speculative step, launched after its read, 25) and verifies yielding
    2 tokens in 40 ms. Probes of one plain step each time only the first kind, and 1/25 ms
    loses to 2/40: speculation would stay on at half plain's rate. Run ahead, a probe is two
    plain steps, the second timed as plain's cost, and plain wins."""
    table = StepProfile({1: {0: 30.0, 4: 40.0}})
    ctl = SpecController(table, max_k=4, hysteresis=0.0, probe_every=2)
    ctl.ahead = ahead
    ks, prev = [], 4
    for _ in range(60):
        k = ctl.choose(["r"])
        ks.append(k)
        ms = 40.0 if k else (25.0 if prev else 10.0) if ahead else 25.0
        ctl.record_step(1, k, ms)
        if k:
            ctl.observe("r", 4, 1)  # one of four accepted: 2 tokens a verify
        prev = k
    first_plain = ks.index(0)
    if ahead:
        assert ks[first_plain : first_plain + 2] == [0, 0]  # a probe of two steps
        assert ctl._step_ms(1, 0) == 10.0
        assert ks[-20:].count(0) >= 18  # plain, but for probes back
    else:  # not run ahead, every plain step costs 25 ms: 1/25 loses to 2/40, it speculates
        assert ks[first_plain + 1] == 4 and ctl._step_ms(1, 0) == 25.0
        assert ks[-20:].count(4) >= 18


@pytest.mark.parametrize("ahead", [True, False])
def test_one_short_period_of_a_plain_step_run_ahead_is_not_its_cost(ahead):
    """Run ahead, a plain step's time is its period, which swings with the host work around it:
    one short period (tokens found ready after a long step) is not a stall ending, and plain's
    cost stays the median. Read before the next is launched, a step under half the window
    still replaces stalls (speculative steps' first uses compile kernels)."""
    ctl = SpecController(_flat(2.0, 3.0), 2)
    ctl.ahead = ahead
    for ms in (2.0, 2.1, 1.9, 2.0):
        ctl.record_step(16, 0, ms)
    ctl.record_step(16, 0, 0.37)
    assert ctl.live_table()[16][0] == (2.0 if ahead else 0.37)


def test_no_plain_probe_once_plain_was_timed():
    """With plain's cost timed live (three times) and speculation winning, every step
    speculates: no plain probes cost it anything."""
    table = StepProfile({1: {0: 50.0, 4: 60.0}})
    ctl = SpecController(table, max_k=4, hysteresis=0.0, probe_every=4)
    for _ in range(3):
        ctl.record_step(1, 0, 50.0)
    ks = []
    for _ in range(50):
        k = ctl.choose(["r"])
        ks.append(k)
        ctl.record_step(1, k, 60.0 if k else 50.0)
        ctl.observe("r", k, k)  # every draft accepted
    assert set(ks) == {4}


def test_stalled_first_speculative_steps_do_not_hold_speculation_off():
    """The first speculative steps at a batch size stall (kernels compiling at first use) and
    turn speculation off there. Probes are judged by the start-up profile, so one comes after
    probe_every plain steps' time; its normal time replaces the stalls and speculation is back."""
    table = StepProfile({16: {0: 10.0, 3: 12.0}})
    ctl = SpecController(table, max_k=3, ks=[0, 3], hysteresis=0.0, probe_every=8)
    ids = [f"r{i}" for i in range(16)]
    for rid in ids:
        for _ in range(20):
            ctl.observe(rid, 3, 2)  # two of three drafts accepted: speculation pays at 12 ms
    assert ctl.choose(ids) == 3
    for ms in (900.0, 700.0, 800.0):  # three stalled steps
        ctl.record_step(16, 3, ms)
    ks = []
    for _ in range(40):
        k = ctl.choose(ids)
        ks.append(k)
        ctl.record_step(16, k, 10.0 if k == 0 else 12.0)
    first = ks.index(3)
    assert ks[0] == 0 and first <= 11, ks  # a probe once plain ran 8 x 12 ms
    assert ctl._step_ms(16, 3) == 12.0 and set(ks[first:]) == {3}, ks


def _flat(plain: float, spec: float) -> StepProfile:
    """Every batch size: plain `plain` ms, every k > 0 `spec` ms."""
    return StepProfile({b: {0: plain, 1: spec, 2: spec} for b in SIZES})


def test_a_step_with_prompts_charges_speculation_the_prompts_forward_of_its_own():
    # E(2) = 1 + 0.6 + 0.36 = 1.96: 1.96 / 12 ms beats 1 / 10 ms on a step of decodes alone,
    # so decode steps of 4 rows yield r = 4 x 1.96 / 12 = 0.653 tokens a ms.
    c = SpecController(_flat(10.0, 12.0), 2, prior=0.6)
    ids = [f"r{i}" for i in range(4)]
    assert c.choose(ids) == 2
    # With prompts, untimed: the prompts' forward read as a plain step. Plain: 4 tokens less
    # r x 10 ms = -2.53; k = 2: 7.84 less r x (10 + 12) = -6.53. The rows ride along.
    assert c.choose(ids, prompts=True) == 0
    assert c.snapshot()["tokens_per_s"][0] == pytest.approx(4 / 10 * 1e3)
    # Timed live: prompt steps cost 30 ms whole (a long prompt), alone as much. A step's rate
    # would now favour speculating (7.84 / 42 > 4 / 30), but its 12 ms verify yields 3.84
    # tokens where decode steps yield 7.84: plain (-15.6 against -19.6).
    for _ in range(3):
        c.record_prompts(4, 30.0, alone=False)
    assert c.choose(ids, prompts=True) == 0
    # The prompts' forward alone costs 20 ms, 10 less than with the rows in it: the verify
    # adds 2 ms, for 3.84 tokens. Speculate (-13.07 against -15.6).
    for _ in range(9):
        c.record_prompts(4, 20.0, alone=True)
    assert c.choose(ids, prompts=True) == 2
    assert c.choose(ids) == 2  # a step without prompts decides as before
    assert c.live_table()[4] == {"alone": 20.0, "mixed": 30.0}


def test_a_step_with_prompts_keeps_the_drafts_a_drafter_inside_the_step_made():
    # Acceptance 0.9: E(2) = 2.71, decode steps of 4 rows yield r = 4 x 2.71 / 12 = 0.903 a ms.
    c = SpecController(_flat(10.0, 12.0), 2, prior=0.9)
    ids = [f"r{i}" for i in range(4)]
    for _ in range(3):
        c.record_prompts(4, 20.0, alone=False)
        c.record_prompts(4, 20.0, alone=True)
    assert c.choose(ids) == 2
    # Plain: 4 - r x 20 = -14.07; k = 2: 10.84 - r x 32 = -18.07.
    assert c.choose(ids, prompts=True) == 0
    # A drafter that drafts inside the step: after a plain step the rows have no drafts, and
    # the next step only drafts, 12 ms for 4 tokens where decode steps yield 10.84: plain
    # loses that too (-20.9), so the step verifies.
    c.drafts_inside = True
    assert c.choose(ids, prompts=True) == 2
    # Rows that hold no drafts lose nothing by a plain step.
    assert c.choose(ids, prompts=True, drafted=[False] * 4) == 0
    assert c.choose(ids, prompts=True, drafted=[True, False, False, False]) == 0
    assert c.choose(ids, prompts=True, drafted=[True, True, True, False]) == 2


def test_rows_without_drafts_pay_their_draft_only_step_over_a_run():
    # k = 2 at 18 ms, E(2) = 1.96: 7.84 / 18 = 0.436 tokens a ms against plain's 0.4.
    ids = [f"r{i}" for i in range(4)]
    c = SpecController(_flat(10.0, 18.0), 2, prior=0.6)
    assert c.choose(ids, drafted=[False] * 4) == 2  # drafts made outside the step: no matter
    c = SpecController(_flat(10.0, 18.0), 2, prior=0.6)
    c.drafts_inside = True
    # Turning on, every row only drafts in the first step: over a run of 16 steps a row yields
    # 1.96 - 0.96 / 16 a step, 7.6 / 18 = 0.422 a ms: still worth it.
    assert c.choose(ids, drafted=[False] * 4) == 2
    assert c.choose(ids) == 2
    # Prompts arrive every third step (their forward alone 30 ms, mixed 10: plain there), and
    # each drops the rows' drafts.
    for _ in range(3):
        c.record_prompts(4, 10.0, alone=False)
        c.record_prompts(4, 30.0, alone=True)
    runs = []
    for _ in range(12):
        assert c.choose(ids, prompts=True) == 0
        runs.append(c.run_steps)
        if c.choose(ids, drafted=[False] * 4) == 0:
            break
        assert c.choose(ids) == 2
    # A switch-on pays while 1.96 - 0.96 / L a row beats 0.4 x 18 / 4 = 1.8: runs of 6 steps
    # or more. Runs of 3 bring the average there (from 16: 12.75, 10.3, ..., 6.1, 5.3) and
    # turning on stops, while rows that hold drafts keep speculating.
    assert runs == pytest.approx([12.75, 10.312, 8.484, 7.113, 6.085, 5.314], abs=1e-3)
    assert c.choose(ids, drafted=[False] * 4) == 0
    assert c.choose(ids, drafted=[True] * 4) == 2
    with pytest.raises(ValueError, match="run_prior=0.5"):
        SpecController(_flat(10.0, 18.0), 2, run_prior=0.5)


@pytest.mark.parametrize("ahead", [True, False])
def test_the_plain_step_after_a_speculative_one_is_charged_to_it_when_steps_run_ahead(ahead):
    c = SpecController(_flat(10.0, 12.0), 2)
    c.ahead = ahead
    for _ in range(3):
        c.record_step(4, 0, 10.0)
    c.record_step(4, 2, 12.0)
    c.record_step(4, 0, 19.0)  # launched with nothing ahead of it: host and device in turn
    if ahead:
        assert c.live_table()[4] == {0: 10.0, 2: 21.0}
    else:
        assert c.live_table()[4] == {0: 10.0, 2: 12.0}  # median of 10, 10, 10, 19
    c.record_step(4, 0, 10.0)  # the next plain step is one as any other
    assert c.live_table()[4][0] == 10.0
