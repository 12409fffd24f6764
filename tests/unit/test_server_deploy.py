"""`outrider deploy systemd`: the unit, env file, frozen config and notes it writes, and an
install into a scratch root with a stand-in systemctl."""

from __future__ import annotations

import hashlib
import os
import pwd
import stat

import pytest

from outrider.cli import main
from outrider.loaders.checkpoint import default_model_path
from outrider.server import deploy
from outrider.server.config import load_yaml

YAML = """
server: {host: 0.0.0.0, port: 8080, api_key_file: /etc/outrider/key, shutdown_timeout: 20}
model: {dtype: float32}
speculative: {method: ngram, num_draft_tokens: 3}
"""


ME = pwd.getpwuid(os.getuid()).pw_name  # a user that exists, to run the service as
REAL_PRIVATE_TMP = deploy.PRIVATE_TMP


@pytest.fixture(autouse=True)
def private_tmp(tmp_path, monkeypatch):
    """The unit's private /tmp stands at the test's own tmp_path: the repository, and the
    embedded model in its .venv, may themselves lie under /tmp (a clone there)."""
    monkeypatch.setattr(deploy, "PRIVATE_TMP", (tmp_path,))


def test_the_private_tmp_dirs_are_systemds():
    assert tuple(map(str, REAL_PRIVATE_TMP)) == ("/tmp", "/var/tmp")


def _deployable(tmp_path, yaml: str = YAML) -> list[str]:
    """`deploy systemd` arguments for a config whose api_key_file exists, under a scratch
    --root, readable by the service user."""
    config = tmp_path / "server.yaml"
    config.write_text(yaml)
    key = tmp_path / "root/etc/outrider/key"
    key.parent.mkdir(parents=True, exist_ok=True)
    key.write_text("sk-test\n")
    key.chmod(0o600)
    root = str(tmp_path / "root")
    return ["deploy", "systemd", "--config", str(config), "--user", ME, "--root", root]


def _stub_systemctl(tmp_path):
    log = tmp_path / "systemctl.log"
    stub = tmp_path / "systemctl"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    return stub, log


