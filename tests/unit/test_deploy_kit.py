"""The deployment kit in deploy/: every file parses, and every ``p2ptrain`` command in it is one the CLI
takes.

A kit file is only ever exercised on a provider's host, weeks after it was written; a renamed flag would
first show up there as a crash loop. So this test reads each file the way its tool would (Dockerfile
instructions with continuations, compose and Kubernetes YAML, a systemd unit with repeated keys, shell
scripts inside them, the README's bash blocks), expands the placeholders the way the tool would (compose's
``${VAR:-default}``, Kubernetes' ``$(VAR)``, systemd's ``$VAR``, the shell's ``"$@"``) with plausible
values, a freshly generated peer id among them, and hands every command line to the real argument parser.
Then it checks what the files must agree on: ports, the health endpoint, the run file each one ships,
the grace period against the node's drain time, and that no private key is written into any of them.
No network, no docker: only parsing (and one ``sh`` run of the Kubernetes entry script with a stub
``p2ptrain``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from p2ptrain.cli import build_parser
from p2ptrain.config import load_config, parse_config
from p2ptrain.identity import Identity
from p2ptrain.net.address import PeerAddress

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "deploy"
PEER_PORT = 31337
METRICS_PORT = 9100
HEALTH_URL = f"http://127.0.0.1:{METRICS_PORT}/healthz"
DEFAULT_RUN_FILE = ROOT / "configs" / "tiny-gpt.toml"
# A real peer id, as `p2ptrain keygen` would print it, for every ${BOOTSTRAP_PEER_ID}-like placeholder.
PEER_ID = str(Identity.generate().peer_id)
KIT_FILES = ("Containerfile", "compose.yaml", "p2ptrain.service", "k8s.yaml", "README.md")


@dataclass(frozen=True)
class Command:
    """One ``p2ptrain`` command line found in a kit file: ``argv`` is what follows ``p2ptrain``."""

    where: str
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: p2ptrain {shlex.join(self.argv)}"


# ---- placeholders --------------------------------------------------------------------------------------

_BRACED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
_K8S_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_PLAIN = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


def expand(text: str, env: Mapping[str, str], where: str) -> str:
    """Expand ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?message}``, ``$VAR`` and
    Kubernetes' ``$(VAR)`` (only for names in ``env``: anything else in ``$(...)`` is a shell command
    substitution). An unknown variable without a default fails the test: the kit would start with a
    blank there."""

    def braced(m: re.Match[str]) -> str:
        name, op, word = m.group(1), m.group(2), m.group(3)
        value = env.get(name)
        if op in (":-", "-") and (value is None or (op == ":-" and not value)):
            return word
        if value is None:
            pytest.fail(f"{where}: ${{{name}}} has no value and no default: {text.strip()!r}")
        return value

    def plain(m: re.Match[str]) -> str:
        if m.group(1) not in env:
            pytest.fail(f"{where}: ${m.group(1)} has no value: {text.strip()!r}")
        return env[m.group(1)]

    text = _K8S_REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)
    return _PLAIN.sub(plain, _BRACED.sub(braced, text))


# ---- shell: p2ptrain commands in scripts, comments and the README -------------------------------------

_SEPARATORS = {";", ";;", "&", "&&", "|", "||", "(", ")", "\n"}
_PREFIXES = {"exec", "if", "then", "else", "elif", "do", "while", "until", "!", "{", "time", "nohup"}
_IMAGE = re.compile(r"p2ptrain-node(:[\w.-]+)?")


def shell_commands(
    script: str, env: Mapping[str, str], where: str, positional: Sequence[str] = ()
) -> list[Command]:
    """Every ``p2ptrain`` invocation in a shell script: in command position (after ``exec``, ``sudo``,
    ``if`` ...), inside ``$(...)``, or as a container's command (``docker run ... p2ptrain-node ARGS``,
    ``docker compose run ... --entrypoint p2ptrain SERVICE ARGS``). ``"$@"`` is ``positional``."""
    script = re.sub(r"\\\n", " ", script)
    found: list[Command] = []
    for line in script.splitlines():
        found += _line_commands(line, env, where, positional)
    return found


def _line_commands(line: str, env: Mapping[str, str], where: str, positional: Sequence[str]) -> list[Command]:
    line = line.replace('"$@"', shlex.join(positional)).replace("$@", shlex.join(positional))
    line = expand(line, env, where)
    found: list[Command] = []

    def substitution(m: re.Match[str]) -> str:
        found.extend(_line_commands(m.group(1), env, where, positional))
        return "SUBSTITUTED"

    while True:  # innermost first, so $( ... $( ... ) ... ) works too
        line, n = re.subn(r"\$\(([^()]*)\)", substitution, line)
        if not n:
            break
    for words in _segments(line):
        argv = _p2ptrain_argv(words)
        if argv is not None:
            found.append(Command(where, tuple(argv)))
    return found


def _segments(line: str) -> Iterator[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    words: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok in _SEPARATORS:
            yield words
            words = []
        elif set(tok) <= set("<>&|") and ("<" in tok or ">" in tok):  # a redirection: drop it
            if words and words[-1].isdigit():
                words.pop()
            i += 1  # and its target
        else:
            words.append(tok)
        i += 1
    yield words


def _p2ptrain_argv(words: list[str]) -> list[str] | None:
    while words and (words[0] in _PREFIXES or re.fullmatch(r"[A-Za-z_]\w*=.*", words[0])):
        words = words[1:]
    if words and words[0] == "sudo":
        words = words[1:]
        while words and words[0].startswith("-"):
            words = words[2:] if words[0] in ("-u", "-g") else words[1:]
    if not words:
        return None
    if PurePosixPath(words[0]).name == "p2ptrain":
        return words[1:]
    if words[0] in ("docker", "podman") and "run" in words[1:3]:
        return _container_argv(words)
    return None


def _container_argv(words: list[str]) -> list[str] | None:
    """``docker [compose] run``: the p2ptrain arguments it gives the container, if it runs p2ptrain."""
    if "--entrypoint" in words:
        i = words.index("--entrypoint")
        if PurePosixPath(words[i + 1]).name != "p2ptrain":
            return None
        j = i + 2
        while j < len(words) and words[j].startswith("-"):  # value-less flags (-T, --rm) may follow
            j += 1
        return words[j + 1 :]  # after the service or image name
    images = [k for k, w in enumerate(words) if _IMAGE.fullmatch(w)]
    if not images:
        return None
    entrypoint, cmd = containerfile_entrypoint()
    rest = words[images[0] + 1 :]
    return entrypoint[1:] + (rest or cmd)  # arguments after the image replace CMD


def comment_scripts(text: str) -> str:
    """Shell lines in ``#`` comments: the indented ones (``#   cmd``), continuation lines included."""
    return "\n".join(m.group(1) for m in re.finditer(r"(?m)^#\s{3,}(.*)$", text))


