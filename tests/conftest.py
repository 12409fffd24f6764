"""Order of the suite: test files without a slow test run first, so `make test -q` prints most
of its dots in its first minutes instead of a handful while the slow files build engines and
train drafters. Files keep their tests together (module-scoped fixtures are built once) and
their order among themselves. Speculative step profiles are measured afresh by every engine
a test builds (OUTRIDER_STEP_PROFILES=off), never read from the user's cache."""

from __future__ import annotations


def pytest_collection_modifyitems(config, items):
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path in slow_files)  # stable: otherwise as collected


def pytest_configure(config):
    # The servers tests start inherit it: no controller starts from a table another test, or
    # an earlier run, measured.
    import os

    os.environ.setdefault("OUTRIDER_STEP_PROFILES", "off")
