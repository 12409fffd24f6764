"""Structured outputs on the host: each constrained request's grammar, the token masks a step
applies, the drafts the grammar allows, and the tokens it forces.

A request's `SamplingParams.structured_outputs` (core.StructuredOutputs) compiles with
llguidance into a matcher that follows the request's output token by token. Per step:

    attach_masks(batch)     every sampling row of a constrained sequence gets the bitmask of
                            the tokens the grammar allows there (ScheduledSeq.token_masks,
                            [rows, ceil(V / 32)] int32, bit t of word t // 32 for token t); a
                            verifying sequence's row j is the mask after its drafts 0..j-1 (a
                            tree node's: after the path to it). They are computed in a
                            thread from here on (llguidance lets go of the GIL), while the
                            step's inputs are built and its forward runs; the runner waits
                            for them (ScheduledBatch.ready_masks), then sets every other
                            token's logit to -inf before sampling, verifying and logprobs.
                            Every other call here waits for them first: a matcher is never
                            read and moved at once.
    paths(seqs, ...)        greedy rows instead, in plain decode steps and speculative steps
                            (attach_masks(pick=True) gives them no mask): each verify row's
                            target is the argmax among what the grammar allows (`_pick`), from
                            the row's top logits read after the forward, each checked by the
                            matcher, walking the drafts only as far as the targets accept
                            them; where the grammar forces bytes or none is allowed (or a tie
                            reaches the last one), its mask is computed then, a round's such
                            rows in one call, and a mask that allows one token (a key or a
                            brace the grammar forces, which the model need not rank high) is
                            the token, with no read of the logits: the mask decides every
                            greedy row, as it decides sampled ones. A step of 64 constrained
                            greedy rows checks a few tokens a row where it filled a vocabulary
                            mask per row and draft.
    masks_now(rids)         the greedy rows of a plain step run ahead (at most 16 of them,
                            grammar_steps.MASKS_AHEAD_MAX_ROWS): their masks from where the
                            grammars stand once the tokens before them are followed, computed
                            at once (not in the thread); the engine takes their masked argmax
                            on the device before the step after is launched on them, so
                            nothing is guessed.
    advance(rid, tokens)    the tokens the step emitted; True when the grammar is complete
                            (nothing may follow), which finishes the request ("stop").

Drafts (Speculator): `allowed_drafts` cuts a chain at the first token the grammar refuses and
drops a tree's nodes whose path it refuses, so every verified draft is one the constrained
target could produce; with the masks, greedy constrained output with speculation equals
constrained output without it. `forced_drafts` (chains): where the grammar admits one
continuation only (a JSON key and its quotes, a closing brace, the rest of an enum value), those
tokens are certain and ride as drafts the target only confirms, ahead of the drafts and where the
grammar cuts them.

Compiled grammars are cached by their text: a request whose constraint was seen before starts
from a copy of the compiled matcher. The tokenizer's llguidance view is built on the first
constrained request (about 0.2 s for a 49k vocabulary); engines that never see one pay nothing.

JSON is written with ", " between items and ": " after keys and no other whitespace
(`disable_any_whitespace`: "," and ":"): one spelling of each object, so the grammar forces keys
and separators, and no model can loop on whitespace inside a value.
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass

import numpy as np
import torch

from outrider.core import Candidates, ScheduledBatch, ScheduledSeq, SeqDrafts, StructuredOutputs
from outrider.executor.spec_step import masked_greedy
from outrider.loaders.tokenizer import Tokenizer

MAX_CACHED = 512  # compiled grammars kept; a server seeing more distinct ones recompiles


@dataclass
class GrammarCounters:
    """What the grammars did, since the engine started (benchmarks read differences)."""

    mask_rows: int = 0  # vocabulary masks filled ahead of a forward (attach_masks)
    picked_rows: int = 0  # rows decided from their top logits (`path`)
    # of those, rows their candidates could not decide (the grammar forces bytes there, or
    # none was allowed): a mask then
    late_masks: int = 0
    # of those, masks allowing one token (a key, a quote, a brace the grammar forces): that
    # token, with no read of the row's logits
    late_forced: int = 0
    # rows decided by the first token of what the grammar forces (`_pick`), with no mask
    forced_rows: int = 0
    # tokens a plain engine emitted as its grammars forced them, computed in the next forward
    jumped: int = 0
    # greedy rows of steps run ahead whose masked argmax the device took (masks_now)
    masked_ahead: int = 0
    path_s: float = 0.0  # host seconds in `path`, its late masks and their argmax included


class Grammars:
    """The constrained requests of one engine, by request id. `counters` (GrammarCounters)
    is read by benchmarks."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, pinned: bool = False) -> None:
        """pinned: masks are laid out in page-locked host memory (a CUDA engine's: its copy to
        the device then neither waits nor stages)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: masks cover every row of it
        self.words = -(-vocab_size // 32)
        self._pinned = pinned
        # Two host buffers the steps' masks alternate between, each grown to the most rows a
        # step asked for: a step's masks are read by its copy to the device, which has run by
        # the time the step's tokens reach the host, long before the buffer comes round again.
        # No per-step allocation or zero fill: torch fills of 10^5 words start its intra-op
        # threads, which then spin beside llguidance's on the same cores.
        self._buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.int32)] * 2
        self._turn = 0
        self._lltok = None  # llguidance.LLTokenizer, on the first constrained request
        self._executor = None
        # grammar text -> pristine llguidance.LLMatcher, the least recently used dropped first
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._matchers: dict[str, object] = {}  # request id -> its llguidance.LLMatcher
        # requests whose grammar turns forcing off (`_pick`'s forces)
        self._unforced: set[str] = set()
        # The thread a step's masks are computed in, from attach_masks on (made on the first),
        # and the computation in flight.
        self._filler: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self.counters = GrammarCounters()

    def __bool__(self) -> bool:
        """Whether any constrained request is in flight."""
        return bool(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    # -- compiling ----------------------------------------------------------------------------

    def _llg_tokenizer(self):
        if self._lltok is None:
            import llguidance

            tok = self._tokenizer
            try:
                self._lltok = llguidance.LLTokenizer(
                    _with_decoder(tok.backend.to_str()),
                    n_vocab=self.vocab_size,
                    eos_token=sorted(tok.eos_token_ids),
                )
            except ValueError as e:
                raise ValueError(
                    f"structured outputs cannot read this model's tokenizer ({e}): llguidance "
                    "needs each token's bytes (a byte-level BPE or a byte-fallback tokenizer); "
                    "serve this model without structured_outputs"
                ) from None
            # Threads for a batch's masks: a quarter of the cores, at most 8 (64 masks of ~25
            # us each, measured in the engine on a 16-core H200 host: 1.39 ms on 1 thread,
            # 1.10 on 4, 4.0 on 8 and 4.3 on 15, where more threads met the host's own).
            threads = max(1, min(8, (os.cpu_count() or 2) // 4))
            self._executor = llguidance.LLExecutor(num_threads=threads)
        return self._lltok

    def compile(self, spec: StructuredOutputs):
        """The compiled matcher of `spec` (cached by its grammar's text); ValueError naming the
        field when it does not compile."""
        return self._compile(grammar_text(spec), spec)

    def _compile(self, text: str, spec: StructuredOutputs):
        """`compile` of a grammar text already made from `spec`."""
        import llguidance

        matcher = self._compiled.get(text)
        if matcher is not None:
            self._compiled.move_to_end(text)
        else:
            matcher = llguidance.LLMatcher(self._llg_tokenizer(), text, log_level=0)
            if matcher.is_error():
                raise ValueError(
                    f"invalid structured_outputs.{spec.kind}: {matcher.get_error().strip()}: "
                    f"{_HINTS[spec.kind]}"
                )
            self._compiled[text] = matcher
            if len(self._compiled) > MAX_CACHED:
                self._compiled.popitem(last=False)
        return matcher

    def start(self, request_id: str, spec: StructuredOutputs) -> None:
        """Follow a new request's output with a fresh copy of its compiled grammar."""
        self._settle()
        text = grammar_text(spec)
        self._matchers[request_id] = self._compile(text, spec).deep_copy()
        if "no_forcing" in text:  # a grammar's own lexer option
            self._unforced.add(request_id)

    def forget(self, request_id: str) -> None:
        self._settle()
        self._matchers.pop(request_id, None)
        self._unforced.discard(request_id)

    def _settle(self) -> None:
        """Wait for the masks in flight, if any (their errors surface in ready_masks)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            wait_for([pending])

    # -- the step -----------------------------------------------------------------------------

    def attach_masks(self, batch: ScheduledBatch, pick: bool = False) -> None:
        """ScheduledSeq.token_masks for every sampling sequence of a constrained request: one
        row for its next token, and one per draft node (the mask after the path to it). They
        are allocated here and computed from now on in a thread; batch.fill_masks waits for
        them (the runner calls it once the step's forward is on the device,
        ScheduledBatch.ready_masks).

        pick: the step decides greedy rows from their top logits (a plain decode step through
        the runner, or a speculative step). Its greedy constrained rows (greedy, no penalties
        or logprobs, min_tokens met) get no mask: ScheduledSeq.grammar_topk, decided by `paths`
        (batch.grammar_paths), a mask computed only where none of a row's candidates is
        allowed."""
        self._settle()
        seqs = [s for s in batch.seqs if s.sample and s.request.request_id in self._matchers]
        if pick:
            for s in seqs:
                s.grammar_topk = masked_greedy(s)
            if any(s.grammar_topk for s in seqs):
                batch.grammar_paths = self.paths
            seqs = [s for s in seqs if not s.grammar_topk]
        if not seqs:
            return
        rows = [1 + (s.drafts.num_nodes if s.drafts is not None else 0) for s in seqs]
        self.counters.mask_rows += sum(rows)
        masks = self._rows(sum(rows))  # llguidance writes every word of every row
        alone, chains, trees, start = [], [], [], 0
        for s, n, rows_of in zip(seqs, rows, masks.split(rows)):  # one call for every view
            matcher = self._matchers[s.request.request_id]
            if s.drafts is None or not s.drafts.num_nodes:
                alone.append((matcher, start))
            elif s.drafts.is_chain:
                chains.append((matcher, start, list(s.drafts.token_ids)))
            else:
                trees.append((matcher, s.drafts, start))
            s.token_masks = rows_of
            start += n

        def fill() -> None:
            # Every sequence's rows at once, in llguidance's threads (a chain's row 1 + j
            # after its drafts 0..j, the matcher rolled back after).
            size = (masks.data_ptr(), self.words * 4, masks.shape[0])
            if alone:
                self._executor.unsafe_compute_mask_ptr(alone, *size)
            if chains:
                self._executor.unsafe_compute_mask_ptr_with_draft_token(chains, *size)
            if trees:
                _tree_masks(self._executor, trees, size)

        batch.fill_masks = self._in_thread(fill).result

    def masks_now(self, request_ids: Sequence[str | None]) -> torch.Tensor:
        """[n, words] int32 on the host (page-locked where masks are): the tokens each request's
        grammar allows next, from where it stands now. A None, or a request no longer followed,
        allows every token. For the greedy rows of a plain step run ahead, whose masked argmax
        the engine takes on the device before the step after is launched on them. Computed on
        the calling thread: nothing of the host's runs beside it (the engine has just followed
        the tokens these masks continue, and launches on them next), and handing one mask to the
        masks' thread and back cost 100-140 us against its 15-25 us (one row of a JSON schema,
        the default model's vocabulary, 2-core host)."""
        self._settle()
        masks = self._rows(len(request_ids))
        ours = [(self._matchers.get(r), i) for i, r in enumerate(request_ids) if r is not None]
        ours = [(m, i) for m, i in ours if m is not None]
        taken = {i for _, i in ours}
        free = [i for i in range(len(request_ids)) if i not in taken]
        if free:
            masks.numpy()[free] = -1
        if ours:  # (their compile made the executor)
            self._executor.unsafe_compute_mask_ptr(
                ours, masks.data_ptr(), self.words * 4, masks.shape[0]
            )
        return masks

    def _in_thread(self, fill: Callable[[], None]) -> Future:
        """`fill` started in the masks' thread (made on the first call) as the computation in
        flight, which every other call here waits for first (`_settle`)."""
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="outrider-masks")
        self._pending = self._filler.submit(fill)
        return self._pending

    def _rows(self, n: int) -> torch.Tensor:
        """[n, words] int32 of this step's host buffer, its old contents left as they are."""
        self._turn ^= 1
        buf = self._buffers[self._turn]
        if buf.shape[0] < n:
            size = max(n, 2 * buf.shape[0])
            buf = torch.empty(size, self.words, dtype=torch.int32, pin_memory=self._pinned)
            self._buffers[self._turn] = buf
        return buf[:n]

    def paths(
        self,
        seqs: Sequence[ScheduledSeq],
        candidates: Sequence[Sequence[Candidates]],  # per seq, per verify row (0 the root)
        decide: Callable[[list[tuple[int, int]], torch.Tensor], list[int]],
    ) -> list[list[tuple[int, int]]]:
        """Each grammar_topk sequence's targets, row by row along the path its drafts follow:
        a row's token is the argmax among what the grammar allows (`_pick` from the row's top
        candidates); where a draft node (child of the row) carries that token, the grammar
        follows it and its row is next. Per sequence [(row, target)], the root first; the last
        target is the one no draft matched (the bonus token). Rows off the path are not
        decided: the acceptance never reads them.

            drafts a b c (a chain), picks: root -> a, row 1 -> b, row 2 -> x (not c)
            -> [(0, a), (1, b), (2, x)]: drafts a b accepted, x emitted after them

        Rows whose candidates cannot tell (a late mask) wait for the round's end: their masks
        are computed in one call, in llguidance's threads; a mask that allows one token gives
        it, a row's candidates checked against its mask give the next, and
        `decide([(seq index, row)], masks [n, words] int32)` gives the rest in one go
        (from the logits on the device: a read, in a step run ahead taken on a side stream so
        that it waits for this step's logits, not for the step after). Their walks then go on.
        The matchers end where they began."""
        t0 = time.perf_counter()
        self._settle()
        walks = [_Walk(self._matchers[s.request.request_id], s.drafts) for s in seqs]
        forces = [s.request.request_id not in self._unforced for s in seqs]
        going = list(range(len(walks)))
        try:
            while going:
                late = []
                for i in going:
                    walk = walks[i]
                    while not walk.done:
                        ids, values = candidates[i][walk.row]
                        token, forced = _pick(walk.matcher, ids, values, forces[i])
                        self.counters.forced_rows += forced
                        if token is None:
                            late.append(i)
                            break
                        walk.take(token)
                if late:
                    masks = self._masks([walks[i].matcher for i in late])
                    tokens = self._only_allowed(masks)
                    forced = sum(token is not None for token in tokens)
                    for n, i in enumerate(late):  # a forced row's mask may allow several
                        if tokens[n] is None:
                            words = masks[n].numpy()
                            tokens[n] = _best(
                                lambda t, w=words: bool((w[t >> 5] >> (t & 31)) & 1),
                                *candidates[i][walks[i].row],
                            )
                    rest = [n for n, token in enumerate(tokens) if token is None]
                    if rest:  # the logits decide, on the device
                        picked = decide([(late[n], walks[late[n]].row) for n in rest], masks[rest])
                        for n, token in zip(rest, picked):
                            tokens[n] = token
                    for i, token in zip(late, tokens):
                        walks[i].take(token)
                    self.counters.late_masks += len(late)
                    self.counters.late_forced += forced
                going = [i for i in late if not walks[i].done]
        finally:
            for walk in walks:
                walk.rewind()
        self.counters.picked_rows += sum(len(w.targets) for w in walks)
        self.counters.path_s += time.perf_counter() - t0
        return [w.targets for w in walks]

    def _only_allowed(self, masks: torch.Tensor) -> list[int | None]:
        """Per row of masks [n, words] int32: the one token it allows, where it allows exactly
        one inside the vocabulary (the argmax among what it allows, whatever the logits), else
        None."""
        bits = np.unpackbits(masks.numpy().view(np.uint8), axis=1, bitorder="little")
        bits = bits[:, : self.vocab_size]
        ones = bits.sum(axis=1)
        first = bits.argmax(axis=1)
        return [int(t) if n == 1 else None for n, t in zip(ones.tolist(), first.tolist())]

    def _masks(self, matchers: list) -> torch.Tensor:
        """[n, words] int32: each matcher's allowed next tokens, computed now in one call."""
        rows = torch.empty(len(matchers), self.words, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], rows.data_ptr(), self.words * 4, len(rows)
        )
        return rows

    def advance(self, request_id: str, tokens: Sequence[int]) -> bool:
        """The tokens a step emitted for the request, in order; True when its grammar is
        complete (nothing may follow) or cannot go on."""
        self._settle()
        matcher = self._matchers.get(request_id)
        if matcher is None or not tokens:
            return False
        matcher.consume_tokens(tokens if isinstance(tokens, list) else list(tokens))
        return matcher.is_stopped()  # also after an error: the matcher stops there

    def forced_tokens(self, request_id: str) -> list[int]:
        """The tokens the request's grammar forces next (llguidance's fast-forward tokens: each
        one the only token its mask allows there), not taken; [] where it forces none or the
        request is not followed. The grammar, not the model, decides them: a plain engine
        emits them at once and computes them in the next forward (GrammarSteps.jump)."""
        self._settle()
        matcher = self._matchers.get(request_id)
        if matcher is None or request_id in self._unforced:
            return []
        return matcher.compute_ff_tokens()

    def forced_run(self, request_id: str, limit: int) -> list[int]:
        """`forced_tokens` and what the grammar forces after them, part after part (llguidance
        lists a run in parts, whose ends may join a token), at most `limit`; the matcher left
        where it stood. For a step launched before the token that starts the run is read
        (GrammarSteps.forced_runs)."""
        self._settle()
        matcher = self._matchers.get(request_id)
        if matcher is None or request_id in self._unforced:
            return []
        run: list[int] = []
        while len(run) < limit:
            part = matcher.compute_ff_tokens()[: limit - len(run)]
            # What the matcher accepts of its own forced tokens (all of them, as llguidance
            # builds them; a part it refused would leave it in an error state).
            part = part[: matcher.validate_tokens(part)] if part else part
            if not part:
                break
            matcher.consume_tokens(part)  # valid: the matcher cannot end in an error here
            run += part
            if matcher.is_stopped():
                break
        if run:
            matcher.rollback(len(run))
        return run

    def rewind(self, request_id: str, n: int) -> None:
        """Take back the request's last n tokens (its matcher rolled back over them)."""
        self._settle()
        matcher = self._matchers.get(request_id)
        if matcher is not None and n > 0:
            matcher.rollback(n)

    def until_complete(self, request_id: str, tokens: Sequence[int]) -> int:
        """How many of `tokens` (a step's accepted run) come before the grammar is complete,
        the completing token included: the rest would follow a request that plain decoding
        has finished. The matcher is left as it was."""
        self._settle()
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return len(tokens)
        n = 0
        for t in tokens:
            if not matcher.consume_token(t):
                break
            n += 1
            if matcher.is_stopped():
                break
        matcher.rollback(n)
        return n

    # -- drafts -------------------------------------------------------------------------------

    def allowed_drafts(self, request_id: str, drafts: SeqDrafts) -> SeqDrafts | None:
        """The request's drafts cut to what its grammar allows after its output so far (chains:
        the allowed prefix; trees: the nodes whose whole path is allowed); None when nothing is
        left. Unconstrained requests keep their drafts."""
        self._settle()
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return drafts
        if drafts.is_chain:
            n = matcher.validate_tokens(list(drafts.token_ids))
            return drafts.truncated(n) if n > 0 else None
        return _allowed_tree(matcher, drafts)

    def forced_drafts(
        self, request_id: str, drafts: SeqDrafts | None, limit: int
    ) -> tuple[SeqDrafts | None, int]:
        """A constrained request's chain drafts with the tokens its grammar forces (at most
        `limit` in all), and how many of them it forced. Where it forces the next tokens, drafts that
        begin with them are kept; otherwise the forced run replaces them (they were guesses at
        what the grammar settles). The drafts are cut at the first token it refuses and there
        continued by what it forces from that point (the drafts past the cut guessed along a
        path the grammar does not take; `{"a` drafted after `{"` on a grammar that needs `":`
        next becomes `":`). A chain with draft probabilities is only cut."""
        self._settle()
        matcher = self._matchers.get(request_id)
        if matcher is None or limit <= 0:
            return drafts, 0
        tokens = list(drafts.token_ids) if drafts is not None else []
        forced = matcher.compute_ff_tokens()[:limit]
        if forced and tokens[: len(forced)] != forced:
            return SeqDrafts.chain(forced), len(forced)
        n = matcher.validate_tokens(tokens) if tokens else 0
        if n == len(tokens):
            return (drafts if n else None), len(forced)
        more: list[int] = []
        if 0 < n < limit and drafts.draft_probs is None:
            matcher.consume_tokens(tokens[:n])
            more = matcher.compute_ff_tokens()[: limit - n]
            matcher.rollback(n)
        if not more:
            return (drafts.truncated(n) if n else None), len(forced)
        return SeqDrafts.chain(tokens[:n] + more), len(forced) + len(more)


