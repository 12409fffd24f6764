"""Adaptive speculation: how many drafts k the next step verifies, so that speculation runs only
where it beats plain decoding on this machine ("never lose").

A StepProfile (step_profile.py), measured once per (machine, model, drafter, dtype), says what
one step costs at each padded batch size and k (the runner's part); every decode step the engine
then runs, timed whole with its host work (record_step), refines the entry it used. Acceptance
averages, updated after every verify, say how many tokens each k should yield. One k serves the
whole batch (verify graphs are captured per (batch, 1 + k), so a mixed batch would pad to its
largest k anyway).

Model: a_i = P(draft i accepted | drafts 1..i-1 accepted), an exponential moving average per
request, plus an engine-wide one that requests never observed use.

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j     tokens per step, the target's own token included
    a = [0.8, 0.5]:  E(0) = 1,  E(1) = 1 + 0.8 = 1.8,  E(2) = 1.8 + 0.8 * 0.5 = 2.2

A verify of n drafts with the first m accepted updates positions 1..min(m + 1, n): accepts at
1..m, a reject at m + 1; later positions saw nothing and keep their value. A position never
observed reads as the deepest observed one (`prior` before any): choosing k observes nothing past
k, so with the prior there a drafter that always matches could stall below the best k (step ms
10 + 3k, full acceptance, prior 0.6: stuck at k = 2, 21% slower than k = 4).

Decision: throughput(k) = sum_r E_r(k) / step_ms(B, k). The best k wins unless the previous
decision is within `hysteresis` of it (relative), so noise does not switch graphs every step;
but a k > 0 is never returned unless its throughput is strictly above plain's.

Exploration, and what it costs: while k = 0 nothing is verified, so the averages freeze at the
values that turned speculation off and a drafter that starts matching again (a new conversation,
a copy-heavy answer) would never be noticed. So once the plain steps since the last speculative
one have taken `probe_every` times as long as a step at the best k > 0, that k is returned once
(a probe) and its verify refreshes the averages. A probe of a drafter that never matches still
yields one token per request, so it only loses its extra time, (ms_k - ms_0) / ms_k of one step
in every probe_every + 1 or more: under 1 / (probe_every + 1) of the time (1.5% at 64; 0.2% when
verify costs 15% more than plain). No probes when no k could beat plain even at full acceptance.
The other way, while a k > 0 serves and the plain step at that batch size has not been timed
live three times, one plain step is taken once the speculative ones have run `probe_every`
plain steps' time: a profile that overstates plain's cost is corrected within a few probes.
Where plain steps run ahead (`ahead`), the probe is two plain steps: the first, launched after
the speculative step was read, costs host and device in turn and is not what a plain step in a
run of them costs; the second, launched before the first was read, is (record_step).

Steps with prompt chunks (requests arriving) are decided apart (choose(prompts=True)): plain,
the decode rows ride along in the prompts' forward; speculative, the prompts run in a forward
of their own before the verify. Both kinds are timed live (record_prompts), and a k pays there
only if its extra tokens beat what a whole verify's time yields in decode steps. Where the
drafter drafts inside the step (`drafts_inside`), a row without drafts (speculation just turned
on, a request just admitted) verifies none: it counts one token a step, its draft-only step
spread over a run of speculative steps as long as arriving prompts let runs last. Where plain
steps run ahead of their read (`ahead`), the first plain step after a step read before the next
was launched costs host and device in turn; what it costs over a plain step run ahead is
charged to the step before it (record_step), so speculating pays for the pipeline it drains.

Cost, host-side and sync-free: at B = 256, max_k = 4 (Python 3.11, a shared 2-core VM) a choose
takes 30 us and the step's 256 observes 0.6 ms. Call forget() when a request finishes.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from itertools import repeat

from outrider.speculative.step_profile import StepProfile


def _robust(window: Sequence[float]) -> float:
    """What a (batch key, k) costs from its recent steps: the median, or the least of fewer than 3."""
    if len(window) < 3:
        return min(window)
    return statistics.median(window)


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j, with acceptance[i - 1] = a_i."""
    if not 0 <= k <= len(acceptance):
        raise ValueError(f"k={k} needs acceptance at positions 1..{k}, got {len(acceptance)}")
    return _cumulative(acceptance[:k])[k]


