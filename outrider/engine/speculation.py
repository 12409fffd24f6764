"""The engine's one owner of speculation: the proposer, the adaptive controller, the k (or the
tree) each step verifies, the slots a drafter writes ahead, the accepted runs cut at stops, the
drafts a step hands back, and the acceptance statistics. EngineCore calls it once at each point
of its step:

    before_schedule(running, waiting) -> the scheduler's (max_drafts, lookahead)
    is_speculative_step(batch)    -> run(batch) instead of the runner's plain run
    trim_output(batch, output)    before the scheduler appends the step's tokens
    after_postprocess(batch, out) after it: the next drafts, or the drafter catching up
    forget(request_id)            at finish or abort
    after_step(running)           drafts for the next step (device drafters, per-sequence path)
    record_step(...)              the whole step's time, for the controller
    record_prompts(...)           a speculative step's prompt forward's time, for it too

With no proposer every call does nothing and the engine decodes plainly."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

from outrider import env
from outrider.config import SpecConfig
from outrider.core import (
    ForwardMode,
    Request,
    ScheduledBatch,
    ScheduledSeq,
    SeqDrafts,
    StepOutput,
)
from outrider.engine.block_manager import BlockManager
from outrider.engine.detokenizer import count_until_stop
from outrider.engine.structured import Grammars
from outrider.executor import step_timing
from outrider.executor.model_runner import ModelRunner
from outrider.executor.spec_launch import SpecLaunch
from outrider.executor.spec_step import masked_greedy, plain_greedy, runs_ahead, simple_greedy
from outrider.speculative.base import Proposer, TokenDrafter
from outrider.speculative.controller import SpecController
from outrider.speculative.eagle3_tree import DEFAULT_MAX_STEPS
from outrider.speculative.stats import SpecStats, record_verify
from outrider.speculative.step_profile import StepProfile
from outrider.speculative.tree_batch import TreeShape

log = logging.getLogger(__name__)

_OBSERVED_ROWS = 16  # rows of a verify step the adaptive controller learns from


class Speculator:
    """Speculation for one engine. `stats` (engine-wide acceptance), `last_k` (drafts verified
    in the last decode step, 0: plain) and `steps_by_k` (decode steps by drafts verified) are
    read by metrics; `proposer` and `controller` (None for fixed k and for trees) are what
    serves now."""

    def __init__(
        self,
        config: SpecConfig,
        runner: ModelRunner,
        block_manager: BlockManager,
        max_model_len: int,
        proposer: Proposer | None,
        grammars: Grammars | None = None,
        ahead: bool = False,
    ) -> None:
        """grammars: the engine's constrained requests, whose drafts are cut to what their
        grammar allows and led by the tokens it forces (engine/structured.py). ahead: plain
        steps run ahead of their read (async scheduling), which the controller's costs heed."""
        self._config = config
        self._plain_ahead = ahead
        self._grammars = grammars
        self._runner = runner
        self._block_manager = block_manager
        self._max_model_len = max_model_len
        self.use_proposer(proposer)
        self.stats = SpecStats()
        self.last_k = 0
        self.steps_by_k: dict[int, int] = {}
        self.num_rows_joined = 0  # requests that joined a step run ahead (launch_after)
        # Requests whose next step is launched or decided (a row joined to a step run ahead,
        # the decoding rows `split` left for the next call): their drafts come from that step,
        # `_propose` leaves them alone.
        self._held: set[str] = set()
        self._skip_propose = False  # the step's requests are drafted inside the next one
        self._speculated = False  # the step ran through `run`
        self._aside_ms = 0.0  # the step's catch-up of deferred draft rows, not its k's cost

    # -- configuration ----------------------------------------------------------------------

    def use_proposer(self, proposer: Proposer | None) -> None:
        """Serve with this proposer (None: plain decoding); tests and benchmarks build drafters
        in code. Recaptures the runner's graphs, whose shapes depend on it; statistics are
        kept.

        Chains and a device drafter's trees run through the runner's speculative step (a
        drafter on the device drafts inside it)."""
        self.proposer = p = proposer
        k = self._config.num_draft_tokens
        self._k_max = k if p is not None else 0
        self._k = self._k_max  # drafts verified this step (the controller's pick)
        self._next_k: int | None = None  # a pick for the next scheduled step (plain_ahead)
        self._drafted_only = False  # the last step drafted but verified nothing
        self._observe_phase = 0  # which share of a large batch the controller sees this step
        self._tree: TreeShape | None = None
        if p is not None and p.topk > 1 and p.on_device:
            self._tree = TreeShape(k, p.topk, p.num_steps or min(k, DEFAULT_MAX_STEPS))
        self._stepped = p is not None and (p.topk == 1 or self._tree is not None)
        # Whether the step drafts its rows' next k: a device drafter, or a host proposer that
        # can look its drafts up on the device too where steps run ahead (TokenDrafter).
        self._drafts_in_step = False
        if self._stepped:
            drafter = p if p.on_device else self._token_drafter(p)
            self._drafts_in_step = drafter is not None
            self._runner.set_speculation(drafter, tuple(range(1, k + 1)), self._tree)
        else:
            self._runner.set_aux_layers(p.aux_layers if p is not None else ())
        self._runner.capture_graphs()
        self.controller: SpecController | None = None
        # The controller chooses chain lengths; a tree verifies its whole shape every step.
        if self._stepped and self._tree is None and self._config.controller == "adaptive":
            # Without graphs a step runs at its own batch size, not padded to the profile's.
            exact = self._runner.graphs is None
            self.controller = SpecController(self._measure_profile(), max_k=k, exact_batches=exact)
            self.controller.ahead = self._plain_ahead
            self.controller.drafts_inside = p.on_device

    def _token_drafter(self, p: Proposer) -> TokenDrafter | None:
        """A host proposer of chains that also drafts inside the step from the tokens alone,
        where steps run ahead of their read (plain ones: `ahead`): then its speculative steps
        run ahead too (`launches`). Elsewhere a step's lookup would only repeat the host's."""
        if self._plain_ahead and isinstance(p, TokenDrafter) and p.token_window > 0:
            return p
        return None

    def _measure_profile(self) -> StepProfile:
        """The step profile kept from an earlier start with the same key (machine, model and
        drafter shapes, dtype, graphs, versions: `_profile_key`), else measured now and kept
        (env.step_profile_dir): on a CPU the measurement is most of a speculative server's
        start-up, and `outrider generate` paid it on every call."""
        runner = self._runner
        sizes = runner.profile_batch_sizes()
        key = self._profile_key(sizes)
        folder = env.step_profile_dir()
        path = None
        if folder is not None:
            digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
            path = Path(folder) / f"{digest}.json"
            kept = StepProfile.load(path, key)
            if kept is not None:
                log.warning(
                    "speculative step profile from %s, measured at start-up before (delete "
                    "it, or set OUTRIDER_STEP_PROFILES=off, to measure again)", path,
                )  # fmt: skip
                return self._usable(kept)
        # Said at the default level: eagerly (a CPU) this takes seconds with nothing else on
        # the console, and a server that seems stuck at start-up should say why.
        cost = " (seconds on a CPU)" if runner.graphs is None else ""
        log.warning(
            "timing speculative steps at k=0..%d and batch sizes %s to choose draft lengths%s",
            self._k_max, ", ".join(map(str, sizes)), cost,
        )  # fmt: skip
        t0 = time.perf_counter()
        table = runner.profile_steps(range(1, self._k_max + 1), sizes)
        log.warning("timed speculative steps in %.1f s", time.perf_counter() - t0)
        log.info("speculative step profile (ms by batch size and k): %s", table)
        profile = StepProfile(table, key)
        if path is not None:
            try:
                profile.save(path)
            except OSError as e:  # a read-only home: measure again next time, serve now
                log.warning("could not keep the step profile at %s (%s)", path, e)
        return self._usable(profile)

    def _usable(self, profile: StepProfile) -> StepProfile:
        # A GPU step that costs less with more drafts or rows is noise, and the table is made
        # monotone. A CPU's is real: its BLAS runs a GEMM of 2-3 rows as one GEMV a row, so on
        # 2 cores the default model's EAGLE-3 step at B=1 took 127 ms at k=2 and 94 at k=4; made
        # monotone, k=4 read 2.4x a plain step and the controller never tried the k that is
        # 1.26x plain (benchmarks/results/structured_cpu.json, eagle3 unconstrained).
        return profile.monotone() if self._runner.device.type == "cuda" else profile

    def _profile_key(self, sizes: Sequence[int]) -> dict[str, str]:
        """What a step's time depends on: the machine, the shapes (not the weights' values) of
        the model and the drafter, dtype, backend, graphs, parallelism and the versions of
        the code that runs it. A kept profile with another key is measured again."""
        import torch

        from outrider import __version__

        runner = self._runner
        if runner.device.type == "cuda":
            machine = torch.cuda.get_device_name(runner.device)
        else:
            machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus"
        p = self.proposer
        drafter = getattr(getattr(p, "draft", None), "config", None)
        return {
            "device": f"{runner.device.type}: {machine}, {torch.get_num_threads()} threads",
            "dtype": str(runner.dtype),
            "model": repr(runner.model_config),
            "drafter": f"{p.name}: {drafter!r}, drafts in the step: {self._drafts_in_step}",
            "backend": type(runner.backend).__name__,
            "graphs": str(runner.graphs is not None),
            "deterministic": str(runner.config.model.deterministic),
            "tensor_parallel": str(runner.tp.size),
            "shapes": f"batch sizes {list(sizes)}, k 0..{self._k_max}",
            "method": step_timing.METHOD,
            "gemm": step_timing.gemm_form(runner.device),
            "versions": f"outrider {__version__}, torch {torch.__version__}",
        }

    def verify_per_sequence(self) -> None:
        """Verify drafts per sequence inside the runner's plain run (the path prefills and
        sampling trees take) instead of the speculative step, with drafts proposed after each
        step: tests compare the two paths on one engine. Graphs stay as captured."""
        self._stepped = False

    def summary(self) -> str | None:
        """What speculation did, for the log when an engine stops: decode steps by k, the
        acceptance by position, the step costs the controller timed live (ms by batch bucket
        and k) and why its last batch size speculates or not. None without a proposer."""
        if self.proposer is None:
            return None
        steps = ", ".join(f"k={k}: {n}" for k, n in sorted(self.steps_by_k.items()))
        st = self.stats
        seen = "nothing verified"
        if st.num_verify_steps:
            seen = (
                f"accept length {st.accept_length:.2f} over {st.num_verify_steps} verifies "
                f"({st.acceptance_rate:.0%} of {st.num_draft_tokens} drafts)"
            )
        text = f"decode steps {steps or 'none'}; {seen}"
        c = self.controller
        if c is not None:
            live = "; ".join(
                f"{b}: " + " ".join(f"{_entry(k)} {ms:.2f}" for k, ms in row.items())
                for b, row in c.live_table().items()
            )
            batch = max(1, c.snapshot()["batch_size"])
            text += (
                f"; live step ms by batch {live or 'none'}; at batch {batch}, {c.explain(batch)}"
            )
        return text

    def reset_stats(self) -> None:
        """Start the engine-wide acceptance counters afresh (a benchmark measuring several
        proposers on one engine); a `stats` read before keeps its counts."""
        self.stats = SpecStats()

    # -- the step ---------------------------------------------------------------------------

    def before_schedule(
        self, running: Sequence[Request], waiting: bool = False
    ) -> tuple[int | None, int]:
        """Choose this step's k and, for a host proposer, draft for it; returns the scheduler's
        (max_drafts, lookahead): drafts a decoding request verifies at most (None: all it has)
        and the slots past them a device drafter writes. waiting: requests wait to be
        scheduled (their prompt chunks may join this step)."""
        if self.proposer is None or not self._stepped:
            return None, 0  # as proposed
        self._choose_k(running, waiting)
        if not self.proposer.on_device and self._k:
            # Drafted on demand, for the k chosen: while speculation is off a host proposer
            # costs nothing.
            asked = self._propose(running)
            if self.controller is not None and asked and not any(r.drafts for r in asked):
                # Nothing to verify: the step runs plain. Drafts missing count as rejected, as
                # in a verify (_cut_at_token_stops); untold, the controller kept choosing k
                # for requests a lookup finds nothing for, and each such step ran plain
                # without running ahead (n-gram at one stream, default model: 132 of the 220
                # steps that chose k found no drafts; an H100 server ran 5-24% of its steps
                # not ahead where 1-4% verified drafts, and lost 4-10% to plain).
                for r in asked[:_OBSERVED_ROWS]:
                    self.controller.observe(r.request_id, min(self._k, self._room(r)), 0)
        lookahead = self._k - 1 if self.proposer.on_device and self._k else 0
        if self._tree is not None:
            lookahead = self._tree.reach - 1
        return self._k, lookahead

    def _choose_k(self, running: Sequence[Request], waiting: bool) -> None:
        """The controller's k for this step's decoding requests, told whether prompt chunks
        may join the step (requests waiting, or running mid-prompt): a speculative step runs
        them in a forward of their own (`split`). A step that only drafted (speculation was
        off before it) keeps its k one more step, so its drafts are verified and acceptance
        is observed (a probe would otherwise never see a verify)."""
        if self.controller is None:
            return
        if self._next_k is not None:  # chosen as the step before it was launched
            self._k, self._next_k = self._next_k, None
            return
        if self._drafted_only:
            self._drafted_only = False
            return
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        if decoding:
            self._k = self.controller.choose(
                [r.request_id for r in decoding],
                prompts=waiting or len(decoding) < len(running),
                drafted=[r.drafts is not None for r in decoding],
            )

    def plain_ahead(self, batch: ScheduledBatch) -> bool:
        """Whether the plain decode step after `batch` may be launched before `batch`'s tokens
        are read (engine/overlap.py), as a plain step: always with no proposer; with one, when
        its adaptive controller picks k=0 for it now. A pick of k > 0 is kept for the step the
        engine then schedules (before_schedule does not choose again). A fixed k or a tree
        verifies drafts every step, which need the tokens on the host: never."""
        if self.proposer is None:
            return True
        if not self._stepped or self.controller is None or self._drafted_only:
            return False
        return self._picks(batch, 0)

    def _picks(self, batch: ScheduledBatch, k: int) -> bool:
        """Whether the controller picks k for the step after `batch`, asked before that step
        is launched; another pick is kept for the step the engine then schedules (`_next_k`:
        before_schedule does not choose again, one pick a step). The rows hold drafts for it
        where `batch` drafted them (a speculative step; a plain one drafts none)."""
        ids = [s.request.request_id for s in batch.seqs]
        pick = self.controller.choose(ids, drafted=[self._k > 0] * len(ids))
        if pick != k:
            self._next_k = pick
        return pick == k

    # -- speculative steps launched ahead of their read (engine/overlap.py) ---------------------

    def launches(self, batch: ScheduledBatch) -> bool:
        """Whether this speculative step (is_speculative_step) may be launched without its
        read, and a step after it on its outputs still on the device: chains drafted on the
        device in one process, every row plain greedy or sampled from its parameters alone
        (spec_step.runs_ahead: nothing read from the host between the verify and the
        drafter), no prompt chunk beside."""
        p = self.proposer
        return (
            p is not None
            and self._drafts_in_step
            and (self._tree is None or all(map(simple_greedy, batch.seqs)))
            and self._k > 0
            and self._runner.tp.size == 1
            and batch.mode != ForwardMode.PREFILL
            and all(runs_ahead(s.request) and not _prompt_chunk(s) for s in batch.seqs)
        )

    def launch(self, batch: ScheduledBatch) -> SpecLaunch:
        """`run` for a batch `launches` accepted, without its read (SpecLaunch.read)."""
        self._catch_up()  # the draft KV of the plain steps before this one
        self._drafted_only = not any(s.drafts for s in batch.seqs)
        return self._runner.spec_step.launch(batch, self._k, self._k)

    def _catch_up(self) -> None:
        """A device drafter's extension over the rows it deferred, timed aside (not the
        step's k's cost); a host proposer has none."""
        if self.proposer.on_device:
            t0 = time.perf_counter()
            self.proposer.catch_up()
            self._aside_ms += (time.perf_counter() - t0) * 1e3

    def launch_after(
        self, batch: ScheduledBatch, launched: SpecLaunch, joins: Sequence[Request] = ()
    ) -> SpecLaunch | None:
        """The step after `batch` (launched, not read yet), launched now on its outputs on the
        device: the same rows at the same k, each verifying the k drafts `batch`'s step made,
        and `joins`, decoding requests whose tokens the host has (a prompt's first token, read
        beside an earlier step): each in the place of a row whose request finished, or after
        the rest while a captured batch size holds them, at its root alone (the drafter drafts
        its first k inside the step, its draft KV over the prompt caught up first).
        None where that cannot be known to hold: the controller picks another k (kept for the
        step scheduled next), a row could reach the context's end, or the pool is short of
        blocks for the furthest positions the step may write (3k + 1 past a row's start:
        `batch`'s k + 1, then its own k + 1 and the drafter's chain). Near max_tokens its
        drafts are not cut as a scheduled step's are (Speculator._room): tokens past it are
        dropped as a stop's are, and a request that ends with `batch` leaves its row unused."""
        k = self._k
        if not launched.drafted:  # its drafts come from `propose`, on the host
            return None
        if self._drafted_only:  # its drafts are verified next: the probe it started
            self._drafted_only = False
        elif self.controller is not None and not self._picks(batch, k):
            return None
        if self._tree is not None and not all(map(plain_greedy, joins)):
            return None  # a tree step decides greedy rows alone
        # A row's root moves on by at most `most` + 1, and the step writes `reach` positions
        # from there (chains: k accepted, the root, the k drafts and the drafter's k - 1).
        most, reach = (k, 2 * k) if self._tree is None else (self._tree.num_steps, self._tree.reach)
        reqs = [s.request for s in batch.seqs if not s.request.is_finished]
        if any(r.num_tokens + most + reach + 2 > self._max_model_len for r in [*reqs, *joins]):
            return None
        if not all(self._block_manager.allocate(r, most + 1 + reach) for r in reqs):
            return None  # (what was allocated goes back when `batch` is postprocessed)
        seqs, joined = list(batch.seqs), []
        if joins:
            seqs, joined = self._joined(seqs, joins, reach + 1)
            if joined:
                self._catch_up()  # their draft KV over the prompt, which the step reads
        rows = ScheduledBatch(ForwardMode.VERIFY, seqs) if joined else batch
        return self._runner.spec_step.launch_after(launched, rows, joined)

    def _joined(
        self, seqs: list[ScheduledSeq], joins: Sequence[Request], need: int
    ) -> tuple[list[ScheduledSeq], list[int]]:
        """`seqs` with the `joins` that fit (blocks for `need` positions, a captured batch
        size) in the places of finished requests' rows, then after them -> (rows, the joined
        ones' indices)."""
        free = [i for i, s in enumerate(seqs) if s.request.is_finished]
        cap = self._runner.spec_step.batch_sizes[-1]
        joined = []
        for req in joins:
            if not free and len(seqs) >= cap:
                break
            if not self._block_manager.allocate(req, need):
                break  # waits for a step scheduled as usual
            start, req.drafts = req.num_computed_tokens, None  # it verifies none
            seq = ScheduledSeq(req, [req.all_token_ids[start]], start, req.block_ids, True)
            i = free.pop(0) if free else len(seqs)
            seqs[i : i + 1] = [seq]
            joined.append(i)
            self._held.add(req.request_id)
        self.num_rows_joined += len(joined)
        return seqs, joined

    def read(self, batch: ScheduledBatch, launched: SpecLaunch) -> StepOutput:
        """A launched step's output (waits for it)."""
        output = launched.read(batch)  # CPU-GPU sync point
        self._speculated = True
        return output

    def batch_after(
        self, batch: ScheduledBatch, output: StepOutput, launched: SpecLaunch
    ) -> ScheduledBatch:
        """The host's view of the step launch_after `launched` after `batch`, once `batch` is
        postprocessed (`output`, its read): each row's root and the drafts it verifies, which
        it consumes as a scheduled step does, and the rows that joined it. A row whose request
        finished keeps its place; its output is dropped."""
        self._held.clear()  # (their rows drafted inside that step)
        seqs = []
        for i in range(launched.b):
            if i in launched.joined:
                s = launched.joined[i]
                req = s.request
                seqs.append(ScheduledSeq(req, s.token_ids, s.start_pos, req.block_ids, True))
                continue
            s, drafts = batch.seqs[i], output.next_drafts[i]
            req = s.request
            if req.is_finished:
                seqs.append(
                    ScheduledSeq(req, [0, *drafts.token_ids], s.start_pos, [], True, drafts)
                )
                continue
            req.drafts = None
            root = req.all_token_ids[req.num_computed_tokens]
            seqs.append(
                ScheduledSeq(
                    req, [root, *drafts.token_ids], req.num_computed_tokens, req.block_ids, True,
                    drafts,
                )
            )  # fmt: skip
        return ScheduledBatch(ForwardMode.VERIFY, seqs)

    def is_speculative_step(self, batch: ScheduledBatch) -> bool:
        """Whether the batch runs as a speculative step: speculation on this step, and every
        decoding sequence its root and at most k drafts (a tree: greedy). A prefill step
        qualifies by its decoding sequences: its prompt chunks run first as a plain forward,
        then they run as the speculative step (`split`)."""
        if not self._stepped or self._k == 0:
            return False
        decoding = [s for s in batch.seqs if not _prompt_chunk(s)]
        if not decoding:
            return False
        if not self.proposer.on_device and not any(s.drafts for s in decoding):
            return False  # nothing to verify and nothing to draft: a plain decode step
        if self._tree is not None and not all(
            simple_greedy(s) or masked_greedy(s) for s in decoding
        ):
            return False  # trees that sample are verified per sequence (runner.run)
        return all(
            s.sample and s.query_len == 1 + (s.drafts.num_nodes if s.drafts else 0)
            for s in decoding
        )

    def run(self, batch: ScheduledBatch) -> StepOutput:
        """The speculative step on the runner: verify, accept and (a device drafter) draft the
        next k. Only for decoding rows is_speculative_step accepted (a prefill step's prompt
        chunks run before them: `split`)."""
        self._drafted_only = self.proposer.on_device and not any(s.drafts for s in batch.seqs)
        self._catch_up()  # the draft KV of the plain steps before this one, which the step reads
        out = self._runner.run_spec(batch, self._k, self._k if self._drafts_in_step else 0)
        self._speculated = True
        return out

    def split(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, ScheduledBatch]:
        """A speculative prefill step -> (its prompt chunks, its decoding rows), each a batch.
        The chunks run first as a plain forward of their own, whose first tokens leave at once
        (the drafter follows them as after a prefill step), and the decoding rows in the
        engine's next call as the speculative step (`rows_left`): in one forward with the
        decodes, every request's step would be an eager one that drafts nothing inside it."""
        prompts = [s for s in batch.seqs if _prompt_chunk(s)]
        decoding = [s for s in batch.seqs if not _prompt_chunk(s)]
        self._held = {s.request.request_id for s in decoding}
        return _part(batch, prompts), _part(batch, decoding)

    def rows_left(self, decodes: ScheduledBatch) -> ScheduledBatch | None:
        """`split`'s decoding rows, run in the engine's next call, less requests aborted since
        (their blocks are freed); None when none is left."""
        self._held.clear()
        seqs = [s for s in decodes.seqs if not s.request.is_finished]
        if len(seqs) == len(decodes.seqs):
            return decodes
        return _part(decodes, seqs) if seqs else None

    def trim_output(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """Before the scheduler appends the step's tokens: count the decode step by the drafts
        it verified, and cut each accepted run at its first stop."""
        speculated, self._speculated = self._speculated, False
        decoding = batch.mode != ForwardMode.PREFILL or speculated
        if self.proposer is not None and decoding:
            k = self._k if output.num_accepted is not None else 0
            self.last_k = k
            self.steps_by_k[k] = self.steps_by_k.get(k, 0) + 1
            for seq in batch.seqs:
                steps = seq.request.metrics.steps_by_k
                steps[k] = steps.get(k, 0) + 1
        if output.num_accepted is not None:
            self._cut_at_token_stops(batch, output, decoding)

    def _cut_at_token_stops(
        self, batch: ScheduledBatch, output: StepOutput, decoding: bool
    ) -> None:
        """Several tokens may arrive at once from a verify: keep those up to the first EOS /
        stop id / max_tokens / context end, and record acceptance statistics (the controller's
        from the decoding rows of a decoding or speculative step)."""
        sampling = [s for s in batch.seqs if s.sample]
        observe = self.controller is not None and decoding
        # The controller's update is Python per row (~10 us): at most _OBSERVED_ROWS rows a
        # step, a different share each step, keep it far below a step's time at any batch.
        stride = -(-len(sampling) // _OBSERVED_ROWS)
        self._observe_phase = (self._observe_phase + 1) % stride
        for i, seq in enumerate(sampling):
            if seq.request.is_finished:
                continue  # a row of a step run ahead whose request finished the step before
            # A step run ahead verified k drafts where a scheduled one would have cut them to
            # the request's room (_set_drafts): only those count.
            room = max(self._room(seq.request), 0)
            if (
                observe
                and i % stride == self._observe_phase
                and (seq.drafts is not None or not self.proposer.on_device)
                and not _prompt_chunk(seq)
            ):
                # A host proposer drafts all it can (up to the most k): drafts short of k, or
                # none, yielded nothing there and count as rejected. A device drafter's rows
                # hold what the previous step's k asked for: only those were tried.
                n = min(seq.drafts.num_nodes if self.proposer.on_device else self._k, room)
                accepted = min(output.num_accepted[i], n)
                self.controller.observe(seq.request.request_id, n, accepted)
            if seq.drafts is None:
                continue
            accepted = output.num_accepted[i]
            if n := min(seq.drafts.num_nodes, room):
                self.stats.record(n, min(accepted, n))
                record_verify(seq.request.metrics, n, min(accepted, n))
            keep, _ = count_until_stop(seq.request, output.token_ids[i], self._max_model_len)
            if self._grammars is not None:  # a constrained request ends with its grammar
                keep = self._grammars.until_complete(
                    seq.request.request_id, output.token_ids[i][:keep]
                )
            if keep < len(output.token_ids[i]):
                output.token_ids[i] = output.token_ids[i][:keep]
                if output.logprobs is not None:
                    output.logprobs[i] = output.logprobs[i][:keep]
                output.num_accepted[i] = min(accepted, keep)

    def after_postprocess(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """After the scheduler appended the step's tokens: drafts made inside the step become
        each request's drafts for the next one; otherwise a drafter sees what the target
        computed."""
        self._skip_propose = False
        if output.next_drafts is not None:
            self._take_drafts(batch, output)
        elif self.proposer is None:
            return
        elif self._defers(batch):
            t0 = time.perf_counter()
            self.proposer.defer(batch, output)  # (a catch-up when a request holds many steps)
            self._aside_ms += (time.perf_counter() - t0) * 1e3
            # Its requests are drafted inside the next speculative step.
            self._skip_propose = batch.mode == ForwardMode.PREFILL
        elif batch.mode == ForwardMode.PREFILL or self._k:
            # A device drafter follows the target through steps it did not draft in.
            self.proposer.observe(batch, output)

    def _defers(self, batch: ScheduledBatch) -> bool:
        """Whether a device drafter keeps this step's rows (`defer`) and extends over them,
        in one forward, only when it next drafts (`catch_up`): after a plain step while
        speculation is off, and, for chains the speculative step drafts, after a prefill step
        that verified no drafts. There the draft forward over the prompt and the k chain
        forwards of `propose` ran before the prompt's first token left the engine (eager
        forwards, in the time to first token); a new request is drafted inside its first
        speculative step instead. A prefill step in which decoding requests verified drafts
        still drafts their next ones now, or each prefill would cost every running request
        a step without drafts."""
        if not self.proposer.on_device:
            return False
        if batch.mode == ForwardMode.PREFILL:
            return (
                self._stepped
                and self._tree is None
                and not any(s.drafts is not None for s in batch.seqs)
            )
        return self._k == 0

    def _take_drafts(self, batch: ScheduledBatch, output: StepOutput) -> None:
        for seq, drafts in zip((s for s in batch.seqs if s.sample), output.next_drafts):
            if not seq.request.is_finished:
                self._set_drafts(seq.request, drafts)

    def _set_drafts(self, req: Request, drafts: SeqDrafts | None) -> None:
        """A request's drafts for its next step: cut to what its grammar allows and led by the
        tokens the grammar forces (a constrained request), then to what can still count."""
        grammars = self._grammars
        if grammars is not None and req.request_id in grammars:
            forcing = self._config.grammar_drafts
            if self._tree is None and forcing:  # chains: forced tokens
                drafts, forced = grammars.forced_drafts(req.request_id, drafts, self._k)
                self.stats.num_forced_drafts += forced
            else:
                if drafts is not None and drafts.num_nodes:
                    drafts = grammars.allowed_drafts(req.request_id, drafts)
                if drafts is None and forcing:  # a tree the grammar refused: what it forces
                    depth = self._tree.num_steps  # a chain, as deep as the tree's paths go
                    drafts, forced = grammars.forced_drafts(req.request_id, None, depth)
                    self.stats.num_forced_drafts += forced
        n = min(drafts.num_nodes, self._room(req)) if drafts is not None else 0
        req.drafts = drafts.truncated(n) if n > 0 else None

    def forget(self, request_id: str) -> None:
        """Drop what the proposer and the controller hold for a finished or aborted request."""
        if self.proposer is not None:
            self.proposer.forget(request_id)
        if self.controller is not None:
            self.controller.forget(request_id)

    def after_step(self, running: Sequence[Request]) -> None:
        """At the end of the step's bookkeeping: a device drafter, or a proposer whose drafts
        are verified per sequence, drafts for the next step now. Host proposers of chains
        draft in before_schedule instead, for the k chosen then."""
        if self._skip_propose:
            return
        if self.proposer is not None and (self.proposer.on_device or not self._stepped):
            self._propose(running)

    def record_step(self, batch: ScheduledBatch, speculative: bool, started: float) -> None:
        """The whole step, from `started` (time.perf_counter() before scheduling) to now:
        scheduling, a host proposer's lookup, the runner, the bookkeeping of every token it
        emitted. It refines the controller's start-up profile, which timed the runner alone:
        host work that grows with the batch (a lookup per row, several tokens per row to
        account for) can turn a gain the runner's time shows into a loss. A plain step taken
        while speculation was on (no row found drafts) is neither: not recorded. The drafter's
        catch-up over rows it deferred is left out: a cost of a prefill or of turning
        speculation back on, not of the step's k (charged to a probe, the catch-up over the
        hundred plain steps before it counted as k's cost, and on 2 CPU cores EAGLE-3 stayed
        off at 62% acceptance: 4 verifies in 973 tokens)."""
        aside, self._aside_ms = self._aside_ms, 0.0
        if self.controller is None:
            return
        ms = (time.perf_counter() - started) * 1e3 - aside
        if speculative and batch.mode != ForwardMode.PREFILL:  # not beside prompt chunks
            k = self._k
        elif batch.mode == ForwardMode.DECODE and self._k == 0:
            k = 0
        elif batch.mode == ForwardMode.PREFILL and not speculative:
            decoding = sum(not _prompt_chunk(s) for s in batch.seqs)
            if decoding:  # decode rows along in the prompts' forward
                self.controller.record_prompts(decoding, ms, alone=False)
            return
        else:
            return
        self.controller.record_step(len(batch.seqs), k, ms)

    def record_prompts(self, decodes: ScheduledBatch, started: float) -> None:
        """A speculative step's prompt chunks run alone (`split`), timed from `started` on,
        before its verify of `decodes`' rows: what the controller adds to a k's cost at a step
        with prompts (SpecController.record_prompts)."""
        if self.controller is not None and decodes.seqs:
            ms = (time.perf_counter() - started) * 1e3
            self.controller.record_prompts(len(decodes.seqs), ms, alone=True)

    # -- drafting ---------------------------------------------------------------------------

    def _propose(self, running: Sequence[Request]) -> list[Request]:
        """Draft for every running request that is decoding, capped so accepted drafts plus
        the final token never pass max_tokens or the context; the requests asked. At k = 0 (after
        every plain step of a device drafter) none, and the rows are not walked."""
        k = self._k
        if k == 0:
            return []
        reqs = [
            r
            for r in running
            if r.num_computed_tokens == r.num_tokens - 1
            and not r.drafts  # a device drafter already drafted inside the step
            and r.request_id not in self._held  # or drafts inside a step launched or due
            and self._room(r) > 0  # (its drafts would be cut to none)
        ]
        if not reqs:
            return []
        if self.proposer.writes_kv:
            reqs = [r for r in reqs if self._reserve_draft_slots(r, k)]
        for req, drafts in zip(reqs, self.proposer.propose(reqs, k)):
            self._set_drafts(req, drafts)
        return reqs

    def _room(self, req: Request) -> int:
        """Drafts that can still count: accepted ones plus the final token never pass
        max_tokens or the context."""
        room = self._max_model_len - req.num_tokens - 1
        if req.params.max_tokens is not None:
            room = min(room, req.params.max_tokens - len(req.output_token_ids) - 1)
        return room

    def _reserve_draft_slots(self, req: Request, k: int) -> bool:
        """A drafter that writes its own KV while proposing writes it in slots past the computed
        tokens, which the next VERIFY uses too (root + k drafts): allocate them now, or skip
        drafting for this request when the pool is short (drafts are a bet; nobody is
        preempted for them)."""
        need = self.proposer.positions_needed(k)
        if req.num_computed_tokens + need > self._max_model_len:
            return False  # the last few tokens of the context decode plainly
        return self._block_manager.allocate(req, need)


def _entry(k: int | str) -> str:
    """A live table's column as the log names it: k3, or mixed / alone (steps with prompts)."""
    return f"k{k}" if isinstance(k, int) else k


def _prompt_chunk(seq: ScheduledSeq) -> bool:
    """Whether a sequence computes a chunk of its prompt (scheduler._mode's test), not a decode."""
    return seq.drafts is None and (seq.query_len > 1 or not seq.sample)


def _part(batch: ScheduledBatch, seqs: list[ScheduledSeq]) -> ScheduledBatch:
    """The batch's `seqs` as a batch of their own, sharing its masks and grammar picks."""
    if any(_prompt_chunk(s) for s in seqs):
        mode = ForwardMode.PREFILL
    else:
        mode = ForwardMode.VERIFY if any(s.drafts is not None for s in seqs) else ForwardMode.DECODE
    return ScheduledBatch(
        mode, seqs, fill_masks=batch.fill_masks, grammar_paths=batch.grammar_paths
    )