# ---- parsing the CLI -----------------------------------------------------------------------------------


def parse(cmd: Command) -> Any:
    """The namespace argparse makes of ``cmd``; a refused command fails the test naming file and line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return build_parser().parse_args(list(cmd.argv))
    except SystemExit:
        pass  # argparse has printed why; fail outside the handler, without its traceback
    pytest.fail(f"the CLI refuses {cmd}\n{err.getvalue().strip()}")


def check_node(cmd: Command) -> Any:
    """A long-lived node: the flags every kit promises, with the ports every kit agrees on."""
    args = parse(cmd)
    assert args.command == "node", cmd
    assert args.config, f"{cmd}: no --config (it would train the built-in run, or nothing)"
    assert args.data_dir, f"{cmd}: no --data-dir (its key and checkpoints would land in $HOME)"
    assert args.metrics_port == METRICS_PORT, f"{cmd}: --metrics-port is not {METRICS_PORT}"
    assert args.log_format == "json", f"{cmd}: --log-format json is for log collectors"
    assert args.resume, f"{cmd}: without --resume a restarted node starts over"
    assert args.no_live, cmd
    for listen in args.listen or [f"0.0.0.0:{PEER_PORT}"]:
        assert listen.rpartition(":")[2] == str(PEER_PORT), f"{cmd}: --listen {listen}"
    if args.announce:
        assert args.announce.rpartition(":")[2] == str(PEER_PORT), f"{cmd}: --announce {args.announce}"
    for join in args.join or []:
        try:
            addr = PeerAddress.parse(join)
        except ValueError as e:
            pytest.fail(f"{cmd}: --join {join}: {e}")
        assert addr.port == PEER_PORT, cmd
        assert addr.peer_id is not None, f"{cmd}: --join {join} without a peer id is not verified"
    return args


# ---- the files -----------------------------------------------------------------------------------------


def kit_text(name: str) -> str:
    return (KIT / name).read_text()


@functools.cache
def containerfile() -> tuple[tuple[str, str], ...]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped (also inside continuations)."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in kit_text("Containerfile").splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        word, _, rest = pending.partition(" ")
        assert re.fullmatch(r"[A-Za-z]+", word), f"deploy/Containerfile: not an instruction: {pending!r}"
        out.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, "deploy/Containerfile ends inside a continuation"
    return tuple(out)


def instructions(name: str) -> list[str]:
    return [rest for word, rest in containerfile() if word == name]


def json_form(text: str, what: str) -> list[str]:
    """The exec (JSON array) form; the shell form would put sh between the runtime and the signal."""
    assert text.startswith("["), f"deploy/Containerfile: {what} must use the JSON form: {text}"
    value = json.loads(text)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), what
    return value


@functools.cache
def _containerfile_entrypoint() -> tuple[tuple[str, ...], tuple[str, ...]]:
    (entrypoint,) = instructions("ENTRYPOINT")
    (cmd,) = instructions("CMD")
    return tuple(json_form(entrypoint, "ENTRYPOINT")), tuple(json_form(cmd, "CMD"))


def containerfile_entrypoint() -> tuple[list[str], list[str]]:
    entrypoint, cmd = _containerfile_entrypoint()
    return list(entrypoint), list(cmd)


def compose() -> dict[str, Any]:
    data = yaml.safe_load(kit_text("compose.yaml"))
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), "deploy/compose.yaml"
    return data


def env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (compose .env and systemd EnvironmentFile syntax, without quotes)."""
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Za-z_]\w*", key.strip()), f"{path.name}: bad line {line!r}"
            env[key.strip()] = value.strip()
    return env


