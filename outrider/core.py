"""Shared vocabulary between the engine (CPU bookkeeping) and the executor (the model).

Everything here is plain data. The scheduler hands a `ScheduledBatch` down, the runner hands a
`StepOutput` back; neither reaches into the other's state.
"""

from __future__ import annotations

import enum
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


class ForwardMode(enum.Enum):
    """What one model forward computes. Every mode runs the same flat-batch forward.

    PREFILL: at least one sequence computes a chunk of its prompt (decodes may ride along as
             one-token queries). DECODE: every sequence computes exactly one token.
    VERIFY:  every sequence computes 1 + k draft tokens (chain) or a tree's nodes.
    DRAFT:   the drafter's own forward.
    """

    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"
    DRAFT = "draft"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled by the caller

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on a request's output, as vLLM's `structured_outputs` names it: exactly one
    of a JSON schema (`json`, a dict or its JSON text), any JSON object (`json_object`), a
    regular expression (`regex`), one of some strings (`choice`) or a grammar (`grammar`, Lark
    or GBNF/EBNF: rules written `name ::= ...`). The engine compiles it when the request
    arrives (engine/structured.py); a constraint that does not compile is refused there, naming
    the field. `disable_any_whitespace`: JSON without whitespace between its tokens."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict | bool):
            object.__setattr__(
                self, "json", json.dumps(self.json)
            )  # key order kept: it is the output's
        if self.choice is not None:
            if isinstance(self.choice, str):
                raise ValueError(
                    f"invalid structured_outputs.choice={self.choice!r}: give a list of strings"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name)]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs sets {given or 'nothing'}: give exactly one of json, "
                "json_object, regex, choice or grammar"
            )
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, str), f"structured_outputs.{name}", value,
                   "give a string" + (" or a dict (the schema)" if name == "json" else ""))  # fmt: skip
        if self.choice is not None:
            _check(
                all(isinstance(c, str) and c for c in self.choice),
                "structured_outputs.choice",
                self.choice,
                "give non-empty strings",
            )

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n))

    @classmethod
    def of(cls, value: StructuredOutputs | dict | None) -> StructuredOutputs | None:
        """A StructuredOutputs, or one built from its fields as a dict (what a YAML file or a
        JSON request body holds)."""
        if value is None or isinstance(value, StructuredOutputs):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f for f in cls.__dataclass_fields__})
            if unknown:
                raise ValueError(
                    f"structured_outputs has unknown field(s) {unknown}: use json, json_object, "
                    "regex, choice, grammar or disable_any_whitespace"
                )
            return cls(**value)
        raise ValueError(
            f"invalid structured_outputs={value!r}: give a StructuredOutputs or a dict of its "
            "fields"
        )


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Validated on construction.

    temperature 0 means greedy. top_k 0 or -1 means no top-k. seed makes a request's sampling
    reproducible whatever else runs beside it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 256
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # False: token ids only, no text (saves the per-token detokenizing where nobody reads text,
    # e.g. generating training data); stop strings then cannot be matched.
    detokenize: bool = True
    # Completions per prompt (LLM.generate/chat: RequestOutput.outputs). The engine runs each as
    # its own request; with a seed, completion i samples with seed + i (as the server does).
    n: int = 1
    # A JSON schema, regex, choice or grammar the output must follow (a dict of its fields is
    # taken too): engine/structured.py.
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "structured_outputs", StructuredOutputs.of(self.structured_outputs)
        )
        # Accept lists and a single string for convenience; store tuples so params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        _check(
            self.temperature >= 0,
            "temperature",
            self.temperature,
            "use 0 for greedy or a value > 0",
        )
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "use a value in (0, 1]; 1 disables top-p")
        _check(
            self.top_k == -1 or self.top_k >= 0,
            "top_k",
            self.top_k,
            "use -1 or 0 to disable, or k >= 1",
        )
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "use a value in [0, 1]; 0 disables min-p")
        _check(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            self.presence_penalty,
            "use [-2, 2]",
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            self.frequency_penalty,
            "use [-2, 2]",
        )
        _check(
            self.repetition_penalty > 0,
            "repetition_penalty",
            self.repetition_penalty,
            "use a value > 0; 1 disables it",
        )
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "use an integer >= 1, or None for up to the context length",
        )
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "use an integer >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"keep it <= max_tokens ({self.max_tokens})",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            "logprobs",
            self.logprobs,
            "use an integer in [0, 20]",
        )
        _check(all(s for s in self.stop), "stop", self.stop, "stop strings must be non-empty")
        _check(
            self.detokenize or not self.stop,
            "stop",
            self.stop,
            "stop strings are matched in the text: keep detokenize=True, or stop on token ids "
            "(stop_token_ids)",
        )
        _check(
            isinstance(self.n, int) and not isinstance(self.n, bool) and 1 <= self.n <= 128,
            "n",
            self.n,
            "use an integer in [1, 128]: completions per prompt",
        )
        _check(
            self.seed is None or -(2**63) <= self.seed < 2**63,
            "seed",
            self.seed,
            "use an integer that fits in 64 bits (a torch.Generator seed)",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check(ok: bool, name: str, value: object, hint: str) -> None:
    if not ok:
        raise ValueError(f"invalid {name}={value!r}: {hint}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_request_counter = itertools.count()


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (skipped prefill)
    num_preemptions: int = 0
    # Speculative decoding: drafts verified, drafts accepted, verify steps, and how many
    # drafts were accepted at each depth (index 0 = the first draft after the root).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # Decode steps by the number of drafts verified in them (0: plain), as the controller chose.
    steps_by_k: dict[int, int] = field(default_factory=dict)


@dataclass
class Request:
    """One generation request and all its mutable engine-side state.

    Invariant: `num_computed_tokens` tokens of `all_token_ids` have their KV in the cache, laid
    out in `block_ids` (block i holds positions [i*block_size, (i+1)*block_size)).
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    request_id: str = field(default_factory=lambda: f"req-{next(_request_counter)}")
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # Set by the engine: a per-request RNG when params.seed is given (reproducible sampling).
    generator: torch.Generator | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # Top-N logprobs for each output token, when params.logprobs is set.
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # Drafts proposed for the next step (None or empty: a plain decode).
    drafts: SeqDrafts | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


# A chain of k drafts is the degenerate tree whose node i has parent i - 1. Node tokens are in
# topological order (a parent before its children); parent -1 is the sequence's last accepted
# token (the "root", whose KV is not yet written and which the verify forward computes too).
#
#     chain [a, b, c]:        parents [-1, 0, 1]
#     tree  root -> a -> c    parents [-1, -1, 0, 1]    tokens [a, b, c, d]
#                -> b -> d


@dataclass
class SeqDrafts:
    """One sequence's drafts. Invariant: len(parents) == len(token_ids) and parents[i] < i."""

    token_ids: list[int]
    parents: list[int]
    # [num_nodes, vocab] float32: the distribution node i's token was drawn from (all children
    # of one parent share a row's values). None: deterministic drafts (n-gram lookup), which
    # verification treats as one-hot proposals.
    draft_probs: torch.Tensor | None = None

    @classmethod
    def chain(cls, token_ids: Sequence[int], draft_probs: torch.Tensor | None = None) -> SeqDrafts:
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)), draft_probs)

    def truncated(self, n: int) -> SeqDrafts:
        """The first n nodes: still a valid tree, since parents come before children."""
        if n >= self.num_nodes:
            return self
        probs = None if self.draft_probs is None else self.draft_probs[:n]
        return SeqDrafts(self.token_ids[:n], self.parents[:n], probs)

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: compute KV for `token_ids` at `start_pos`..., and sample
    the next token after the last one when `sample` is true (a prompt chunk that does not end
    the prompt samples nothing)."""

    request: Request
    token_ids: list[int]  # the tokens whose KV this step computes
    start_pos: int  # position of token_ids[0] == request.num_computed_tokens
    block_ids: list[int]  # the request's block table, long enough for start_pos + len(token_ids)
    sample: bool
    # VERIFY: token_ids == [root] + drafts.token_ids, where the root is the last accepted token.
    drafts: SeqDrafts | None = None
    # A constrained request's allowed tokens at each sampling row (engine/structured.py): [1 +
    # draft nodes, ceil(V / 32)] int32 on the host, bit t % 32 of word t // 32 for token t.
    token_masks: torch.Tensor | None = None
    # A constrained greedy row decided on the host from its top logits (ScheduledBatch.
    # grammar_paths) instead of masks, in a plain decode step or a speculative step (SpecStep):
    # no mask is computed for it unless none of them fits.
    grammar_topk: bool = False
    # A row of a plain step run ahead that computes a run of tokens its grammar forced after the
    # token the step before it samples, that token first (engine/overlap.py): the host has them
    # all, and the row samples after the last.
    forced_run: bool = False

    @property
    def query_len(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens visible to this sequence's last query once this step's KV is written."""
        return self.start_pos + len(self.token_ids)


