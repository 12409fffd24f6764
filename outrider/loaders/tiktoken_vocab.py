"""tiktoken vocabularies (Kimi-K2 / K2.5 ship `tiktoken.model`, no tokenizer.json) as a
`tokenizers` byte-level BPE, so outrider.loaders.tokenizer.Tokenizer serves them like any other
vocabulary; no `tiktoken` package needed."""

from __future__ import annotations

from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from outrider.loaders.vocab_common import byte_alphabet, read_json, token_content

TIKTOKEN_FILE = "tiktoken.model"
# Kimi's pre-tokenizer (its tokenization_kimi.py): Han runs, cased words with their
# contractions (class intersections: letters that are not Han), numbers of up to 3 digits,
# punctuation runs, newlines, spaces.
KIMI_SPLIT = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
NUM_RESERVED_SPECIAL = 256 + 2  # ids past the ranks: named in tokenizer_config or reserved


def read_tiktoken_ranks(path: Path) -> list[bytes]:
    """tiktoken.model: one `base64(token bytes) rank` line per token -> the tokens by rank.
    The ranks must be 0..n-1, each once: they are the ids."""
    import base64

    by_rank: dict[int, bytes] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            by_rank[int(rank)] = base64.b64decode(token, validate=True)
        except ValueError as e:
            raise ValueError(
                f"{str(path)!r} line {number} is not `<base64 token> <rank>`: {line[:60]!r} "
                f"({e}); is this a tiktoken BPE file?"
            ) from e
    if sorted(by_rank) != list(range(len(by_rank))):
        raise ValueError(f"{str(path)!r}: ranks are not 0..{len(by_rank) - 1}, each once")
    return [by_rank[r] for r in range(len(by_rank))]


def rank_bpe(piece: bytes, ranks: dict[bytes, int], max_rank: int | None = None) -> list[bytes]:
    """tiktoken's merge loop: join the adjacent pair whose join has the lowest rank, until no
    join is a token (of rank < max_rank, when given)."""
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (max_rank is None or r < max_rank) and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def tiktoken_backend(path: Path) -> tokenizers.Tokenizer:
    """A tiktoken vocabulary as byte-level BPE: each multi-byte token's merge is the split the
    merge loop reaches on its bytes with the lower ranks alone, ranked by the token's own rank
    (a BPE-trained vocabulary makes every token by exactly one merge); a whole pre-token that
    is a token is taken as one, as tiktoken does. Special ids follow the ranks: names from
    tokenizer_config.json's added_tokens_decoder, the rest `<|reserved_token_i|>`."""
    tokens = read_tiktoken_ranks(path / TIKTOKEN_FILE)
    ranks = {t: i for i, t in enumerate(tokens)}
    spelling = byte_alphabet()

    def spell(b: bytes) -> str:
        return "".join(spelling[x] for x in b)

    merges = []
    for rank, token in enumerate(tokens):
        if len(token) < 2:
            continue
        parts = rank_bpe(token, ranks, max_rank=rank)
        if len(parts) == 2:
            merges.append((spell(parts[0]), spell(parts[1])))
    model = models.BPE(
        vocab={spell(t): i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=True
    )
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    named = {
        int(i): token_content(t)
        for i, t in read_json(path / "tokenizer_config.json")
        .get("added_tokens_decoder", {})
        .items()
    }
    base = len(tokens)
    specials = [
        AddedToken(named.get(i, f"<|reserved_token_{i}|>"), special=True, normalized=False)
        for i in range(base, base + NUM_RESERVED_SPECIAL)
    ]
    backend.add_special_tokens(specials)
    for i, t in zip(range(base, base + NUM_RESERVED_SPECIAL), specials):
        if backend.token_to_id(t.content) != i:
            raise ValueError(
                f"{str(path)!r}: special token {t.content!r} should have id {i} but the "
                "vocabulary already spells it: check tokenizer_config.json's added_tokens_decoder"
            )
    return backend
