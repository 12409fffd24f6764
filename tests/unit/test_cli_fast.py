"""The CLI's parser: what it imports, how it shows defaults, and how flags reach the configs.
Start-up time itself is measured by benchmarks/cli_startup.py, not tested."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys

import pytest

from outrider.cli import SAMPLING_FLAGS, build_parser, engine_config, given, main
from outrider.config import EngineConfig
from outrider.server.cli import configs_from_args

HEAVY = (
    "torch",
    "numpy",
    "transformers",
    "safetensors",
    "fastapi",
    "uvicorn",
    "pydantic",
    "httpx",
    "matplotlib",
)

# Every command whose help and argument errors must stay light, and one argument error.
LIGHT_ARGVS = (
    ["--help"],
    ["generate", "--help"],
    ["serve", "--help"],
    ["deploy", "--help"],
    ["drafter", "--help"],
    ["drafter", "train", "--help"],
    ["drafter", "datagen", "--help"],
    ["drafter", "eval", "--help"],
    ["bench", "--help"],
    ["bench", "serve", "--help"],
    ["bench", "comm", "--help"],
    ["plan", "--help"],
    ["generate", "--spec", "bogus", "x"],
)


def test_parsing_imports_nothing_heavy():
    code = f"""
import contextlib, io, json, sys
from outrider.cli import build_parser
for argv in {list(LIGHT_ARGVS)!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pass
print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == []


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return out.getvalue()


def _entries(help_text: str) -> dict[str, str]:
    """Each option's help, keyed by its first line, continuation lines joined."""
    entries: dict[str, str] = {}
    key = None
    for line in help_text.splitlines():
        if re.match(r"  -", line):
            key = line.split()[0]
            entries[key] = line
        elif key and line.startswith("     "):
            entries[key] += " " + line.strip()
        else:
            key = None
    return entries


@pytest.mark.parametrize(
    "argv",
    [
        ["generate"],
        ["serve"],
        ["deploy"],
        ["drafter", "datagen"],
        ["drafter", "eval"],
        ["drafter", "train"],
        ["drafter", "doctor"],
    ],
)
def test_help_shows_each_default_once(argv):
    entries = _entries(_help(argv))
    assert "--model" in entries or "--config" in entries
    twice = {k: v for k, v in entries.items() if v.count("default:") > 1}
    assert not twice, twice


def test_serve_help_shows_server_and_engine_defaults():
    entries = _entries(_help(["serve"]))
    assert "(default: 30.0)" in entries["--shutdown-timeout"]
    assert "(default: the checkpoint's name)" in entries["--served-model-name"]
    assert "(default: auto)" in entries["--dtype"]
    assert "(default: 0.85)" in entries["--gpu-memory-utilization"]


def test_sampling_help_defaults_match_sampling_params():
    from outrider.config_fields import defaults
    from outrider.core import SamplingParams

    d = defaults(SamplingParams)
    assert {name: default for name, _, default, _ in SAMPLING_FLAGS} == {
        name: d[name] for name, _, _, _ in SAMPLING_FLAGS
    }


YAML = """
model: {dtype: float32}
cache: {num_blocks: 32, cpu_kv_bytes: 2097152}
server: {port: 9000}
"""


@pytest.mark.parametrize("flag", ["--num-gpu-blocks", "--num-gpu-blocks-override", "--num-blocks"])
def test_num_gpu_blocks_reaches_engine_config(flag):
    args = build_parser().parse_args(["generate", flag, "64", "hi"])
    assert engine_config(args).cache.num_blocks == 64


def test_cache_flags_override_yaml_only_when_given(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("model: {dtype: float32}\ncache: {num_blocks: 32, cpu_kv_bytes: 2097152}\n")
    absent = engine_config(build_parser().parse_args(["generate", "--config", str(path), "hi"]))
    assert absent.cache.num_blocks == 32 and absent.cache.cpu_kv_bytes == 2 << 20
    assert absent.cache.gpu_memory_utilization == EngineConfig().cache.gpu_memory_utilization
    args = build_parser().parse_args(
        [
            "generate",
            "--config",
            str(path),
            "--num-gpu-blocks",
            "64",
            "--cpu-kv-bytes",
            "4M",
            "--gpu-memory-utilization",
            "0.5",
            "--dtype",
            "auto",
            "hi",
        ]
    )
    given = engine_config(args)
    assert given.cache.num_blocks == 64 and given.cache.cpu_kv_bytes == 4 << 20
    assert given.cache.gpu_memory_utilization == 0.5
    # A flag given wins whatever its value, even the dataclass default over a YAML value.
    assert given.model.dtype == "auto"


def test_serve_cache_flags_over_one_yaml(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text(YAML)
    server, engine = configs_from_args(build_parser().parse_args(["serve", "--config", str(path)]))
    assert server.port == 9000 and engine.cache.num_blocks == 32
    args = build_parser().parse_args(["serve", "--config", str(path), "--num-gpu-blocks", "64"])
    server, engine = configs_from_args(args)
    assert server.port == 9000 and engine.cache.num_blocks == 64
    assert engine.model.dtype == "float32" and engine.cache.cpu_kv_bytes == 2 << 20


def test_drafter_commands_that_build_an_engine_take_cache_flags():
    for argv in (["drafter", "datagen"], ["drafter", "eval"], ["drafter", "doctor", "d"]):
        args = build_parser().parse_args([*argv, "--num-gpu-blocks", "64"])
        assert given(args, "cache") == {"num_blocks": 64}, argv


def test_doctor_live_measures_the_drafter_at_a_fixed_k(monkeypatch, capsys):
    """The adaptive controller speculates only where this machine's step costs say it pays, so
    `doctor --live` through it measured the machine; the doctor's engine verifies every step."""
    import types

    import outrider.speculative.eagle3_doctor as doctor

    built = {}

    def diagnose(drafter, model, *, llm_factory, **kw):
        llm_factory()
        return types.SimpleNamespace(ok=True)

    def llm(model, **kw):
        built.update(kw)

    monkeypatch.setattr(doctor, "diagnose", diagnose)
    monkeypatch.setitem(sys.modules, "outrider.llm", types.SimpleNamespace(LLM=llm))
    assert main(["drafter", "doctor", "d", "--live", "2"]) == 0
    assert built["speculative"] == {
        "method": "eagle3",
        "draft": "d",
        "num_draft_tokens": 4,
        "controller": "fixed",
    }


def test_bad_values_are_clear_errors(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--cpu-kv-bytes", "4X", "hi"])
    assert "invalid byte count '4X'" in capsys.readouterr().err
    assert main(["generate", "--num-gpu-blocks", "1", "hi"]) == 2
    assert "num_blocks=1" in capsys.readouterr().err


def test_command_modules_build_flags_from_one_module_and_never_import_each_other():
    """outrider/flags.py builds every command's flags; the command modules import it, never
    outrider.cli (which imports them: a cycle) nor each other."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "outrider"
    commands = {
        "outrider.cli": root / "cli.py",
        "outrider.server.cli": root / "server" / "cli.py",
        "outrider.train.cli": root / "train" / "cli.py",
        "outrider.bench.cli": root / "bench" / "cli.py",
    }

    def imported(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return names

    flags = imported(root / "flags.py")
    assert not flags & set(commands), flags & set(commands)
    for name, path in commands.items():
        if name == "outrider.cli":
            continue
        uses = imported(path)
        assert "outrider.flags" in uses, name
        assert not uses & set(commands), (name, uses & set(commands))