def k8s() -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(kit_text("k8s.yaml")) if d is not None]
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= d.keys(), f"deploy/k8s.yaml: {d.get('kind')}"
    return docs


def k8s_one(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in k8s() if d["kind"] == kind]
    return doc


def systemd_unit() -> dict[str, list[tuple[str, str]]]:
    """Sections of (key, value), keys repeatable as systemd allows; continuation lines joined."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for raw in kit_text("p2ptrain.service").splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if m := re.fullmatch(r"\[([A-Za-z]+)\]", line):
            current = sections.setdefault(m.group(1), [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"deploy/p2ptrain.service: not a key=value line: {line!r}"
        current.append((key.strip(), value.strip()))
    return sections


def unit_values(section: str, key: str) -> list[str]:
    return [v for k, v in systemd_unit().get(section, []) if k == key]


def seconds(text: str | int) -> float:
    """A duration in compose's (``90s``, ``1m30s``) or systemd's (``90``, ``15min``) spelling."""
    if isinstance(text, int):
        return float(text)
    units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text)
    assert parts and "".join(n + u for n, u in parts) == text.replace(" ", ""), text
    return sum(float(n) * units[u or "s"] for n, u in parts)


def drain_seconds() -> float:
    """How long a draining node may take: the node allows averaging.timeout + 30 s (cli.train)."""
    return max(60.0, load_config(DEFAULT_RUN_FILE).averaging.timeout + 30.0)


def install_sources(text: str) -> dict[str, str]:
    """``install [-opts] SRC DEST`` lines (in comments or bash blocks): DEST -> SRC."""
    pattern = r"\binstall\s+(?:-[mgo]\s+\S+\s+|-\S+\s+)*(\S+)\s+(/\S+)"
    return {m.group(2): m.group(1) for m in re.finditer(pattern, text)}


# ---- collecting the commands of each file ---------------------------------------------------------------


def containerfile_commands() -> list[Command]:
    entrypoint, cmd = containerfile_entrypoint()
    assert entrypoint[:2] == ["p2ptrain", "node"], f"deploy/Containerfile: ENTRYPOINT {entrypoint}"
    found = [Command("deploy/Containerfile: ENTRYPOINT + CMD", tuple(entrypoint[1:] + cmd))]
    found += shell_commands(comment_scripts(kit_text("Containerfile")), {}, "deploy/Containerfile: comment")
    return found


def compose_envs() -> dict[str, dict[str, str]]:
    """The two environments compose may see: the defaults alone, and .env.example's values."""
    example = env_file(KIT / ".env.example")
    return {
        "defaults": {"BOOTSTRAP_PEER_ID": PEER_ID},
        ".env.example": {**example, "BOOTSTRAP_PEER_ID": PEER_ID},
    }


