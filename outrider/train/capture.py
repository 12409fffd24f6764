"""Target features for drafter training, computed online by the code that serves the target.

A drafter learns to read one engine's hidden states; trained on another engine's (a different
kernel, fusion or rounding order) it collapses when served. So the features come from the
engine's own forward (`ModelRunner.forward` with aux layers: the model object it serves, on its
device and dtype, through its attention backend) over a PREFILL batch of whole sequences, as
serving prefills. The runner's KV pool is left alone (its blocks may back the prefix cache):
the forward writes into a private pool, bound for the duration of the capture and unbound
after.

Per token the target gives (`aux_layers` in outrider's convention: the residual stream entering
each, HF hidden_states[i]; EAGLE-3's default layers 2, L//2, L-3, or the drafter's own):
    aux    [N, 3 * H]  the three residual streams, low | mid | high, what draft.fc fuses
    final  [N, H]      the final normed hidden; logits = lm_head(final), recomputed on demand so
                       a disk cache holds 4H numbers per token instead of the vocabulary
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from outrider.core import ForwardMode, Request, SamplingParams, ScheduledBatch, ScheduledSeq
from outrider.executor.kv_cache import KVPool


@dataclass
class Features:
    aux: torch.Tensor  # [N, 3 * H] target dtype, sequences concatenated in the order given
    final: torch.Tensor  # [N, H]

    def per_sequence(self, lengths: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(aux [T_i, 3H], final [T_i, H])] for sequences of these lengths, in order (views)."""
        return list(zip(self.aux.split(list(lengths)), self.final.split(list(lengths))))


