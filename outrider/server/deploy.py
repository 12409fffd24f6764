"""`outrider deploy systemd`: a systemd unit, its environment file, the frozen server config
and production notes, written to a directory; `--install` puts them in place.

    DIR/outrider.service   Type=notify (READY=1 after warm-up), WatchdogSec=, Restart=on-failure,
                           own User=
    DIR/outrider.env       OUTRIDER_* knobs (EnvironmentFile=); never the API key
    DIR/server.yaml        the frozen, resolved config the unit serves (model path absolute)
    DIR/production.md      model path and sha256, speculation, endpoints, how to roll back
    DIR/NAME.env           with --env-file: that file (e.g. `outrider bench comm`'s NCCL
                           settings), a second EnvironmentFile= read after outrider.env

Before writing anything it refuses what would keep the unit from starting: a --user that does
not exist, a model, drafter or api_key_file under /tmp or /var/tmp (PrivateTmp=true gives the
service its own, empty ones), an api_key_file the user cannot read. `--dry-run` prints the unit
and the install's steps and changes nothing.

Installing copies them to /etc/systemd/system and /etc/outrider (under --root for image
builds), keeps any file it replaces as NAME.bak-TIMESTAMP, and runs `systemctl daemon-reload`
and `systemctl enable`, printing each step. The service user must already exist.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from outrider.config import EngineConfig
from outrider.server.config import ServerConfig

UNIT_NAME = "outrider.service"
ETC = Path("/etc/outrider")
UNIT_DIR = Path("/etc/systemd/system")


@dataclass(frozen=True)
class DeployOptions:
    user: str = "outrider"
    python: str = sys.executable  # the interpreter (virtualenv) the unit runs
    limit_nofile: int = 65536
    # WatchdogSec=: systemd restarts the service this long after the last WATCHDOG=1, which
    # the server sends only while its engine thread beats within its stall limit.
    watchdog_sec: int = 120
    # An extra environment file the unit reads after outrider.env (later files win).
    env_file: Path | None = None


def read_env_file(path: Path) -> str:
    """The file's text once every line is blank, a # comment or KEY=VALUE (systemd's
    EnvironmentFile= syntax, as far as this checks); else a ValueError naming the line."""
    if not path.is_file():
        raise FileNotFoundError(
            f"--env-file {str(path)!r} not found: pass the file `outrider bench comm` wrote "
            "(its --env-out)"
        )
    text = path.read_text()
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, eq, _ = line.partition("=")
        if not eq or not key.strip().replace("_", "a").isalnum() or key.strip()[0].isdigit():
            raise ValueError(
                f"{path}:{n}: {line!r} is not KEY=VALUE: an environment file holds only "
                "KEY=VALUE lines and # comments"
            )
    return text


def env_file_name(opts: DeployOptions) -> str | None:
    """The extra environment file's name in the bundle and under /etc/outrider."""
    if opts.env_file is None:
        return None
    name = opts.env_file.name
    if name in (UNIT_NAME, "outrider.env", "server.yaml", "production.md"):
        raise ValueError(
            f"--env-file {str(opts.env_file)!r} has the name of a file the bundle writes: "
            "rename it (e.g. nccl.env)"
        )
    return name


def model_path(engine: EngineConfig) -> Path:
    if engine.model.model:
        return Path(engine.model.model).resolve()
    from outrider.loaders.checkpoint import default_model_path

    return default_model_path().resolve()


def drafter_path(engine: EngineConfig) -> Path | None:
    """The EAGLE-3 drafter the config names, absolute; None without one (a method without a
    drafter, or the one shipped for the default model, which travels with outrider)."""
    spec = engine.speculative
    if spec.method != "eagle3" or not spec.draft:
        return None
    return Path(spec.draft).resolve()


# PrivateTmp=true mounts a private, empty /tmp and /var/tmp for the service.
PRIVATE_TMP = (Path("/tmp"), Path("/var/tmp"))


