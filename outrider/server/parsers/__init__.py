"""Tool-call and reasoning parsers, registered by name in `registry.py`."""