def compose_service_commands(env_name: str) -> dict[str, Command]:
    env = compose_envs()[env_name]
    entrypoint, cmd = containerfile_entrypoint()
    out = {}
    for name, svc in compose()["services"].items():
        where = f"deploy/compose.yaml ({env_name}): services.{name}"
        ep = svc.get("entrypoint")
        ep = entrypoint if ep is None else (shlex.split(ep) if isinstance(ep, str) else list(ep))
        args = svc.get("command", cmd)
        args = shlex.split(args) if isinstance(args, str) else list(args)
        argv = [expand(str(a), env, where) for a in ep + args]
        if PurePosixPath(argv[0]).name == "p2ptrain":
            out[name] = Command(where, tuple(argv[1:]))
    return out


def compose_commands() -> list[Command]:
    found = [c for env in compose_envs() for c in compose_service_commands(env).values()]
    env = compose_envs()[".env.example"]
    found += shell_commands(comment_scripts(kit_text("compose.yaml")), env, "deploy/compose.yaml: comment")
    return found


def systemd_envs() -> dict[str, dict[str, str]]:
    """The unit's Environment= defaults overridden by the shipped EnvironmentFile (as systemd does), as
    shipped (a bootstrap node) and with the joiner's example line from its comments."""
    defaults: dict[str, str] = {}
    for value in unit_values("Service", "Environment"):
        for item in shlex.split(value):
            key, _, val = item.partition("=")
            defaults[key] = val
    (env_path,) = unit_values("Service", "EnvironmentFile")
    src = install_sources(kit_text("p2ptrain.service")).get(env_path.lstrip("-"))
    assert src, f"deploy/p2ptrain.service: no install line puts the EnvironmentFile at {env_path}"
    shipped = env_file(ROOT / src)
    m = re.search(r"(?m)^#\s*(P2PTRAIN_JOIN=.+)$", (ROOT / src).read_text())
    assert m, f"{src}: no example P2PTRAIN_JOIN line for joiners"
    joiner = env_file_line(m.group(1).replace("<PEERID>", PEER_ID))
    return {"bootstrap": {**defaults, **shipped}, "joiner": {**defaults, **shipped, **joiner}}


def env_file_line(line: str) -> dict[str, str]:
    key, _, value = line.partition("=")
    return {key: value}


def systemd_commands_by_env() -> dict[str, list[Command]]:
    out: dict[str, list[Command]] = {}
    for env_name, env in systemd_envs().items():
        cmds = []
        for key in ("ExecStartPre", "ExecStart", "ExecStartPost", "ExecReload", "ExecStop"):
            for value in unit_values("Service", key):
                where = f"deploy/p2ptrain.service ({env_name}): {key}"
                words = shlex.split(expand(value, env, where))
                exe = words[0].lstrip("-+@:!|")
                if PurePosixPath(exe).name == "p2ptrain":
                    assert exe == "/usr/local/bin/p2ptrain", f"{where}: systemd wants an absolute path"
                    cmds.append(Command(where, tuple(words[1:])))
        out[env_name] = cmds
    return out


def systemd_commands() -> list[Command]:
    found = [c for cmds in systemd_commands_by_env().values() for c in cmds]
    found += shell_commands(comment_scripts(kit_text("p2ptrain.service")), {}, "deploy/p2ptrain.service")
    return found


