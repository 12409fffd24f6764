"""`outrider deploy systemd`: the unit, env file, frozen config and notes it writes, and an
install into a scratch root with a stand-in systemctl."""

from __future__ import annotations

import hashlib
import os
import stat

from outrider.cli import main
from outrider.loaders.checkpoint import default_model_path
from outrider.server.config import load_yaml

YAML = """
server: {host: 0.0.0.0, port: 8080, api_key_file: /etc/outrider/key, shutdown_timeout: 20}
model: {dtype: float32}
speculative: {method: ngram, num_draft_tokens: 3}
"""


def _stub_systemctl(tmp_path):
    log = tmp_path / "systemctl.log"
    stub = tmp_path / "systemctl"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    return stub, log


def test_deploy_writes_unit_env_config_and_notes(tmp_path, capsys):
    config = tmp_path / "server.yaml"
    config.write_text(YAML)
    out = tmp_path / "out"
    rc = main(["deploy", "systemd", "--config", str(config), "--output", str(out), "--user", "llm"])
    assert rc == 0
    unit = (out / "outrider.service").read_text()
    for line in (
        "Type=notify",
        "Restart=on-failure",
        "WantedBy=multi-user.target",
        "User=llm",
        "EnvironmentFile=/etc/outrider/outrider.env",
        "LimitNOFILE=65536",
        "TimeoutStopSec=50",  # shutdown_timeout 20 + margin
        "WatchdogSec=120",
        "-m outrider serve --config /etc/outrider/server.yaml",
    ):
        assert line in unit, line
    assert "OUTRIDER_LOG_LEVEL=" in (out / "outrider.env").read_text()
    server, engine = load_yaml(out / "server.yaml")  # the frozen config loads back as is
    model = default_model_path().resolve()
    assert engine.model.model == str(model) and engine.model.dtype == "float32"
    assert server.port == 8080 and server.api_key_file == "/etc/outrider/key"
    notes = (out / "production.md").read_text()
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    assert digest in notes and str(model) in notes
    assert "method `ngram`, 3 draft tokens" in notes and "Roll back" in notes
    assert "`WatchdogSec=`" in notes and "503 `stalled`" in notes
    assert "wrote" in capsys.readouterr().out


def test_deploy_install_copies_backs_up_and_enables(tmp_path, capsys):
    config = tmp_path / "server.yaml"
    config.write_text(YAML)
    stub, log = _stub_systemctl(tmp_path)
    root = tmp_path / "root"
    args = ["deploy", "systemd", "--config", str(config), "--output", str(tmp_path / "out")]
    args += ["--install", "--root", str(root), "--systemctl", str(stub)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    unit = root / "etc/systemd/system/outrider.service"
    assert unit.is_file() and (root / "etc/outrider/server.yaml").is_file()
    assert (root / "etc/outrider/outrider.env").is_file()
    assert f"{stub} daemon-reload" in printed and f"{stub} enable outrider.service" in printed
    assert log.read_text().splitlines() == ["daemon-reload", "enable outrider.service"]
    # A second install keeps what it replaces, for rollback.
    assert main(args) == 0
    backups = [p for p in os.listdir(root / "etc/systemd/system") if ".bak-" in p]
    assert len(backups) == 1 and "cp " in capsys.readouterr().out


def test_deploy_refuses_a_missing_model(tmp_path, capsys):
    config = tmp_path / "server.yaml"
    config.write_text("model: {model: /nonexistent/m.gguf}\n")
    rc = main(["deploy", "systemd", "--config", str(config), "--output", str(tmp_path / "o")])
    assert rc == 2 and "/nonexistent/m.gguf" in capsys.readouterr().err


def test_generated_unit_passes_systemd_analyze_verify(tmp_path):
    """Debian's systemd checks the unit as systemd itself would load it."""
    import shutil
    import subprocess

    tool = shutil.which("systemd-analyze")
    assert tool, (
        "systemd-analyze is missing: install Debian's systemd package (apt-get install systemd)"
    )
    config = tmp_path / "server.yaml"
    config.write_text(YAML)
    out = tmp_path / "out"
    assert main(["deploy", "systemd", "--config", str(config), "--output", str(out)]) == 0
    proc = subprocess.run(
        [tool, "verify", str(out / "outrider.service")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # systemd only warns (exit 0) on an unknown key or a bad value: any remark about the unit
    # file itself is a failure ("outrider.service:9: Failed to parse service type, ignoring").
    assert "outrider.service:" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