class TargetCapture:
    def __init__(self, llm, aux_layers: Sequence[int] | None = None) -> None:
        """aux_layers: the layers whose entering residual streams `features` returns (a
        drafter's `config.aux_layers`); None: EAGLE-3's default for this target."""
        self.runner = runner = llm.engine.runner
        self.model = runner.model
        self.device, self.dtype = runner.device, runner.dtype
        self.block_size, self.max_model_len = runner.block_size, runner.max_model_len
        self.config = cfg = runner.model_config
        n = cfg.num_hidden_layers
        self.aux_layers = tuple(cfg.aux_hidden_layers if aux_layers is None else aux_layers)
        if len(set(self.aux_layers)) != 3 or not all(0 <= i < n for i in self.aux_layers):
            raise ValueError(
                f"EAGLE-3 fuses 3 distinct target layers but a {n}-layer target gives aux "
                f"layers {self.aux_layers}: use a target with >= 7 layers"
                if aux_layers is None
                else f"aux layers {list(self.aux_layers)} must be 3 distinct layer indices in "
                f"0..{n - 1} of the {n}-layer target (the residual stream entering each)"
            )
        self._pool: KVPool | None = None

    # -- features ---------------------------------------------------------------------------

    def features(self, seqs: Sequence[Sequence[int]]) -> Features:
        """One PREFILL forward over whole sequences -> their tokens' features, concatenated."""
        too_long = [len(s) for s in seqs if not 0 < len(s) <= self.max_model_len]
        if too_long:
            raise ValueError(
                f"sequence lengths {too_long[:5]} are outside 1..max_model_len="
                f"{self.max_model_len}, the target's context: use --max-len (max_len) <= "
                f"{self.max_model_len}, which truncates longer samples"
            )
        bs = self.block_size
        blocks_needed = sum(-(-len(s) // bs) for s in seqs)
        batch, nxt = [], 0
        for ids in seqs:
            n = -(-len(ids) // bs)
            req = Request(prompt_token_ids=list(ids), params=SamplingParams(temperature=0))
            batch.append(ScheduledSeq(req, list(ids), 0, list(range(nxt, nxt + n)), sample=False))
            nxt += n
        with self._private_kv(blocks_needed):
            final, aux, _ = self.runner.forward(
                ScheduledBatch(ForwardMode.PREFILL, batch), self.aux_layers
            )
        # The runner's forward runs under inference_mode; inference tensors cannot be saved
        # for the draft's backward, so the features leave it as ordinary tensors (cat, clone).
        with torch.no_grad():
            return Features(aux=torch.cat(aux, dim=-1), final=final.clone())

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's token embedding (what the drafter is bound to when served)."""
        return self.model.model.embed_tokens(ids.to(self.device))

    @torch.no_grad()
    def distributions(
        self,
        final: torch.Tensor,  # [N, H]
        draft_target_ids: torch.Tensor,  # [Vd] target id of each draft id (i + d2t[i])
        target_to_draft: torch.Tensor,  # [vocab] draft id of each target id, -1 outside
        chunk: int = 4096,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> target p(next token) on the draft vocabulary [N, Vd] (fp32, not renormalised) and
        the draft id of the target's argmax [N] (-1 when the argmax is outside the draft
        vocabulary). Chunked: [chunk, vocab] fp32 logits at a time, not [N, vocab]."""
        probs, tops = [], []
        for rows in final.split(chunk):
            logits = self.model.compute_logits(rows).float()  # [chunk, vocab]
            p = torch.softmax(logits, dim=-1)
            probs.append(p[:, draft_target_ids])
            tops.append(target_to_draft[logits.argmax(-1)])
        return torch.cat(probs), torch.cat(tops)

    # -- the private KV pool ----------------------------------------------------------------

    @contextlib.contextmanager
    def _private_kv(self, num_blocks: int) -> Iterator[None]:
        layers = self.model.attention_layers()
        if self._pool is None or self._pool.num_blocks < num_blocks:
            self._pool = None  # free the old one first
            layout = self.model.kv_layout(self.dtype)  # the serving pool's layout
            self._pool = KVPool(layout, len(layers), num_blocks, self.block_size, self.device)
        saved = [a.kv_cache for a in layers]
        try:
            for i, a in enumerate(layers):
                a.kv_cache = self._pool.layer(i)
            yield
        finally:
            for a, kv in zip(layers, saved):
                a.kv_cache = kv


class FeatureCache:
    """Captured features on disk: one safetensors shard per capture call, tensors named
    "<sample id>/aux" and "<sample id>/final" (bf16), and an index {sample id: shard} per rank
    (index-<rank>.json; every rank reads all of them at start, writes only its own). The index
    is rewritten atomically after each shard, so a crash loses at most the last shard."""

    def __init__(
        self, directory: str | Path, rank: int = 0, aux_layers: Sequence[int] | None = None
    ) -> None:
        """aux_layers: the layers the features come from, recorded in features.json; a cache
        written for other layers is refused (its features would train the wrong fc)."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        if aux_layers is not None:
            self._check_layers([int(i) for i in aux_layers])
        self._index_path = self.dir / f"index-{rank}.json"
        self.index: dict[str, str] = {}
        for f in sorted(self.dir.glob("index-*.json")):
            self.index.update(json.loads(f.read_text()))
        self._own: dict[str, str] = (
            json.loads(self._index_path.read_text()) if self._index_path.exists() else {}
        )

    def _check_layers(self, aux: list[int]) -> None:
        meta = self.dir / "features.json"
        if meta.exists():
            recorded = json.loads(meta.read_text()).get("aux_layers")
            if recorded != aux:
                raise ValueError(
                    f"feature cache {str(self.dir)!r} holds features of aux layers {recorded}, "
                    f"but this run uses {aux}: use another feature_cache directory (or delete "
                    f"this one)"
                )
            return
        tmp = meta.with_suffix(f".tmp-{uuid.uuid4().hex[:8]}")  # ranks may race: same content
        tmp.write_text(json.dumps({"aux_layers": aux}))
        tmp.replace(meta)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.index

    def put(self, ids: Sequence[str], lengths: Sequence[int], feats: Features) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for sid, (aux, final) in zip(ids, feats.per_sequence(lengths)):
            tensors[f"{sid}/aux"] = aux.to(torch.bfloat16).contiguous().cpu()
            tensors[f"{sid}/final"] = final.to(torch.bfloat16).contiguous().cpu()
        shard = f"shard-{self.rank}-{uuid.uuid4().hex[:12]}.safetensors"
        save_file(tensors, str(self.dir / shard))
        self.index.update(dict.fromkeys(ids, shard))
        self._own.update(dict.fromkeys(ids, shard))
        tmp = self._index_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._own))
        tmp.replace(self._index_path)

    def get(self, ids: Sequence[str], device: torch.device, dtype: torch.dtype) -> Features:
        from safetensors import safe_open

        aux, final = [], []
        by_shard: dict[str, list[str]] = {}
        for sid in ids:
            by_shard.setdefault(self.index[sid], []).append(sid)
        got: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for shard, sids in by_shard.items():
            with safe_open(str(self.dir / shard), framework="pt") as f:
                for sid in sids:
                    got[sid] = (f.get_tensor(f"{sid}/aux"), f.get_tensor(f"{sid}/final"))
        for sid in ids:
            aux.append(got[sid][0])
            final.append(got[sid][1])
        return Features(
            aux=torch.cat(aux).to(device=device, dtype=dtype),
            final=torch.cat(final).to(device=device, dtype=dtype),
        )


def cache_cost_bytes(num_tokens: int, hidden_size: int) -> int:
    """Disk a feature cache takes: per token 3H aux + H final numbers, 2 bytes each (bf16)."""
    return num_tokens * 4 * hidden_size * 2
