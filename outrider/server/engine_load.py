"""Building a server's engine: loaded and warmed up in a thread that has ended before the engine
serves (`apart`), whether it then serves from this process's engine thread or from an engine
process (server/engine_process.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from outrider.config import EngineConfig
from outrider.core import SamplingParams
from outrider.engine.engine import EngineCore

T = TypeVar("T")


def load_engine(engine_config: EngineConfig) -> EngineCore:
    """The engine, built and warmed up in a thread that has ended when this returns (apart)."""
    return apart(_load, engine_config)


def _load(engine_config: EngineConfig) -> EngineCore:
    core = EngineCore(engine_config)
    warm_up(core)
    return core


def apart(fn: Callable[..., T], *args) -> T:
    """fn(*args) in a thread of its own, ended when this returns: its result, or its exception
    raised here.

    A server's model then runs in one thread alone, the engine thread. torch's CPU ops run in
    OpenMP (libgomp) teams, one for each thread that starts them, and while a second thread's
    team lives (the main thread's, left by loading the model there) libgomp counts more threads
    than cores and puts each team's workers to sleep between parallel regions instead of
    spinning. On 2 cores every elementwise op of the engine thread then took ~150 us where the
    main thread's took ~22 (a 256 x 256 tensor), and the server decoded 30% slower than `LLM`
    on the same prompts (50 against 72 tok/s at C=4). A team ends with its thread."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # raised again in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="outrider-load", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)  # with a timeout, so that Ctrl-C reaches the main thread meanwhile
    if "error" in box:
        raise box["error"]
    return box["value"]


WARM_UP_TOKENS = 12  # with a proposer: room for speculative steps, run ahead where they can


def warm_up(core: EngineCore) -> None:
    """One short generation before READY: the first forward allocates and (on GPU) compiles.
    The tokenizer's length bound too (~0.1 s, once), not at the first request on the loop.
    With a proposer it drafts every step, unseen by the adaptive controller (which would keep
    the warm-up's acceptance, and its step times inflated by compiling): the drafter's
    catch-up and the speculative step compile their kernels here (on an H100 a first EAGLE-3
    server compiled its drafter's top-k and attention in the first requests' time, about a
    second), and the speculator's counters start afresh."""
    core.tokenizer.least_tokens("")
    spec = core.speculator
    controller, spec.controller = spec.controller, None  # a fixed k: the largest
    tokens = WARM_UP_TOKENS if spec.proposer is not None else 2
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    try:
        req = core.add_request([core.tokenizer.bos_token_id or 0], params)
        while not req.is_finished:
            core.step()
    finally:
        spec.controller = controller
    spec.reset_stats()
    spec.steps_by_k.clear()
