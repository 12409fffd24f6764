"""EAGLE-3 proposals: the draft network runs ahead of the target on the target's own features.

Alignment (C = a request's computed tokens; x_p its token at position p; h_p the target's aux
features computed at p). The draft's row at position p takes (x_{p+1}, h_p) and predicts
x_{p+2}, so its KV pool is indexed by the same positions as the target's and shares the
target's block tables (one layer, same block ids; a separate pool).

    after every target forward (`observe`): one EXTEND over the rows the target just made
    valid — a prompt chunk's tokens, a decode's token, a verify's root and accepted drafts —
    with h from that forward (no extra target forward). Its last row, at C - 1, gives d_1.
    `propose`: chain step j (2..k) runs at position C + j - 2 on (d_{j-1}, its own pre-norm
    hidden) over the draft KV of positions < C + j - 1, and gives d_j.

The chain steps write draft KV at positions C..C+k-2, inside the slots the next VERIFY uses
(C..C+k): the engine allocates those blocks before proposing (`writes_kv`). The next EXTEND
overwrites them with features of the accepted tokens. A prefix-cache hit reuses the draft KV
of the block's earlier owner too: identical except at a block's last position, whose input is
the next block's first token; a draft-quality effect only, never a correctness one.

Drafts are the draft's argmax, proposed as deterministic (one-hot) drafts: verification stays
lossless for sampled requests too.
"""

from __future__ import annotations

import json
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "data"


def shipped_drafter(target) -> Path:
    """The drafter shipped in the package for `target` (its model config): a folder under
    outrider/data whose name contains 'eagle3' and whose config.json was written for a target of
    this shape (outrider.target: hidden size, layers, vocabulary)."""
    want = [target.hidden_size, target.num_hidden_layers, target.vocab_size]
    for d in sorted(SHIPPED_DIR.glob("*eagle3*")):
        try:
            meta = json.loads((d / "config.json").read_text()).get("outrider", {})
        except (OSError, ValueError):
            continue
        t = meta.get("target", {})
        if [t.get("hidden_size"), t.get("num_hidden_layers"), t.get("vocab_size")] == want:
            return d
    raise ValueError(
        f"no EAGLE-3 drafter ships for this model (hidden {want[0]}, {want[1]} layers, vocabulary "
        f"{want[2]}): pass speculative={{'method': 'eagle3', 'draft': PATH}} or train one with "
        "`outrider drafter datagen` and `outrider drafter train`"
    )
