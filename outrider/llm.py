"""The offline API, in the shape vLLM users know:

from outrider import LLM, SamplingParams
llm = LLM()                                   # the embedded default model
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
print(out[0].text, out[0].finish_reason, out[0].metrics)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from outrider.config import EngineConfig, flat_sections
from outrider.core import RequestOutput, SamplingParams
from outrider.engine.engine import EngineCore
from outrider.engine.tracked import request_metrics

Prompt = str | list[int]
Conversation = list[dict[str, Any]]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        speculative: dict[str, Any] | None = None,
        config: EngineConfig | None = None,
        speculative_config: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        """`speculative` holds SpecConfig fields, e.g. {"method": "ngram", "num_draft_tokens":
        4}; `speculative_config` is the same in vLLM's keys ({"method": "eagle3", "model":
        drafter_dir, "num_speculative_tokens": 3}); either takes both spellings. `options` are
        fields of the cache, scheduler and model configs (block_size, num_blocks,
        cpu_kv_bytes, enable_prefix_caching, max_num_seqs, max_num_batched_tokens,
        attention_backend, seed, tensor_parallel_size, ...) and vLLM's enforce_eager,
        gpu_memory_utilization (config.flat_sections).

        deterministic=True (SGLang's enable_deterministic_inference) computes every row with
        reductions that depend on that row alone (layers/batch_invariant.py): output is the
        same at any batch size, and greedy speculative output equals plain output bit for bit
        in bf16 as well as fp32, for some speed (one GEMV per row on the CPU).

        tensor_parallel_size=N splits the model over N processes: outside torchrun this one is
        rank 0 and starts the others on this machine; under torchrun every rank constructs
        the LLM, and ranks > 0 never return from here (they follow rank 0, then exit)."""
        config = config or EngineConfig()
        if speculative is not None and speculative_config is not None:
            raise TypeError("LLM() got both speculative and speculative_config: pass one")
        spec = speculative if speculative is not None else speculative_config
        try:
            sections = flat_sections(options)
        except ValueError as e:
            raise TypeError(f"LLM() got an unknown or invalid option: {e}") from None
        sections["speculative"] = {**sections["speculative"], **dict(spec or {})}
        sections["model"].update(
            model=model if model is not None else config.model.model,
            dtype=dtype if dtype != "auto" else config.model.dtype,
            device=device if device != "auto" else config.model.device,
            max_model_len=max_model_len
            if max_model_len is not None
            else config.model.max_model_len,
        )
        self.config = config.replace(**sections)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """End what the engine started outside this process (the other tensor-parallel ranks);
        also done when the LLM is garbage-collected or the interpreter exits."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- generation -------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (a string, or a list of token ids); outputs in prompt order."""
        prompts = _as_prompt_list(prompts)
        return self._run([self._encode(p) for p in prompts], prompts, sampling_params)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.apply_chat_template(c, add_generation_prompt, tools) for c in conversations]
        encoded = [self.encode_chat(c, add_generation_prompt, tools) for c in conversations]
        return self._run(encoded, texts, sampling_params)

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield deltas (new text, new token ids) as they are decoded; the last has finished=True
        and the request's metrics. Closing the iterator early aborts the request."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"stream() yields one completion, got n={params.n}: use generate()")
        req = self.engine.add_request(
            self._encode(prompt), params, prompt=prompt if isinstance(prompt, str) else None
        )
        try:
            while not req.is_finished:
                for delta in self.engine.step():
                    if delta.request_id == req.request_id:
                        yield delta
        finally:
            if not req.is_finished:
                self.engine.abort(req.request_id)

    def apply_chat_template(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tools=tools
        )

    def encode_chat(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the conversation, rendered by the chat template: special-token text
        inside messages stays text (Tokenizer.encode_chat), so a message cannot forge a turn."""
        return self.tokenizer.encode_chat(
            conversation, add_generation_prompt=add_generation_prompt, tools=tools
        )

    def encode_chat_text(self, text: str) -> list[int]:
        """Token ids of a rendered chat template: the template writes BOS itself when the model
        wants one, so the tokenizer must not add another. Every special-token string in `text`
        becomes a control token, message text included: for untrusted messages use
        encode_chat."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- helpers ----------------------------------------------------------------------------

    def _run(
        self,
        encoded: list[list[int]],
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        params = _as_params_list(sampling_params, len(encoded))
        for ids, p in zip(encoded, params):  # validate all before any starts: nothing half-runs
            self.engine.validate(ids, _completion(p, 0))
        # One engine request per completion; completion i of a seeded prompt uses seed + i.
        groups = [
            [
                self.engine.add_request(
                    ids, _completion(p, i), prompt=prompt if isinstance(prompt, str) else None
                )
                for i in range(p.n)
            ]
            for ids, p, prompt in zip(encoded, params, prompts)
        ]
        requests = [r for group in groups for r in group]
        texts: dict[str, list[str]] = {r.request_id: [] for r in requests}
        while any(not r.is_finished for r in requests):
            for delta in self.engine.step():
                if delta.request_id in texts:
                    texts[delta.request_id].append(delta.text)
        outputs = []
        for group, prompt in zip(groups, prompts):
            first, *rest = [self._final(r, "".join(texts[r.request_id]), prompt) for r in group]
            if rest:
                first.completions = [c.outputs[0] for c in (first, *rest)]
                for i, c in enumerate(first.completions):
                    c.index = i
            outputs.append(first)
        return outputs

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _final(self, req, text: str, prompt: Prompt) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=req.prompt_token_ids,
            text=text,
            token_ids=list(req.output_token_ids),
            finished=True,
            finish_reason=str(req.finish_reason),
            metrics=request_metrics(req),
            logprobs=req.output_logprobs if req.params.logprobs is not None else None,
        )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    for p in prompts:
        if not isinstance(p, str | list | tuple):
            raise TypeError(
                f"a prompt must be a string or a list of token ids, got {type(p).__name__}"
            )
    return [p if isinstance(p, str) else list(p) for p in prompts]


def _completion(params: SamplingParams, i: int) -> SamplingParams:
    """The engine request's params for completion i of params.n."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + i
    return dataclasses.replace(params, n=1, seed=seed)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(
            f"got {len(params)} SamplingParams for {n} prompts: pass one, or one per prompt"
        )
    return params
