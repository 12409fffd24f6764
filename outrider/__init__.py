"""outrider: LLM inference built around speculative decoding that pays off.

`from outrider import LLM, SamplingParams` — the engine is imported on first use, so light
imports (the CLI's --help, config) stay fast.
"""

from typing import TYPE_CHECKING

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from outrider.core import RequestOutput, SamplingParams
    from outrider.llm import LLM


def __getattr__(name: str):
    if name == "LLM":
        from outrider.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutput"):
        from outrider import core

        return getattr(core, name)
    raise AttributeError(f"module 'outrider' has no attribute {name!r}")