def check_startable(
    server: ServerConfig, engine: EngineConfig, opts: DeployOptions, root: Path = Path("/")
) -> None:
    """Raise ValueError (FileNotFoundError for a missing file) for what would keep the unit
    from starting, naming the value and the fix. `root`: where --install puts the files, so
    the api_key_file is looked for there (image builds)."""
    try:
        user = pwd.getpwnam(opts.user)
    except KeyError:
        raise ValueError(
            f"--user {opts.user!r} does not exist on this machine: create it first (sudo "
            f"useradd --system --no-create-home {opts.user}) or pass an existing one"
        ) from None
    paths = {"model": model_path(engine)}
    if (draft := drafter_path(engine)) is not None:
        if not draft.exists():
            raise FileNotFoundError(
                f"drafter {str(draft)!r} not found: fix speculative.draft in the config"
            )
        paths["drafter"] = draft
    if server.api_key_file:
        paths["api_key_file"] = Path(server.api_key_file)
    for what, path in paths.items():
        under = next((t for t in PRIVATE_TMP if path.is_relative_to(t)), None)
        if under is not None:
            raise ValueError(
                f"{what} {str(path)!r} lies under {under}, which the unit's PrivateTmp=true "
                f"replaces with an empty private {under}: the service could not read it and "
                "would not start; move it (e.g. to /var/lib/outrider) and point the config there"
            )
    if server.api_key_file:
        key = root / Path(server.api_key_file).relative_to("/")
        if not key.is_file():
            raise FileNotFoundError(
                f"api_key_file {str(key)!r} not found: write the key there (readable by "
                f"{opts.user} only) before deploying, or drop server.api_key_file"
            )
        if not readable_by(key, user):
            raise ValueError(
                f"api_key_file {str(key)!r} is not readable by the service user {opts.user!r}: "
                f"sudo chown {opts.user} {key} && sudo chmod 600 {key}"
            )


def readable_by(path: Path, user: pwd.struct_passwd) -> bool:
    """Whether `user` may read `path` by its mode bits (root reads anything)."""
    import grp

    st = path.stat()
    if user.pw_uid == 0:
        return True
    if st.st_uid == user.pw_uid:
        return bool(st.st_mode & 0o400)
    groups = {user.pw_gid} | {g.gr_gid for g in grp.getgrall() if user.pw_name in g.gr_mem}
    if st.st_gid in groups:
        return bool(st.st_mode & 0o040)
    return bool(st.st_mode & 0o004)


def sha256_of(path: Path) -> dict[str, str]:
    """file name -> sha256 of the model file, or of each file of a model directory."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    out = {}
    for f in files:
        digest = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        out[f.name] = digest.hexdigest()
    return out


def frozen_yaml(server: ServerConfig, engine: EngineConfig, model: Path) -> str:
    """Every field spelled out, so the unit serves exactly this whatever defaults change."""
    engine = engine.replace(model={"model": str(model)})
    if (draft := drafter_path(engine)) is not None:
        engine = engine.replace(speculative={"draft": str(draft)})
    data = {"server": dataclasses.asdict(server), **dataclasses.asdict(engine)}
    data["server"]["cors_origins"] = list(server.cors_origins)
    return yaml.safe_dump(data, sort_keys=False)


def unit_text(server: ServerConfig, opts: DeployOptions, model: Path) -> str:
    stop_s = int(server.shutdown_timeout) + 30  # drain, then abort, then a margin
    extra = env_file_name(opts)
    extra_env = f"EnvironmentFile={ETC}/{extra}\n" if extra else ""
    return f"""\
# Written by `outrider deploy systemd`; regenerate rather than edit.
[Unit]
Description=outrider OpenAI-compatible LLM server ({model.name})
Documentation=file://{ETC}/production.md
After=network-online.target
Wants=network-online.target

[Service]
Type=notify
NotifyAccess=main
User={opts.user}
Group={opts.user}
EnvironmentFile={ETC}/outrider.env
{extra_env}ExecStart={opts.python} -m outrider serve --config {ETC}/server.yaml
Restart=on-failure
RestartSec=5
# Loading and warming the model happen before READY=1.
TimeoutStartSec=900
# SIGTERM drains for shutdown_timeout ({server.shutdown_timeout:g} s), then aborts the rest.
KillSignal=SIGTERM
TimeoutStopSec={stop_s}
# WATCHDOG=1 every WatchdogSec/2 while the engine thread beats within its stall limit (at least
# health_stall_s, {server.health_stall_s:g} s); a stuck engine stops the pings and is restarted.
WatchdogSec={opts.watchdog_sec}
LimitNOFILE={opts.limit_nofile}
NoNewPrivileges=true
PrivateTmp=true
ProtectSystem=full
# /var/cache/outrider, the service user's: the speculative step profile kept between starts.
CacheDirectory=outrider