def _cumulative(acceptance: Sequence[float]) -> list[float]:
    """[E(0), E(1), ..., E(len(acceptance))] in one pass."""
    out, p = [1.0], 1.0
    for a in acceptance:
        p *= a
        out.append(out[-1] + p)
    return out


class SpecController:
    """Chooses k before every decode step; see the module docstring for the model and the cost.
    Call choose() once per step, observe() after each request's verify, forget() at finish."""

    def __init__(
        self,
        profile: StepProfile,
        max_k: int,
        *,
        ks: Sequence[int] | None = None,
        hysteresis: float = 0.05,
        ema: float = 0.1,
        probe_every: int = 64,
        prior: float = 0.6,
        run_prior: float = 16.0,
        exact_batches: bool = False,
    ) -> None:
        """exact_batches: steps run at their own batch size (eagerly: a CPU), not padded to the
        profile's batch sizes (CUDA graphs): live step times are kept per batch size (`_key`)."""
        if max_k < 0:
            raise ValueError(f"invalid max_k={max_k}: use 0 (never speculate) or more")
        if not 0 < ema <= 1:
            raise ValueError(f"invalid ema={ema}: use a weight in (0, 1], e.g. 0.1")
        if not 0 <= prior <= 1:
            raise ValueError(f"invalid prior={prior}: it is a probability, e.g. 0.6")
        if hysteresis < 0:
            raise ValueError(f"invalid hysteresis={hysteresis}: use a fraction >= 0, e.g. 0.05")
        if run_prior < 1:
            raise ValueError(f"invalid run_prior={run_prior}: use a step count >= 1, e.g. 16")
        if probe_every < 1:
            raise ValueError(f"invalid probe_every={probe_every}: use an integer >= 1, e.g. 64")
        if ks is not None and max(ks, default=0) > max_k:
            raise ValueError(f"ks={list(ks)} go past max_k={max_k}: drop them or raise max_k")
        self.max_k, self.hysteresis, self.ema = max_k, hysteresis, ema
        self.exact_batches = exact_batches
        self.probe_every, self.prior = probe_every, prior
        self._ks_given = None if ks is None else sorted(set(ks) | {0})
        self.set_profile(profile)
        self._global: list[float] = []  # observed prefix a_1..a_d, engine-wide
        self._global_expect: list[float] | None = None  # E(0..max_k) engine-wide, lazily
        self._accept: dict[str, list[float]] = {}
        self._expect: dict[str, list[float]] = {}  # E(0..max_k) per request, kept fresh
        self._decision: int | None = None  # the last choice before probing, what hysteresis holds
        self._plain_ms = 0.0  # time in plain steps since the last speculative one
        self._spec_ms = 0.0  # and in speculative steps since the last plain one
        self._timed = False  # whether record_step has timed a step: plain probes measure
        self._last_k, self._last_probe, self._last_batch = 0, False, 0
        self._probe_again = False  # a plain probe's second step comes next (`ahead`)
        self._last_tps: dict[int, float] = {}
        self._steps: dict[int, int] = {}
        self._probes = 0
        self.live_window = 9
        # (batch key, k) -> the last live_window measured ms, newest last, and what they say
        # the step costs (_robust of them; read every choose, so kept, not recomputed)
        # (batch key, "mixed" or "alone") the same for steps with prompt chunks (record_prompts).
        self._live: dict[tuple[int, int | str], deque[float]] = {}
        self._live_ms: dict[tuple[int, int | str], float] = {}
        # Whether plain steps run ahead of their read (async scheduling): then the plain step
        # after a speculative one is charged in part to it (record_step).
        self.ahead = False
        # Whether the drafter drafts inside the speculative step (EAGLE-3): then the first
        # speculative step after a plain one verifies nothing (_with_prompts).
        self.drafts_inside = False
        self._last_timed: tuple[int, int | str] | None = None  # the last step entered
        # (batch bucket, speculative?) -> the last live step's ms over its profile entry: what
        # a k not yet timed at that bucket is assumed to cost on top of its own entry.
        self._extra: dict[tuple[int, bool], float] = {}
        # Steps since prompts last came with plain chosen for them (which ends a run of
        # speculative steps: every row's drafts are dropped), and how many steps lie between
        # such prompts (an average, from run_prior): how long a run of speculative steps can
        # last, over which a row without drafts pays its draft-only step (_draftless). Counted
        # whatever k the steps take, so the average says how traffic cuts runs, not how
        # often the controller switched.
        self._since, self.run_steps = 0, run_prior

    @property
    def profile(self) -> StepProfile:
        return self._profile

    def set_profile(self, profile: StepProfile) -> None:
        """Use another cost table (re-measured, or another machine's); acceptance is kept."""
        if self._ks_given is None:
            ks = [0, *(k for k in profile.ks if 1 <= k <= self.max_k)]
            if self.max_k >= 1 and ks == [0]:
                raise ValueError(
                    f"step profile measures k {profile.ks}, none in 1..max_k={self.max_k}: "
                    "measure it with those k, or pass ks=[0] to never speculate"
                )
        else:
            ks = self._ks_given
            missing = [k for k in ks if k not in profile.ks]
            if missing:
                raise ValueError(
                    f"ks {missing} are not in the step profile (measured k: {profile.ks}): "
                    "measure them, or leave ks=None to use the measured ones"
                )
        self._profile, self._ks = profile, ks
        # Measurements refine the table they were made against.
        self._live, self._live_ms, self._extra = {}, {}, {}
        self._last_timed = None

    def choose(
        self,
        request_ids: Sequence[str],
        prompts: bool = False,
        drafted: Sequence[bool] | None = None,
    ) -> int:
        """k for the next step of a batch of these requests (len = batch size). An empty batch
        gets 0 and changes nothing. prompts: the step also computes prompt chunks (requests
        arriving), which a speculative step runs as a forward of their own before its verify,
        where a plain step takes its decode rows along in the prompts' forward
        (`_with_prompts`). drafted: whether each request holds drafts for the step (None: all
        do), read where the drafter drafts inside the step (`drafts_inside`): a row without
        them verifies none (`_draftless`)."""
        batch = len(request_ids)
        if batch == 0:
            return 0
        engine = self._engine_expect()
        rows = map(self._expect.get, request_ids, repeat(engine))
        totals = list(map(sum, zip(*rows)))  # sum_r E_r(k), k = 0..max_k
        if self.drafts_inside and drafted is not None and not all(drafted):
            if any(drafted):
                ids = [r for r, d in zip(request_ids, drafted) if not d]
                bare = list(map(sum, zip(*map(self._expect.get, ids, repeat(engine)))))
            else:  # every row (after plain steps): their sums are the totals
                bare = totals
            self._draftless(totals, bare)
        if prompts and len(self._ks) > 1:
            held = batch if drafted is None else sum(map(bool, drafted))
            return self._with_prompts(batch, totals, held / batch)
        step_ms = self._step_ms
        tps = {k: totals[k] / step_ms(batch, k) for k in self._ks}  # tokens per ms
        plain, best = tps[0], 0
        for k in self._ks:  # ascending: ties go to the smaller (cheaper, safer) k
            if tps[k] > tps[best]:
                best = k
        prev = self._decision
        keep = (
            prev in tps
            and (prev == 0 or tps[prev] > plain)  # hysteresis never holds a losing k
            and tps[best] <= tps[prev] * (1 + self.hysteresis)
        )
        self._decision = k = prev if keep else best
        probe = False
        if self._probe_again:  # a plain probe's second step: the one run ahead, timed
            self._probe_again = False
            return self._chosen(batch, 0, True, tps)
        if k == 0 and len(self._ks) > 1:
            # Judged by the start-up profile, not the live times: a k whose first live steps
            # stalled (kernels compiling at their first use, an allocation) would otherwise
            # look unable to win, never be probed, and hold speculation off at that batch size
            # for good (Moonlight at C=16 on the H200: 1.01x plain where a fixed k gave 2.17x).
            # A probe's step, timed, then replaces the stalls (record_step).
            prof = self._profile.step_ms
            probe_k = max(self._ks[1:], key=tps.__getitem__)
            probe = self._plain_ms >= self.probe_every * prof(batch, probe_k) and any(
                (1 + j) * prof(batch, 0) > (1 + self.hysteresis) * prof(batch, j)
                for j in self._ks[1:]
            )
            if probe:
                k = probe_k
        elif k > 0 and self._timed and len(self._live.get((self._key(batch), 0), ())) < 3:
            # A plain probe: the plain step's cost at this batch size was never timed live
            # (three times), and a start-up profile measured on a busy machine can make it
            # look dearer than it is and hold speculation on where it loses (on 2 shared CPU
            # cores: a plain step profiled at 259 ms, timed at ~60, and EAGLE-3 ran every step
            # at 0.84x plain). Once a probe_every-th of the time in speculative steps, where
            # steps are timed (record_step) at all: an untimed probe would measure nothing.
            probe = self._spec_ms >= self.probe_every * step_ms(batch, 0)
            if probe:
                k, self._probe_again = 0, self.ahead
        return self._chosen(batch, k, probe, tps)

    def _draftless(self, totals: list[float], bare: list[float]) -> None:
        """Take from totals what rows without drafts do not yield (bare: their sum_r E_r(k),
        k = 0..max_k; bare[0] counts them): such a row's step verifies nothing and drafts its
        first k, one token for a k step's time (at a switch-on every row; after a prompt its
        request's row). Priced over a run of L = run_steps speculative steps, not the step
        alone: a row yields 1 + (L - 1) E(k) tokens in its L steps, so it counts
        1 + (E(k) - 1)(1 - 1/L) a step. Priced a step alone, a
        switch-on would never pay; ignored, on 2 CPU cores EAGLE-3 switched on at 4 streams
        where each run of ~6 steps began with a draft-only one, and served 0.87x plain. Runs
        are as long as the steps between prompts that plain steps took (run_steps): timed by
        the runs the controller chose, a few short ones (a probe, a switch back) made every
        switch-on look dear and held EAGLE-3 off at one stream where it won 1.4x."""
        short = 1.0 / max(1.0, self.run_steps)
        n = bare[0]
        totals[1:] = [t - (b - n) * short for t, b in zip(totals[1:], bare[1:])]

    def _chosen(self, batch: int, k: int, probe: bool, tps: dict[int, float]) -> int:
        """Keep what a choice was (for probes, metrics and explain) and return its k: the time
        since the last step of the other kind, the last choice, tokens/s by k (tps: per ms)."""
        step_ms = self._step_ms
        self._plain_ms = self._plain_ms + step_ms(batch, 0) if k == 0 else 0.0
        self._spec_ms = self._spec_ms + step_ms(batch, k) if k > 0 else 0.0
        self._last_k, self._last_probe, self._last_batch = k, probe, batch
        self._last_tps = {j: t * 1e3 for j, t in tps.items()}
        self._steps[k] = self._steps.get(k, 0) + 1
        self._probes += probe
        self._since += 1
        return k

    def _with_prompts(self, batch: int, totals: list[float], held: float) -> int:
        """k for a step with prompt chunks beside its decode rows. Plain, one forward computes
        both: the rows cost what they add to the prompts' forward (M, a mixed step's time,
        covers both). Speculative, the prompts' forward runs alone (P) and the verify after it:
        P + the step's own time. Each is worth its tokens less what its time would have
        yielded at the best rate decode steps of this batch reach (r, tokens a ms over the k
        choose would take without prompts): E(k) - r (P + step(k)) against 1 - r M. So a k
        pays only where its extra tokens beat what a whole verify's time gives elsewhere. A
        rate compared step for step (E(k) / (P + step(k)) against 1 / M) made a step long with
        prompts look like the place to speculate: on 2 CPU cores, prompt forwards of 100-240 ms,
        EAGLE-3 verified there at 4 streams and served 0.70x plain. No probes and no hysteresis
        here: the next step without prompts decides as before. held: the share of the rows
        holding drafts."""
        step_ms = self._step_ms
        mixed, alone = self._prompt_ms(batch)
        rate = max(totals[k] / step_ms(batch, k) for k in self._ks)
        value = {k: totals[k] - rate * (step_ms(batch, k) + alone) for k in self._ks[1:]}
        plain = totals[0] - rate * mixed
        on = self._decision or 0
        if self.drafts_inside and on > 0:
            # A drafter that drafts inside the step has no drafts after a plain one: the next
            # speculative step verifies none and only drafts, a k = `on` step's time for one
            # token a row where that time yields `rate` tokens a ms. Rows without drafts pay
            # that either way.
            plain -= held * max(0.0, rate * step_ms(batch, on) - totals[0])
        k = 0
        for j in self._ks[1:]:
            if value[j] > max(plain, value.get(k, plain)):
                k = j
        if k == 0:
            self.run_steps += 0.25 * (self._since + 1 - self.run_steps)
            self._since = -1  # (this step counts in _chosen)
        tps = {0: totals[0] / mixed, **{j: totals[j] / (step_ms(batch, j) + alone) for j in value}}
        return self._chosen(batch, k, False, tps)

    def _prompt_ms(self, batch: int) -> tuple[float, float]:
        """(M, P) at this batch size: a plain step with prompt chunks beside its decode rows,
        and a speculative step's prompt forward alone, as timed live (record_prompts); one
        untimed reads as the other, both untimed as a plain step (the prompts' work unknown,
        P's extra forward then costs a plain step's time)."""
        key = self._key(batch)
        mixed = self._live_ms.get((key, "mixed"))
        alone = self._live_ms.get((key, "alone"))
        if mixed is None and alone is None:
            mixed = alone = self._step_ms(batch, 0)
        return mixed or alone, alone or mixed

    def record_prompts(self, batch_size: int, ms: float, alone: bool) -> None:
        """A step with prompt chunks, timed whole: a plain one that took batch_size decode rows
        along (alone False), or a speculative step's prompt forward before its verify of
        batch_size rows (alone True). Kept as record_step keeps a k's steps."""
        if math.isfinite(ms) and ms > 0:
            key = (self._key(batch_size), "alone" if alone else "mixed")
            self._enter(key, ms)
            self._last_timed = key

    def record_step(self, batch_size: int, k: int, ms: float) -> None:
        """A step the engine ran, timed whole (scheduling, proposing, the runner, the host's
        bookkeeping of what it emitted): it refines that (batch key, k) entry (`_key`), which
        becomes the median of its last `live_window` steps (the least of them while there are
        fewer than 3: one stalled step, a first lookup over a new prompt, a collection, must
        not turn a k off; a k that is slow every time is seen at its first step). A moving
        average let such stalls hold n-gram off at C=2-8 on the H200, where it won 1.2x
        (spec_gpu_adaptive, 10eb886). The start-up profile times the runner alone, on
        dummy rows at short contexts, so real steps cost more: a verify's attention at long
        contexts (the CPU), an n-gram lookup and several tokens per row to account for (the
        host at high concurrency). A k that keeps losing is then seen losing and left; a k
        still unvisited looks cheaper than it is until its first step is timed."""
        if k not in self._ks or not (math.isfinite(ms) and ms > 0):
            return
        self._timed = True
        key = self._key(batch_size)
        last, self._last_timed = self._last_timed, (key, k)
        plain = self._live_ms.get((key, 0))
        if self.ahead and k == 0 and last is not None and last[1] != 0:
            # The first plain step after a step read before the next was launched (a
            # speculative one, or one with prompts): launched with nothing running ahead of
            # it, it costs host and device one after the other, where a plain step run ahead
            # costs the larger of the two. The difference is what that step left to it (a
            # pipeline drained): charged to it, so a k that alternates with plain pays for
            # every switch back. Before plain's own cost is known there, it is no sample of
            # it: timed as plain's, probes of one step each had a 64-stream H100 server read
            # a plain step at 3.2 ms where one run ahead took 2.0 (the probe's second step,
            # run ahead, is timed instead).
            if last[0] != key or plain is None or len(self._live[(key, 0)]) < 3:
                return
            extra = ms - plain
            if extra > 0:
                window = self._live[last]
                window[-1] += extra
                self._live_ms[last] = _robust(window)
                return
        # A plain step run ahead is timed by its period, which follows the host work around
        # it: a step read right after a long one finds its tokens ready and takes a fraction
        # of a step (0.37 ms at 48 rows on an H100, where a plain step takes 1.5). One such
        # period is no stall ending.
        live = self._enter((key, k), ms, fresh=not (self.ahead and k == 0))
        extra = live - self._profile.step_ms(key, k)
        self._extra[(self._profile.bucket(batch_size), k > 0)] = extra

    def _enter(self, key: tuple[int, int | str], ms: float, fresh: bool = True) -> float:
        """ms into key's window of live steps; what the window now says the step costs. fresh:
        a step under half what the window says ends a run of stalls, and replaces them."""
        window = self._live.get(key)
        if window is None:
            window = self._live[key] = deque(maxlen=self.live_window)
        elif fresh and ms < 0.5 * self._live_ms[key]:
            window.clear()  # what it cost before were stalls: this step is what it costs now
        window.append(ms)
        live = self._live_ms[key] = _robust(window)
        return live

    def _key(self, batch_size: int) -> int:
        """The batch size live step times are kept under: the profile's bucket where a step is
        padded to it (CUDA graphs), else its own (`exact_batches`: an eager step costs what its
        rows cost; on 2 CPU cores a plain step of 2 rows took 47-50 ms where 4 took 36-40, and
        in one bucket with them a wave's last 2-row steps read plain as 20% dearer at the next
        wave's 4 rows, where n-gram then verified at k=1 and lost 9% a step)."""
        return batch_size if self.exact_batches else self._profile.bucket(batch_size)

    def _step_ms(self, batch_size: int, k: int) -> float:
        """The live time at this batch (`_key`) and k; else the profile's plus the host work
        the last timed step of its kind (plain or speculative) showed in its bucket. A host
        proposer's lookup costs about the same whatever k it drafts, so one k timed tells what
        the others cost (without it, each k > 0 would take one slow step of its own to be seen
        losing)."""
        live = self._live_ms.get((self._key(batch_size), k))
        if live is not None:
            return live
        extra = self._extra.get((self._profile.bucket(batch_size), k > 0), 0.0)
        return self._profile.step_ms(batch_size, k) + max(0.0, extra)

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """After a verify: num_drafts drafts were verified and the first num_accepted accepted.
        A drafter that proposed fewer than the k chosen should report num_drafts = k: the missing
        drafts yielded no tokens, like rejections. Positions past max_k are not modeled."""
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(
                f"invalid verify of {request_id!r}: num_accepted={num_accepted} of "
                f"num_drafts={num_drafts}; need 0 <= num_accepted <= num_drafts"
            )
        n = min(num_drafts, self.max_k)
        if n == 0:
            return
        mine = self._accept.get(request_id)
        if mine is None:  # first verify: start from what the engine has seen so far
            mine = self._accept[request_id] = list(self._global)
        for a in (mine, self._global):
            self._update(a, n, min(num_accepted, n))
        self._expect[request_id] = self._expectations(mine)
        self._global_expect = None  # B observes a step: recomputed once, when next read

    def forget(self, request_id: str) -> None:
        self._accept.pop(request_id, None)
        self._expect.pop(request_id, None)

    def expected(self, request_id: str, k: int) -> float:
        """E(k) for this request now (the engine-wide average if it was never observed)."""
        if not 0 <= k <= self.max_k:
            raise ValueError(f"k={k} is outside 0..max_k={self.max_k}")
        return (self._expect.get(request_id) or self._engine_expect())[k]

    @property
    def last_k(self) -> int:
        return self._last_k

    def explain(self, batch_size: int = 1) -> str:
        """Why a step of batch_size speculates or not, as a user reads it: the best k > 0's
        expected tokens and step time against plain's, where each figure comes from (steps
        timed live or the start-up profile; acceptance seen or the prior), and the verdict.

            k=4: 2.30 tokens a step (acceptance 0.60 a draft, assumed: nothing verified
            yet) in 88.0 ms, start-up profile (1.76x plain's 50.0 ms): 26.1 tok/s against
            plain's 20.0, so speculation pays"""
        if len(self._ks) < 2:
            return "no draft length to choose from: plain decoding only"
        expect = self._engine_expect()
        ms = {k: self._step_ms(batch_size, k) for k in self._ks}
        rate = {k: expect[k] / ms[k] * 1e3 for k in self._ks}
        best = max(self._ks[1:], key=rate.__getitem__)
        key = self._key(batch_size)
        timed = "timed live" if (key, best) in self._live_ms else "start-up profile"
        plain_timed = "timed live" if (key, 0) in self._live_ms else "start-up profile"
        if self._global:
            seen = f"acceptance {', '.join(f'{a:.2f}' for a in self._global)} by position, seen"
        else:
            seen = f"acceptance {self.prior:.2f} a draft, assumed: nothing verified yet"
        verdict = "speculation pays" if rate[best] > rate[0] else "plain decoding is faster"
        return (
            f"k={best}: {expect[best]:.2f} tokens a step ({seen}) in {ms[best]:.1f} ms, "
            f"{timed} ({ms[best] / ms[0]:.2f}x plain's {ms[0]:.1f} ms, {plain_timed}): "
            f"{rate[best]:.1f} tok/s against plain's {rate[0]:.1f}, so {verdict}"
        )

    def live_table(self) -> dict[int, dict[int | str, float]]:
        """The step costs timed live: batch key (`_key`) -> {k: ms}, what `choose` used there."""
        out: dict[int, dict[int | str, float]] = {}
        for (key, k), ms in sorted(self._live_ms.items(), key=lambda e: (e[0][0], str(e[0][1]))):
            out.setdefault(key, {})[k] = round(ms, 3)
        return out

    def snapshot(self) -> dict:
        """For /metrics and request metrics: the last choice (and whether it was a probe), the
        expected tokens/s of each candidate k at that choice, steps per k chosen, probes, and the
        engine-wide a_1..a_max_k."""
        return {
            "k": self._last_k,
            "probe": self._last_probe,
            "batch_size": self._last_batch,
            "tokens_per_s": dict(self._last_tps),
            "steps": dict(sorted(self._steps.items())),
            "probes": self._probes,
            "acceptance": self._full(self._global),
        }

    def _engine_expect(self) -> list[float]:
        if self._global_expect is None:
            self._global_expect = self._expectations(self._global)
        return self._global_expect

    def _full(self, a: list[float]) -> list[float]:
        """a_1..a_max_k: unobserved positions read as the deepest observed one (or the prior)."""
        return a + [a[-1] if a else self.prior] * (self.max_k - len(a))

    def _expectations(self, a: list[float]) -> list[float]:
        return _cumulative(self._full(a))  # [E(0), ..., E(max_k)]

    def _update(self, a: list[float], n: int, m: int) -> None:
        """EMA step: accepts at positions 1..m, a reject at m + 1 if m < n (0-based below); a
        grows when a deeper position is first seen, starting from what it read as before."""
        depth = min(m + 1, n)
        if len(a) < depth:
            a.extend([a[-1] if a else self.prior] * (depth - len(a)))
        w = self.ema
        for i in range(m):
            a[i] += w * (1.0 - a[i])
        if m < n:
            a[m] -= w * a[m]