_HINTS = {
    "json": "give a valid JSON schema (draft 2020-12 keywords)",
    "json_object": "use {'type': 'json_object'} alone",
    "regex": "give a regular expression that compiles (Rust regex syntax, no look-around)",
    "choice": "give a list of non-empty strings",
    "grammar": "give a Lark grammar (rules `name: ...`, a `start` rule) or GBNF (`root ::= ...`)",
}


def grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar text for a constraint (what compiled grammars are cached by)."""
    import llguidance

    match spec.kind:
        case "json" | "json_object":
            sep = {"item_separator": ",", "key_separator": ":"}
            if not spec.disable_any_whitespace:
                sep = {"item_separator": ", ", "key_separator": ": "}
            options = {"whitespace_flexible": False, **sep}
            schema = spec.json if spec.kind == "json" else '{"type": "object"}'
            try:
                json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"invalid structured_outputs.json: not JSON ({e}): give the schema as a "
                    "JSON object"
                ) from None
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        case "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        case "choice":
            return "start: " + " | ".join(json.dumps(c) for c in spec.choice)
        case _:
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                lark = any_to_lark(spec.grammar)
            except Exception as e:  # the converter's own parse errors, of several kinds
                raise ValueError(
                    f"invalid structured_outputs.grammar: {e}: {_HINTS['grammar']}"
                ) from None
            return llguidance.LLMatcher.grammar_from_lark(lark)


def _with_decoder(tokenizer_json: str) -> str:
    """A byte-level BPE saved without its decoder (the pre-tokenizer says how its tokens map to
    bytes) gets the matching one, which llguidance reads the token bytes from."""
    data = json.loads(tokenizer_json)
    pre = data.get("pre_tokenizer") or {}
    if data.get("decoder") is None and pre.get("type") == "ByteLevel":
        data["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                           "use_regex": True}  # fmt: skip
        return json.dumps(data)
    return tokenizer_json


def _pick(
    matcher, ids: Sequence[int], values: Sequence[float], forces: bool = True
) -> tuple[int | None, bool]:
    """(token, whether the grammar forced it): the argmax among what the matcher allows next,
    from a row's top logits (`ids` by descending `values`): the allowed id of the highest
    value, the lowest id of those tied there, as an argmax over the masked row gives. None
    where it cannot be told from them: the grammar forces bytes it has no tokens for, none is
    allowed, or the value reached ties the last one (more may tie past them).

    Where the grammar forces bytes (a key, its quotes), its mask allows one token, the first
    of the forced text's own tokenization (compute_ff_tokens: llguidance builds that mask
    from the same tokens), while validate_tokens also accepts other spellings of it ('to' for
    the 't' of a forced "todos"): such a row is that token, whatever its logits, with no mask
    (29 us a mask on a CPU core, against 18 us for the forced tokens). forces: False for a
    grammar that turns forcing off (`no_forcing`), whose mask there is not its forced tokens'
    first: those rows go to the mask. Elsewhere validate_tokens and the mask allow the same
    tokens."""
    if matcher.compute_ff_bytes():
        forced = matcher.compute_ff_tokens() if forces else None
        return (forced[0], True) if forced else (None, False)
    return _best(lambda token: matcher.validate_tokens([token]) == 1, ids, values), False


def _best(
    allowed: Callable[[int], bool], ids: Sequence[int], values: Sequence[float]
) -> int | None:
    """`_pick`'s argmax over the candidates `allowed` admits; None where they cannot tell."""
    best, best_value = None, None
    for token, value in zip(ids, values):
        if best_value is not None and value < best_value:
            break
        if allowed(token) and (best is None or token < best):
            best, best_value = token, value
    if best is None or values[-1] == best_value:
        return None
    return best