[Install]
WantedBy=multi-user.target
"""


def env_text() -> str:
    return """\
# outrider's environment (EnvironmentFile= of outrider.service). The API key is not here:
# set server.api_key_file in server.yaml to a file readable only by the service user.
OUTRIDER_LOG_LEVEL=WARNING
# torch CPU threads; 0 keeps torch's choice.
OUTRIDER_NUM_THREADS=0
# The speculative step profile, measured at the first start and read at later ones (the unit's
# CacheDirectory); off measures it at every start.
OUTRIDER_STEP_PROFILES=/var/cache/outrider/step_profiles
"""


def production_md(
    server: ServerConfig,
    engine: EngineConfig,
    model: Path,
    digests: dict[str, str],
    opts: DeployOptions,
) -> str:
    from outrider.server.async_engine import STALL_FACTOR, STALL_WINDOW

    spec = engine.speculative
    spec_line = (
        f"method `{spec.method}`, {spec.num_draft_tokens} draft tokens per step"
        if spec.enabled
        else "off (plain decoding)"
    )
    hashes = "\n".join(f"- `{name}`: `{digest}`" for name, digest in digests.items())
    draft = drafter_path(engine)
    if draft is not None:
        draft_hashes = "\n".join(f"- `{n}`: `{d}`" for n, d in sha256_of(draft).items())
        drafter = f"- Drafter: `{draft}`\n{draft_hashes}\n"
        verify_draft = f" and `sha256sum {draft / '*' if draft.is_dir() else draft}`"
    elif spec.method == "eagle3":
        drafter = "- Drafter: the one shipped with outrider for the default model\n"
        verify_draft = ""
    else:
        drafter = verify_draft = ""
    auth = (
        f"API key from `{server.api_key_file}`"
        if server.api_key_file
        else "API key inline in server.yaml (prefer api_key_file)"
        if server.api_key
        else "**no API key**: anyone who reaches the port can use it"
    )
    return f"""\
# outrider in production

Generated by `outrider deploy systemd` on {time.strftime("%Y-%m-%d %H:%M:%S %Z")}.

## What runs

- Model: `{model}`
{hashes}
{drafter}- dtype `{engine.model.dtype}`, device `{engine.model.device}`, max_model_len
  `{engine.model.max_model_len or "from the checkpoint"}`
- Speculative decoding: {spec_line}
- KV cache: block size {engine.cache.block_size}, CPU budget {engine.cache.cpu_kv_bytes} bytes,
  GPU memory utilization {engine.cache.gpu_memory_utilization},
  num_blocks {engine.cache.num_blocks or "from the budget"}
- Scheduler: max_num_seqs {engine.scheduler.max_num_seqs}, max_num_batched_tokens
  {engine.scheduler.max_num_batched_tokens}
- Listening on `{server.host}:{server.port}`, {auth}
- Shutdown: SIGTERM stops admission (503), drains up to {server.shutdown_timeout:g} s, aborts
  the rest and exits 0.
- Liveness: the engine thread beats at every loop turn and before every decoder layer. It is
  stalled when it has not beaten for its stall limit: {server.health_stall_s:g} s
  (`health_stall_s`), or {STALL_FACTOR}x the longest gap between beats in its last
  {STALL_WINDOW} steps if that is more. Then `/health` answers 503 `stalled` and the
  `WATCHDOG=1` pings stop, so systemd restarts the service within {opts.watchdog_sec} s
  (`WatchdogSec=`). A slow step whose layers keep beating is not a stall.

The complete configuration is `{ETC}/server.yaml`; the unit is `{UNIT_DIR / UNIT_NAME}`.