def k8s_containers() -> list[tuple[str, dict[str, Any]]]:
    spec = k8s_one("StatefulSet")["spec"]["template"]["spec"]
    return [(kind, c) for kind in ("initContainers", "containers") for c in spec.get(kind, [])]


def k8s_env(container: Mapping[str, Any], pod: int) -> dict[str, str]:
    """What Kubernetes puts in the container's environment for pod ``pod``."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
        elif "fieldRef" in var.get("valueFrom", {}):
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", var
            env[var["name"]] = f"{k8s_one('StatefulSet')['metadata']['name']}-{pod}"
        elif "secretKeyRef" in var.get("valueFrom", {}):
            assert var["valueFrom"]["secretKeyRef"]["key"] == "peer-id", var
            env[var["name"]] = PEER_ID
    return env


def k8s_container_commands(kind: str, container: Mapping[str, Any], pod: int = 1) -> list[Command]:
    """Kubernetes expands $(VAR) in command and args; then a shell (if any) runs its script with $0
    and "$@" from the words after it; without a command, the image's ENTRYPOINT runs with args."""
    where = f"deploy/k8s.yaml: {kind}[{container['name']}]"
    env = k8s_env(container, pod)
    command = [expand(str(w), env, where) for w in container.get("command", [])]
    args = [expand(str(w), env, where) for w in container.get("args", [])]
    if not command:
        entrypoint, cmd = containerfile_entrypoint()
        return [Command(where, tuple(entrypoint[1:] + (args or cmd)))]
    full = command + args
    if PurePosixPath(full[0]).name in ("sh", "bash", "dash") and "-c" in full:
        i = full.index("-c")
        script, rest = full[i + 1], full[i + 2 :]
        return shell_commands(script, env, where, positional=rest[1:])
    if PurePosixPath(full[0]).name == "p2ptrain":
        return [Command(where, tuple(full[1:]))]
    return []


def k8s_commands() -> list[Command]:
    found = [cmd for kind, c in k8s_containers() for cmd in k8s_container_commands(kind, c)]
    found += shell_commands(comment_scripts(kit_text("k8s.yaml")), {}, "deploy/k8s.yaml: comment")
    return found


def readme_commands() -> list[Command]:
    blocks = re.findall(r"(?ms)^```(?:bash|sh|shell)\n(.*?)^```", kit_text("README.md"))
    assert len(blocks) >= 4, "deploy/README.md: fewer bash blocks than kits"
    return [c for block in blocks for c in shell_commands(block, {}, "deploy/README.md")]


COLLECTORS: dict[str, tuple[Callable[[], list[Command]], int]] = {
    # file: (its commands, the fewest it must have, so that no check below passes vacuously)
    "Containerfile": (containerfile_commands, 2),
    "compose.yaml": (compose_commands, 7),
    "p2ptrain.service": (systemd_commands, 2),
    "k8s.yaml": (k8s_commands, 5),
    "README.md": (readme_commands, 7),
}


# ---- tests ---------------------------------------------------------------------------------------------


def test_kit_files_exist_and_parse() -> None:
    for name in KIT_FILES:
        assert (KIT / name).is_file(), f"deploy/{name} is missing"
    assert len(containerfile()) >= 10
    assert len(compose()["services"]) == 3
    assert [d["kind"] for d in k8s()].count("StatefulSet") == 1
    assert {"Unit", "Service", "Install"} <= systemd_unit().keys()


@pytest.mark.parametrize("name", list(COLLECTORS))
def test_every_p2ptrain_command_is_accepted_by_the_cli(name: str) -> None:
    collect, at_least = COLLECTORS[name]
    commands = collect()
    assert len(commands) >= at_least, f"deploy/{name}: {len(commands)} p2ptrain commands found" + "".join(
        f"\n  {c}" for c in commands
    )
    nodes = 0
    for cmd in commands:
        args = parse(cmd)
        if args.command == "node":
            check_node(cmd)
            nodes += 1
        if getattr(args, "address", None):  # ping, peers
            try:
                PeerAddress.parse(args.address)
            except ValueError as e:
                pytest.fail(f"{cmd}: {e}")
    assert nodes >= 1, f"deploy/{name}: no `p2ptrain node` command"