def test_deploy_writes_unit_env_config_and_notes(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(_deployable(tmp_path) + ["--output", str(out)])
    assert rc == 0
    unit = (out / "outrider.service").read_text()
    for line in (
        "Type=notify",
        "Restart=on-failure",
        "WantedBy=multi-user.target",
        f"User={ME}",
        "EnvironmentFile=/etc/outrider/outrider.env",
        "LimitNOFILE=65536",
        "TimeoutStopSec=50",  # shutdown_timeout 20 + margin
        "WatchdogSec=120",
        "-m outrider serve --config /etc/outrider/server.yaml",
        "CacheDirectory=outrider",  # where the step profile is kept between starts
    ):
        assert line in unit, line
    env = (out / "outrider.env").read_text()
    assert "OUTRIDER_LOG_LEVEL=" in env
    assert "OUTRIDER_STEP_PROFILES=/var/cache/outrider/" in env
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
    stub, log = _stub_systemctl(tmp_path)
    root = tmp_path / "root"
    args = _deployable(tmp_path) + ["--output", str(tmp_path / "out")]
    args += ["--install", "--systemctl", str(stub)]
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
    args = _deployable(tmp_path, "model: {model: /nonexistent/m.gguf}\n")
    rc = main(args + ["--output", str(tmp_path / "o")])
    assert rc == 2 and "/nonexistent/m.gguf" in capsys.readouterr().err


def test_generated_unit_passes_systemd_analyze_verify(tmp_path):
    """Debian's systemd checks the unit as systemd itself would load it."""
    import shutil
    import subprocess

    tool = shutil.which("systemd-analyze")
    assert tool, (
        "systemd-analyze is missing: install Debian's systemd package (apt-get install systemd)"
    )
    out = tmp_path / "out"
    assert main(_deployable(tmp_path) + ["--output", str(out)]) == 0
    proc = subprocess.run(
        [tool, "verify", str(out / "outrider.service")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # systemd only warns (exit 0) on an unknown key or a bad value: any remark about the unit
    # file itself is a failure ("outrider.service:9: Failed to parse service type, ignoring").
    assert "outrider.service:" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_dry_run_prints_the_unit_and_the_steps_and_changes_nothing(tmp_path, capsys):
    stub, log = _stub_systemctl(tmp_path)
    out = tmp_path / "out"
    args = _deployable(tmp_path) + ["--output", str(out), "--install", "--systemctl", str(stub)]
    assert main(args + ["--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "Type=notify" in printed and f"User={ME}" in printed
    assert f"would write {out / 'server.yaml'}" in printed
    unit = tmp_path / "root/etc/systemd/system/outrider.service"
    assert f"would cp {out / 'outrider.service'} {unit}" in printed
    assert f"would run {stub} daemon-reload" in printed
    assert not out.exists() and not unit.exists() and not log.exists()


def test_a_wrong_flag_shows_deploys_usage(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(_deployable(tmp_path) + ["--output", str(tmp_path / "o"), "--dry-rnu"])
    err = capsys.readouterr().err
    assert "usage: outrider deploy" in err and "--dry-rnu" in err


def test_refuses_a_model_or_drafter_under_private_tmp(tmp_path, capsys):
    model = tmp_path / "m.gguf"  # pytest's tmp_path lies under /tmp
    assert str(model.resolve()).startswith(("/tmp/", "/var/tmp/")), "tmp_path is not in /tmp"
    model.write_bytes(b"GGUF")
    args = _deployable(tmp_path, f"model: {{model: {model}}}\n")
    assert main(args + ["--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(model.resolve()) in err and "PrivateTmp=true" in err
    draft = tmp_path / "drafter"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    args = _deployable(tmp_path, f"speculative: {{method: eagle3, draft: {draft}}}\n")
    assert main(args + ["--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "drafter" in err and str(draft.resolve()) in err and "PrivateTmp=true" in err
    assert not (tmp_path / "o").exists()


def test_refuses_a_user_that_does_not_exist(tmp_path, capsys):
    args = _deployable(tmp_path) + ["--output", str(tmp_path / "o"), "--user", "no-such-usr-x"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "'no-such-usr-x' does not exist" in err and "useradd" in err
    assert not (tmp_path / "o").exists()


def test_refuses_an_api_key_file_missing_or_unreadable(tmp_path, capsys):
    args = _deployable(tmp_path) + ["--output", str(tmp_path / "o")]
    key = tmp_path / "root/etc/outrider/key"
    key.chmod(0o000)
    if os.getuid() != 0:  # root reads anything: only the mode check is skipped
        assert main(args) == 2
        assert "not readable by the service user" in capsys.readouterr().err
    key.unlink()
    assert main(args) == 2
    assert f"api_key_file {str(key)!r} not found" in capsys.readouterr().err


def test_production_notes_record_the_drafter_and_its_sha256(tmp_path):
    from pathlib import Path

    import outrider
    from outrider.server.deploy import drafter_path

    draft = Path(outrider.__file__).parent / "data/smollm2-135m-eagle3"  # outside /tmp
    out = tmp_path / "out"
    yaml = YAML.replace(
        "{method: ngram, num_draft_tokens: 3}", f"{{method: eagle3, draft: {draft}}}"
    )
    assert main(_deployable(tmp_path, yaml) + ["--output", str(out)]) == 0
    notes = (out / "production.md").read_text()
    some = sorted(p for p in draft.iterdir() if p.is_file())[0]
    assert f"Drafter: `{draft.resolve()}`" in notes
    assert hashlib.sha256(some.read_bytes()).hexdigest() in notes
    _, engine = load_yaml(out / "server.yaml")
    assert drafter_path(engine) == draft.resolve()


def test_the_example_server_yaml_loads():
    from pathlib import Path

    server, engine = load_yaml(Path(__file__).parents[2] / "docs/examples/server.yaml")
    assert server.api_key_file and engine.speculative.method
