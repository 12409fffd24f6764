"""Order of the suite: test files without a slow test run first, so `make test -q` prints most
of its dots in its first minutes instead of a handful while the slow files build engines and
train drafters. Files keep their tests together (module-scoped fixtures are built once) and
their order among themselves."""

from __future__ import annotations


def pytest_collection_modifyitems(config, items):
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path in slow_files)  # stable: otherwise as collected