def test_containerfile() -> None:
    (base,) = instructions("FROM")
    image = expand(base, _containerfile_args(), "deploy/Containerfile: FROM")
    assert re.match(r"(nvidia/cuda:[\w.-]*runtime|pytorch/pytorch:[\w.-]*runtime)", image), image
    run = "\n".join(instructions("RUN"))
    torch_at, project_at = run.find("torch"), run.find("pip install /src")
    assert 0 <= torch_at < project_at, "torch (CUDA wheels) goes in before the project"
    assert "download.pytorch.org/whl/cu" in json.dumps(_containerfile_args()), "a CUDA build of torch"
    users = instructions("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the node must not run as root"
    assert [w for w, _ in containerfile()].index("USER") < [w for w, _ in containerfile()].index("ENTRYPOINT")
    assert any("/data" in v for v in instructions("VOLUME")), "data and keys on a volume"
    assert set(" ".join(instructions("EXPOSE")).split()) == {f"{PEER_PORT}/tcp", f"{METRICS_PORT}/tcp"}
    assert instructions("STOPSIGNAL") == ["SIGTERM"]
    (health,) = instructions("HEALTHCHECK")
    options, _, check = health.partition("CMD ")
    assert HEALTH_URL in check and "urllib" in check, f"HEALTHCHECK {health}"
    assert json_form(check.strip(), "HEALTHCHECK CMD")[0].startswith("python")
    assert re.search(r"--start-period=\d+", options), "a slow start (state download) is not unhealthy"
    args = check_node(containerfile_commands()[0])
    assert args.data_dir == "/data" and args.config == "/config/run.toml"
    assert "--join" not in containerfile_entrypoint()[1], "the image's defaults make a bootstrap node"


def _containerfile_args() -> dict[str, str]:
    return {k: v for k, _, v in (a.partition("=") for a in instructions("ARG"))}


def copied_into_image() -> dict[str, Path]:
    """COPY destinations (files) -> their sources in the repository (the build context is its root)."""
    out = {}
    for rest in instructions("COPY"):
        words = [
            w for w in (json.loads(rest) if rest.startswith("[") else rest.split()) if not w.startswith("--")
        ]
        *sources, dest = words
        for src in sources:
            path = ROOT / src
            assert path.exists(), f"deploy/Containerfile: COPY {src}: not in the repository"
            out[dest.rstrip("/") + ("/" + path.name if dest.endswith("/") else "")] = path
    return out


def test_containerfile_build_context() -> None:
    copied = copied_into_image()
    assert copied["/config/run.toml"] == DEFAULT_RUN_FILE
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    readme = pyproject["project"].get("readme")
    assert readme is None or f"/src/{readme}" in copied, "pip install /src needs the readme pyproject names"
    lines = (KIT / "Containerfile.dockerignore").read_text().splitlines()
    ignore = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    for needed in ("pyproject.toml", "p2ptrain/", "configs/"):
        assert f"!{needed}" in ignore, f"Containerfile.dockerignore leaves out {needed}"
    assert ignore[0] == "*", "Containerfile.dockerignore: start from nothing (the context holds .venv)"
    assert "**/*.key" in ignore, "key files never go into a build context"


def test_compose() -> None:
    data = compose()
    for env_name in compose_envs():
        cmds = compose_service_commands(env_name)
        assert sorted(cmds) == ["node0", "node1", "node2"], env_name
        first = check_node(cmds["node0"])
        assert not first.join, "node0 is the bootstrap: it joins nobody"
        assert first.identity and PurePosixPath(first.identity).parent == PurePosixPath(first.data_dir)
        for name in ("node1", "node2"):
            args = check_node(cmds[name])
            (join,) = args.join
            addr = PeerAddress.parse(join)
            assert str(addr.peer_id) == PEER_ID, f"{name}: the join address carries BOOTSTRAP_PEER_ID"
            if env_name == "defaults":
                assert addr.host == "node0", join
            assert args.announce, f"{name}: announce a name the others can dial"
    example = env_file(KIT / ".env.example")
    assert "BOOTSTRAP_PEER_ID" not in example, ".env.example must not pretend to know node0's peer id"
    services = data["services"]
    for name, svc in services.items():
        where = f"deploy/compose.yaml: services.{name}"
        assert svc.get("restart") == "unless-stopped", where
        assert seconds(svc["stop_grace_period"]) >= drain_seconds(), where
        assert svc.get("stop_signal", "SIGTERM") == "SIGTERM", where
        assert HEALTH_URL in " ".join(svc["healthcheck"]["test"]), where
        container_ports = {int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in svc.get("ports", [])}
        assert container_ports == {PEER_PORT, METRICS_PORT}, f"{where}: ports {svc.get('ports')}"
        mounts = [expand(v, compose_envs()["defaults"], where) for v in svc["volumes"]]
        args = parse(compose_service_commands("defaults")[name])
        assert any(m.split(":")[1] == args.data_dir for m in mounts), f"{where}: {args.data_dir} not a volume"
        (run_file,) = [m.split(":")[0] for m in mounts if m.split(":")[1] == args.config]
        assert (KIT / run_file).resolve() == DEFAULT_RUN_FILE, f"{where}: the run file {run_file}"
        (gpu,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"], where
        if "build" in svc:
            assert (
                KIT / svc["build"]["context"] / svc["build"]["dockerfile"]
            ).resolve() == KIT / "Containerfile"
    for value in compose_envs()[".env.example"].values():
        if value.endswith(".toml"):
            assert (KIT / value).is_file(), f".env.example: {value}"


def test_systemd_unit() -> None:
    by_env = systemd_commands_by_env()
    (bootstrap,) = [c for c in by_env["bootstrap"] if c.argv[:1] == ("node",)]
    (joiner,) = [c for c in by_env["joiner"] if c.argv[:1] == ("node",)]
    assert not check_node(bootstrap).join, "the shipped environment file is a bootstrap node's"
    (join,) = check_node(joiner).join
    assert str(PeerAddress.parse(join).peer_id) == PEER_ID
    args = parse(bootstrap)
    assert args.config == "/etc/p2ptrain/run.toml" and args.data_dir == "/var/lib/p2ptrain"
    sources = install_sources(kit_text("p2ptrain.service")) | install_sources(kit_text("README.md"))
    assert (ROOT / sources[args.config]).resolve() == DEFAULT_RUN_FILE, "the run file's install line"

    def one(key: str, section: str = "Service") -> str:
        values = unit_values(section, key)
        assert len(values) == 1, f"deploy/p2ptrain.service: {key}={values}"
        return values[0]

    assert one("User") not in ("", "root")
    assert one("Restart") == "on-failure"
    assert seconds(one("RestartSec")) > 0
    assert int(one("StartLimitBurst", "Unit")) > 0 and seconds(one("StartLimitIntervalSec", "Unit")) > 0
    assert one("KillSignal") == "SIGTERM"
    assert seconds(one("TimeoutStopSec")) >= drain_seconds()
    assert one("NoNewPrivileges") == "yes" and one("ProtectSystem") == "strict" and one("PrivateTmp") == "yes"
    assert args.data_dir in one("ReadWritePaths").split()
    assert one("WantedBy", "Install") == "multi-user.target"


def test_k8s() -> None:
    sts = k8s_one("StatefulSet")
    name = sts["metadata"]["name"]
    svc = k8s_one("Service")
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert sts["spec"]["replicas"] == 3
    assert {p["port"] for p in svc["spec"]["ports"]} == {PEER_PORT, METRICS_PORT}
    pod = sts["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= drain_seconds()
    (node,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in node["ports"]}
    assert set(ports.values()) == {PEER_PORT, METRICS_PORT}
    for probe in ("livenessProbe", "readinessProbe"):
        get = node[probe]["httpGet"]
        assert get["path"] == "/healthz" and ports.get(get["port"], get["port"]) == METRICS_PORT, probe
    assert node["resources"]["limits"]["nvidia.com/gpu"] == 1

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in node["volumeMounts"]}
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    for pod_index in (0, 1):
        cmds = [c for c in k8s_container_commands("containers", node, pod_index) if c.argv[:1] == ("node",)]
        assert len(cmds) == 2, "one node command for pod 0, one for the others"
        for cmd in cmds:
            args = check_node(cmd)
            assert mounts[args.data_dir] in claims, f"{args.data_dir} is not on a PersistentVolume"
            config_volume = volumes[mounts[str(PurePosixPath(args.config).parent)]]
            configmap = k8s_one("ConfigMap")
            assert config_volume["configMap"]["name"] == configmap["metadata"]["name"]
            run_toml = configmap["data"][PurePosixPath(args.config).name]
            # Peers with different run settings do not group: the ConfigMap must be the same run.
            assert parse_config(tomllib.loads(run_toml)) == load_config(DEFAULT_RUN_FILE), (
                "the ConfigMap's run file differs from configs/tiny-gpt.toml: copy it again"
            )
            if args.announce:
                assert args.announce.startswith(f"{name}-{pod_index}.{svc['metadata']['name']}:")
    # The Secret holding pod 0's key reaches the init container only; the node reads a 0600 copy.
    secret_volumes = {n for n, v in volumes.items() if "secret" in v}
    assert secret_volumes and not secret_volumes & set(mounts.values()), "the Secret is not for the node"
    (init,) = pod["initContainers"]
    assert {m["name"] for m in init["volumeMounts"]} & secret_volumes
    assert "install -m 0600" in " ".join(init["command"]), "the key copy must be private (0600)"
    assert any(c.argv[0] == "id" for c in k8s_container_commands("initContainers", init, 0))


def test_k8s_entry_script_bootstrap_and_joiners(tmp_path: Path) -> None:
    """Run the node container's script with a stub p2ptrain: pod 0 starts with its identity and joins
    nobody (it would dial itself); every other pod joins pod 0 by its stable name and peer id."""
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh")
    stub = tmp_path / "p2ptrain"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > "$ARGV_OUT"\n')
    stub.chmod(0o755)
    sts = k8s_one("StatefulSet")
    (node,) = sts["spec"]["template"]["spec"]["containers"]
    seen = {}
    for pod in (0, 1, 2):
        env = k8s_env(node, pod)
        words = [expand(str(w), env, "k8s") for w in node["command"] + node.get("args", [])]
        out = tmp_path / f"argv-{pod}"
        run_env = {**env, "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}", "ARGV_OUT": str(out)}
        subprocess.run(words, env=run_env, check=True, timeout=30)
        argv = out.read_text().splitlines()
        args = check_node(Command(f"deploy/k8s.yaml pod {pod} (run)", tuple(argv)))
        seen[pod] = args
    assert seen[0].identity and not seen[0].join, "pod 0: its own identity, no --join"
    first = f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"
    for pod in (1, 2):
        assert not seen[pod].identity
        (join,) = seen[pod].join
        addr = PeerAddress.parse(join)
        assert (addr.host, addr.port, str(addr.peer_id)) == (first, PEER_PORT, PEER_ID), join


def test_readme_covers_the_operations() -> None:
    text = kit_text("README.md")
    for topic in ("keygen", "--join", "identity.key", "SIGTERM", "/metrics", "/healthz", "/data"):
        assert topic in text, f"deploy/README.md says nothing about {topic}"
    for name in ("Containerfile", "compose.yaml", "p2ptrain.service", "k8s.yaml"):
        assert f"`{name}`" in text, f"deploy/README.md does not mention {name}"


_KEY_MATERIAL = [
    re.compile(r"PRIVATE KEY-----"),  # a p2ptrain key file's (or any PEM) armour
    re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{43}=(?![A-Za-z0-9+/=])"),  # a base64 32-byte seed
]


def test_no_private_key_material_in_the_kit() -> None:
    files = [p for p in KIT.rglob("*") if p.is_file()]
    assert len(files) >= len(KIT_FILES)
    for path in files:
        assert path.suffix != ".key", f"{path.relative_to(ROOT)}: a key file in the kit"
        text = path.read_text(errors="replace")
        for pattern in _KEY_MATERIAL:
            m = pattern.search(text)
            assert m is None, f"{path.relative_to(ROOT)}: looks like private key material: {m.group(0)!r}"
    for doc in k8s():
        assert doc["kind"] != "Secret", "deploy/k8s.yaml: the bootstrap key's Secret is made with kubectl"
