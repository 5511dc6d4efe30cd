"""The env server image built and started with the container engine on this machine (podman, or docker with a
running daemon), then used as a client would: health check, auth, one episode, the user, SIGTERM.

No registry of base images is reachable from this project's machines, so unless ``TOOLGYM_TEST_BASE_IMAGE``
names one, or the engine already holds the Containerfile's default base, the test makes a Debian 12 base
with ``debootstrap`` (Debian's packages are reachable) and imports it into the engine, once per machine.
The engine's run options are found by running that base first: on Debian 12 machines with a hybrid cgroup
layout podman's default runtime (crun 1.8) refuses to start containers and runc works, and a process there
may not raise its ``RLIMIT_NPROC`` to the limit podman asks by default. Where nothing runs a container the
test is skipped and the reason names what was tried (``docs/distributed.md``).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sdk import RemoteEnvironment
from tests.deploy.containerfile import CONTAINERFILE, exec_form, instructions, only
from tests.doc_blocks import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

IMAGE = "localhost/toolgym-envserver:test"
LOCAL_BASE = "localhost/toolgym-test-base:bookworm"
TOKEN = "container-test-token"
PORT = int(only("EXPOSE").args.split("/")[0])


@dataclass(frozen=True)
class Engine:
    """A container engine that runs containers here, with the options it needs on this machine."""

    command: list[str]  # the engine and its global options (``podman --runtime runc``)
    limits: list[str]  # ``--ulimit`` options for ``build`` and ``run``
    base: str  # the base image to build on

    @property
    def podman(self) -> bool:
        """Whether the engine is podman (``--format docker``, build-time volumes, ``healthcheck run``)."""
        return Path(self.command[0]).name == "podman"

    def __call__(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``ENGINE ARGS...``; fails the test with its output when it fails and ``check`` is set."""
        result = subprocess.run([*self.command, *args], capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            pytest.fail(f"{' '.join([*self.command, *args])} exited {result.returncode}:\n"
                        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result


def _program() -> list[str]:
    """The engine's program, or a skip that says what was tried."""
    tried = []
    for name in ("podman", "docker"):
        path = shutil.which(name)
        if path is None:
            tried.append(f"{name}: not installed")
            continue
        probe = subprocess.run([path, "info"], capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return [path]
        tried.append(f"{name}: '{name} info' failed ({(probe.stderr.strip().splitlines() or ['?'])[-1]})")
    if shutil.which("buildah"):
        tried.append("buildah: builds images but does not run a server")
    pytest.skip("no container engine runs here; " + "; ".join(tried))


def _has_image(program: list[str], image: str) -> bool:
    verb = ["image", "exists", image] if Path(program[0]).name == "podman" else ["image", "inspect", image]
    return subprocess.run([*program, *verb], capture_output=True, timeout=60).returncode == 0


def _base(program: list[str]) -> str:
    """The image to build on: the one asked for, the default one if present, or a local Debian 12 base."""
    if os.environ.get("TOOLGYM_TEST_BASE_IMAGE"):
        return os.environ["TOOLGYM_TEST_BASE_IMAGE"]
    default = next(i.args.split("=", 1)[1] for i in instructions() if i.keyword == "ARG"
                   and i.args.startswith("BASE_IMAGE="))
    for image in (default, LOCAL_BASE):
        if _has_image(program, image):
            return image
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        pytest.skip(f"no base image: {default} is not in the engine and no registry serves it here, and the local "
                    "base needs debootstrap run as root")
    with tempfile.TemporaryDirectory(prefix="toolgym-base-") as work:
        rootfs = Path(work) / "rootfs"
        made = subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv", "bookworm",
                               str(rootfs), "http://deb.debian.org/debian"], capture_output=True, text=True,
                              timeout=900)
        if made.returncode != 0:
            pytest.fail(f"debootstrap failed:\n{made.stdout[-2000:]}\n{made.stderr[-2000:]}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run([*program, "import", "-", LOCAL_BASE], stdin=tar.stdout, capture_output=True,
                                  text=True, timeout=600)
        tar.wait()
        assert imported.returncode == 0, imported.stderr
    return LOCAL_BASE


def _run_options(program: list[str], base: str) -> Engine:
    """The first set of runtime and limit options under which ``base`` runs Python here; else a skip."""
    runtimes: list[list[str]] = [[]]
    if Path(program[0]).name == "podman" and shutil.which("runc"):
        runtimes.append(["--runtime", "runc"])
    soft = {name: resource.getrlimit(limit)[0] for name, limit in
            (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC))}
    lowered = [option for name, value in soft.items()
               for option in ("--ulimit", f"{name}={_below(value)}:{_below(value)}")]
    errors = []
    for runtime in runtimes:
        for limits in ([], lowered):
            result = subprocess.run([*program, *runtime, "run", "--rm", *limits, base, "python3", "-c", "pass"],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode == 0:
                return Engine([*program, *runtime], limits, base)
            errors.append(f"{' '.join(runtime + limits) or 'defaults'}: {result.stderr.strip()[-300:]}")
    pytest.skip(f"{program[0]} is installed but runs no container here: " + " | ".join(errors))


def _below(limit: int) -> int:
    """A limit no higher than this process's own soft limit (``RLIM_INFINITY`` counts as large)."""
    return 4096 if limit == resource.RLIM_INFINITY else min(4096, limit // 2)


@pytest.fixture(scope="module")
def engine() -> Engine:
    """The engine, its options and the base image, or a skip."""
    program = _program()
    return _run_options(program, _base(program))


@pytest.fixture(scope="module")
def container(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(name, base URL) of the image, built now and started with the token and a read-only root."""
    build = ["build", "--network", "host", *engine.limits, "--build-arg", f"BASE_IMAGE={engine.base}",
             "-f", str(CONTAINERFILE), "-t", IMAGE]
    if engine.podman:
        build[1:1] = ["--format", "docker"]  # keeps the HEALTHCHECK
        build += _pip_certificates(tmp_path_factory.mktemp("pip"))
    engine(*build, str(ROOT), timeout=900)
    port = _free_port()
    name = f"toolgym-envserver-test-{os.getpid()}"
    engine("run", "-d", "--name", name, *engine.limits, "-p", f"127.0.0.1:{port}:{PORT}", "--read-only",
           "--tmpfs", "/tmp", "-e", f"TOOLGYM_TOKEN={TOKEN}", IMAGE)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(engine, name, url)
        yield name, url
    finally:
        engine("rm", "-f", name, check=False)


def _pip_certificates(work: Path) -> list[str]:
    """Build-time mounts that make pip in the build trust what pip here trusts (a TLS-inspecting proxy's CA).

    Nothing of them stays in the image: podman mounts build volumes only while each ``RUN`` runs.
    """
    bundle = Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")
    if not bundle.is_file():
        return []
    conf = work / "pip.conf"
    conf.write_text("[global]\ncert = /etc/toolgym-build-ca.crt\n")
    return ["-v", f"{bundle}:/etc/toolgym-build-ca.crt:ro", "-v", f"{conf}:/etc/pip.conf:ro"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _health(url: str, token: str | None) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _wait_ready(engine: Engine, name: str, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if _health(url, TOKEN)[0] == 200:
                return
        except OSError:
            pass
        if engine("inspect", "--format", "{{.State.Running}}", name).stdout.strip() != "true":
            break
        time.sleep(0.5)
    logs = engine("logs", name, check=False)
    pytest.fail(f"the container did not get ready at {url}:\n{logs.stdout[-3000:]}\n{logs.stderr[-3000:]}")


def test_the_server_answers_health_only_with_the_token(container: tuple[str, str]) -> None:
    _, url = container
    status, body = _health(url, TOKEN)
    assert status == 200
    assert body["environments"] == exec_form(only("CMD").args)
    assert _health(url, None)[0] == 401
    assert _health(url, "wrong")[0] == 401


def test_the_image_healthcheck_passes(engine: Engine, container: tuple[str, str]) -> None:
    name, _ = container
    if engine.podman:
        assert engine("healthcheck", "run", name, check=False).returncode == 0
        return
    deadline = time.monotonic() + 60  # docker runs it on its own schedule (--interval 10s)
    while engine("inspect", "--format", "{{.State.Health.Status}}", name).stdout.strip() != "healthy":
        assert time.monotonic() < deadline, "docker never reported the container healthy"
        time.sleep(1)


def test_an_episode_runs_through_the_remote_client(container: tuple[str, str]) -> None:
    _, url = container

    async def episode() -> tuple[str | None, str, float | None]:
        async with RemoteEnvironment(url, "counter", token=TOKEN) as env:
            prompt = await env.reset(target=3)
            counter = await env.call("increment", {"step": 3})
            return prompt, counter, await env.get_reward()

    assert asyncio.run(episode()) == ("Increment the counter to 3.", "3", 1.0)


def test_the_server_runs_as_the_unprivileged_user(engine: Engine, container: tuple[str, str]) -> None:
    name, _ = container
    assert engine("exec", name, "id", "-u").stdout.strip() == only("USER").args.split(":")[0]
    # The read-only root holds: the server user cannot write its own code.
    wrote = engine("exec", name, "touch", "/opt/toolgym/src/x", check=False)
    assert wrote.returncode != 0


def test_sigterm_drains_and_exits_cleanly(engine: Engine, container: tuple[str, str]) -> None:
    name, _ = container
    started = time.monotonic()
    engine("stop", "-t", "30", name, timeout=60)
    assert time.monotonic() - started < 30, "the server did not exit on SIGTERM before the engine's kill"
    assert engine("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip() == "0"