class _Walk:
    """One sequence's walk in Grammars.paths: the node it stands on (-1 the root), the targets
    so far, the draft tokens the matcher consumed."""

    def __init__(self, matcher, drafts: SeqDrafts | None) -> None:
        self.matcher = matcher
        self.children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        if drafts is not None:  # siblings carry distinct tokens
            for node, (token, parent) in enumerate(zip(drafts.token_ids, drafts.parents)):
                self.children[(parent, token)] = node
        self.node, self.consumed, self.done = -1, 0, False
        self.targets: list[tuple[int, int]] = []

    @property
    def row(self) -> int:
        return self.node + 1

    def take(self, token: int) -> None:
        """The current row's target; on to the draft node carrying it, if any."""
        self.targets.append((self.row, token))
        node = self.children.get((self.node, token), -1)
        if node < 0 or not self.matcher.consume_token(token):
            self.done = True
            return
        self.node, self.consumed = node, self.consumed + 1

    def rewind(self) -> None:
        if self.consumed:
            self.matcher.rollback(self.consumed)
            self.consumed = 0


def _path(drafts: SeqDrafts, node: int) -> list[int]:
    """The draft tokens from the root's first child down to `node`."""
    return [drafts.token_ids[n] for n in _path_nodes(drafts, node)]


def _tree_masks(executor, trees: list, size: tuple[int, int, int]) -> None:
    """Every tree's rows: row `start` the mask after the output so far, row start + 1 + i after
    the path to node i; trees: (matcher, drafts, start). In waves, node i of every tree at once
    in llguidance's threads: each matcher walks from node i - 1 to node i (back to their common
    ancestor, then down), so a node's path is never consumed whole. The matchers end where
    they began."""
    executor.unsafe_compute_mask_ptr([(m, start) for m, _, start in trees], *size)
    paths: list[list[int]] = [[] for _ in trees]  # the nodes each matcher has consumed, in order
    for i in range(max(d.num_nodes for _, d, _ in trees)):
        wave = []
        for (matcher, drafts, start), path in zip(trees, paths):
            if i >= drafts.num_nodes:
                continue
            target = _path_nodes(drafts, i)
            common = 0
            while common < min(len(path), len(target)) and path[common] == target[common]:
                common += 1
            if len(path) > common:
                matcher.rollback(len(path) - common)
            tokens = [drafts.token_ids[n] for n in target[common:]]
            if not matcher.consume_tokens(tokens):  # allowed_drafts keeps only allowed paths
                raise RuntimeError(
                    f"tree node {i} ({_path(drafts, i)}) is not allowed by the request's grammar"
                )
            path[:] = target
            wave.append((matcher, start + 1 + i))
        executor.unsafe_compute_mask_ptr(wave, *size)
    for (matcher, _, _), path in zip(trees, paths):
        if path:
            matcher.rollback(len(path))


def _path_nodes(drafts: SeqDrafts, node: int) -> list[int]:
    """The nodes from the root's first child down to `node`."""
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = drafts.parents[node]
    return nodes[::-1]


def _allowed_tree(matcher, drafts: SeqDrafts) -> SeqDrafts | None:
    """The nodes whose whole path the grammar allows, renumbered in their order."""
    keep: dict[int, int] = {}  # old index -> new
    tokens, parents = [], []
    for i, parent in enumerate(drafts.parents):
        if parent >= 0 and parent not in keep:
            continue  # below a refused node
        path = _path(drafts, i)
        if matcher.validate_tokens(path) < len(path):
            continue
        keep[i] = len(tokens)
        tokens.append(drafts.token_ids[i])
        parents.append(keep[parent] if parent >= 0 else -1)
    if not tokens:
        return None
    probs = None
    if drafts.draft_probs is not None:
        probs = drafts.draft_probs[list(keep)]
    return SeqDrafts(tokens, parents, probs)