## Operate

    systemctl status outrider
    journalctl -u outrider -f
    curl -s http://{server.host}:{server.port}/health      # 200 while the engine makes progress
    curl -s -H "Authorization: Bearer $KEY" http://{server.host}:{server.port}/metrics

Verify the model has not changed: `sha256sum {model}`{verify_draft} against the hashes
above.

## Roll back

Every install keeps the files it replaced as `NAME.bak-TIMESTAMP` beside them. To go back:

    sudo systemctl stop outrider
    sudo cp {ETC}/server.yaml.bak-TIMESTAMP {ETC}/server.yaml      # and outrider.env
    sudo cp {UNIT_DIR / UNIT_NAME}.bak-TIMESTAMP {UNIT_DIR / UNIT_NAME}
    sudo systemctl daemon-reload && sudo systemctl start outrider

A model rollback is a server.yaml rollback: the old file names the old model path (keep
that file on disk until the new model has proven itself).
"""


def bundle_texts(server: ServerConfig, engine: EngineConfig, opts: DeployOptions) -> dict[str, str]:
    """The bundle's files, name -> text, written nowhere."""
    model = model_path(engine)
    if not model.exists():
        raise FileNotFoundError(f"model {str(model)!r} not found: fix model.model in the config")
    files = {
        UNIT_NAME: unit_text(server, opts, model),
        "outrider.env": env_text(),
        "server.yaml": frozen_yaml(server, engine, model),
        "production.md": production_md(server, engine, model, sha256_of(model), opts),
    }
    if opts.env_file is not None:
        files[env_file_name(opts)] = read_env_file(opts.env_file)
    return files


def write_bundle(
    server: ServerConfig, engine: EngineConfig, output: Path, opts: DeployOptions
) -> dict[str, Path]:
    """Write the bundle's files into `output`; returns name -> path."""
    files = bundle_texts(server, engine, opts)
    output.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, text in files.items():
        paths[name] = output / name
        paths[name].write_text(text)
    return paths


def install_targets(names, root: Path = Path("/")) -> dict[str, Path]:
    """Bundle file name -> where --install puts it under `root`."""
    targets = {UNIT_NAME: UNIT_DIR / UNIT_NAME}
    for name in names:
        if name != UNIT_NAME:
            targets[name] = ETC / name  # outrider.env, server.yaml, production.md, --env-file
    return {name: root / target.relative_to("/") for name, target in targets.items()}


def dry_run(
    files: dict[str, str],
    output: Path,
    install: bool,
    root: Path = Path("/"),
    systemctl: str = "systemctl",
) -> str:
    """What `deploy` would do with `files`, as text: the unit, then each step as a shell
    command would read (nothing is written or run)."""
    lines = [f"# {UNIT_NAME} (dry run: nothing written, nothing run)", files[UNIT_NAME]]
    lines += [f"would write {output / name}" for name in files]
    if install:
        for name, dest in install_targets(files, root).items():
            if dest.exists():
                lines.append(f"would keep {dest} as {dest.name}.bak-TIMESTAMP")
            lines.append(f"would cp {output / name} {dest}")
        lines += [
            f"would run {systemctl} daemon-reload",
            f"would run {systemctl} enable {UNIT_NAME}",
        ]
    return "\n".join(lines)


def install(
    bundle: dict[str, Path],
    root: Path = Path("/"),
    systemctl: str = "systemctl",
    run: Callable[[list[str]], object] = lambda cmd: subprocess.run(cmd, check=True),
    say: Callable[[str], None] = print,
) -> None:
    """Copy the bundle into place under `root`, keeping replaced files, then reload and enable
    the unit. Each action is printed as a shell command would read."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name, dest in install_targets(bundle, root).items():
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            backup = dest.with_name(f"{dest.name}.bak-{stamp}")
            shutil.copy2(dest, backup)
            say(f"cp {dest} {backup}")
        shutil.copy2(bundle[name], dest)
        say(f"cp {bundle[name]} {dest}")
    for cmd in ([systemctl, "daemon-reload"], [systemctl, "enable", UNIT_NAME]):
        say(" ".join(cmd))
        run(cmd)
