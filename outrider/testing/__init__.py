"""Stand-ins that benchmarks and tests serve in place of what a real deployment has: drafts whose
acceptance follows a chosen curve (synthetic.py), a drafter that pays for a real draft network
while drafting them (synthetic_drafter.py), and an engine core with no model behind the server
(server_core.py). It stands above the engine: it may import any package, and no package of the
engine imports it (tests/unit/test_import_layers.py)."""