# A verify row's GRAMMAR_TOPK highest token ids and their logits, best first.
Candidates = tuple[list[int], list[float]]
GrammarPaths = Callable[
    [
        Sequence["ScheduledSeq"],
        Sequence[Sequence[Candidates]],
        Callable[[list[tuple[int, int]], torch.Tensor], list[int]],
    ],
    list[list[tuple[int, int]]],
]


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    seqs: list[ScheduledSeq]
    # Requests preempted (KV freed, to be recomputed) while building this batch.
    preempted: list[Request] = field(default_factory=list)
    # Waits for the contents of the sequences' token_masks (allocated, being computed on the
    # host since the batch was scheduled). The runner calls it (ready_masks) once the step's
    # forward is queued on the device, so the grammar works while the inputs are built and
    # the GPU runs.
    fill_masks: Callable[[], None] | None = None
    # The grammars' decision for grammar_topk rows (engine/structured.py, Grammars.paths):
    # (seqs, each one's verify rows' top candidates, decide) -> per seq [(row, token)], the
    # token the grammar lets the target pick at each row of the path its drafts follow;
    # decide([(seq index, row)], masks [n, W] int32) -> the argmax of each such row's logits
    # among what its mask allows, for rows none of whose candidates the grammar allows.
    grammar_paths: GrammarPaths | None = None

    def ready_masks(self) -> None:
        """Wait until every ScheduledSeq.token_masks of the batch is filled; read them only
        after."""
        fill, self.fill_masks = self.fill_masks, None
        if fill is not None:
            fill()

    @property
    def num_tokens(self) -> int:
        return sum(s.query_len for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class StepOutput:
    """What the runner decided, one entry per sampling sequence of the batch, in batch order
    (sequences with sample=False are absent)."""

    request_ids: list[str]
    token_ids: list[list[int]]  # new tokens per sequence (one without speculation)
    # Per sequence: drafts accepted by verification (0 for sequences without drafts). The KV
    # of the root and the accepted drafts is valid afterwards; the rest is rolled back.
    num_accepted: list[int] | None = None
    # Per sequence, per new token: {token_id: logprob} for the sampled token and the top-N.
    logprobs: list[list[dict[int, float]]] | None = None
    # VERIFY: per sampling sequence, the accepted draft nodes in path order (for a chain,
    # 0..num_accepted-1); [] for sequences without drafts.
    accepted_nodes: list[list[int]] | None = None
    # When a drafter asked for them: the target's aux residual streams for every token of the
    # batch, concatenated [num_tokens, len(aux_layers) * hidden] on the device.
    aux_hidden: torch.Tensor | None = None
    # Per sampling sequence: the drafts a drafter on the device made for the next step (the
    # speculative step drafts right after verifying); None when the step made none.
    next_drafts: list[SeqDrafts] | None = None
    # Rows with ScheduledSeq.grammar_topk: row -> (top ids, their logits, best first), and
    # those rows' logits on the device in the same order (for a row none of whose top ids its
    # grammar allows). token_ids holds their unmasked argmax until the engine picks.
    grammar_candidates: dict[int, Candidates] | None = None
    grammar_logits: torch.Tensor | None = None


@dataclass
class LaunchedGrammar:
    """What a plain decode step launched without a host read (ModelRunner.launch) keeps for its
    grammar_topk rows, on the device: their rows among the step's sequences, their logits
    [P, vocab] and their top candidates packed [P, 2 GRAMMAR_TOPK] (ids then values, float64;
    sampler.top_candidates_no_sync; None where the engine takes their masked argmax on the
    device instead). The step's ids hold their unmasked argmax."""

    rows: list[int]
    logits: torch.Tensor
    candidates: torch.Tensor | None


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's name): RequestOutput.outputs[index]."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    metrics: dict[str, float | int | None] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """What a caller receives: the whole output so far, or (streaming) the new part. text,
    token_ids, finish_reason and logprobs are the first completion's; `outputs` holds every
    completion (SamplingParams.n of them), as vLLM's RequestOutput does."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: dict[str, float | int | None]
    logprobs: list[dict[int, float]] | None = None
    completions: list[CompletionOutput] | None = None  # None: the one above

    @property
    def outputs(self) -> list[CompletionOutput]:
        if self.completions is not None:
            return self.completions
        return [
            CompletionOutput(
                0, self.text, self.token_ids, self.finish_reason, self.logprobs, self.metrics
            )
        ]
