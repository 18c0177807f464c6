"""`make image-test`: docker/Dockerfile, unchanged, built with buildah on the stand-in base
(standin.py) and run for real, as the image's own user, with no Docker engine.

Steps, each timed: the stand-in (cached), the build (BASE_IMAGE/BASE_TAG/BASE_DIGEST pointed at the
stand-in; the context filtered by docker/Dockerfile.dockerignore, as `docker build` does), then in
the image: the entrypoint with the image's default command prints the versions file; `--dry-run`
on every shipped config, every printed command line parsed by the image's vLLM; `moe-overlay config
check` on every config; wrong configs refused with their one-line error; no token or key in what
the Dockerfile added; configs/tiny-mixtral.yaml served on loopback (the checkout's configs mounted
read-only over the image's, as `make docker-run` does), answering a chat completion and `GET /v1/moe`
with every MoE layer on the adapter, then stopped with SIGTERM. The image and its containers are
removed at the end; the stand-in stays cached. Exit status 1 on any failure.

    python3 docker/standin/image_test.py [--keep] [--pip-extra ARGS]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import types
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path

from standin import ATTEMPTS, BUILDAH_RUN, ROOT, RUNTIME_HICCUP, Failure, buildah, ensure, vllm_requirement


def _proctree() -> types.ModuleType:
    """The package's own /proc walk, loaded by its path: this script runs without the package."""
    spec = importlib.util.spec_from_file_location("proctree", ROOT / "overlay" / "serving" / "proctree.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


descendants = _proctree().descendants

DOCKERFILE = "docker/Dockerfile"
IGNOREFILE = "docker/Dockerfile.dockerignore"  # `docker build -f docker/Dockerfile` reads it; buildah needs telling
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
IMAGE_CONFIGS = "/opt/moe-overlay/configs"
SERVED = "tiny-mixtral.yaml"
VERSIONS_HEADER = "[moe-overlay] image versions ("
VERSION_LINE = "[moe-overlay]   "
# what `buildah run` itself adds to stderr when the command exits non-zero
BUILDAH_EXIT_LINE = re.compile(r"^(subprocess exited with status \d+|Error: exit status \d+)$")
# wrong configs (a change to configs/tiny-mixtral.yaml's text) and the start of the one line that refuses each
WRONG_CONFIGS = {
    "unknown-key": (("strict: true", "strictly: true"), "moe.strictly: unknown key"),
    "owned-flag": (("enforce-eager: true", "port: 9000"), "vllm.port: set it as server.port instead"),
}
# In the image config (environment, labels, history) and in the files the Dockerfile added
SECRET_ENV_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY", re.I)
SECRET_TEXT = {
    "a Hugging Face token": re.compile(rb"\bhf_[A-Za-z0-9]{34}\b"),
    "a private key": re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "a GitHub token": re.compile(rb"\bgh[pousr]_[A-Za-z0-9]{36}\b"),
}
DEPLOYMENT_KEY = re.compile(rb"^\s*api_key\s*:\s*[^\s#]", re.M)  # server.api_key set in a YAML file
CREDENTIAL_FILES = {".netrc", ".git-credentials", ".pypirc", "token", "stored_tokens", "id_rsa", "id_ecdsa",
                    "id_ed25519"}
# Parses each printed command line (`VAR=... python -m MODULE FLAGS...`) with the image's vLLM,
# through the overlay's own `vllm serve` parser helpers; prints one line per command.
PARSE_COMMANDS = """
import importlib.util, shlex, sys
from moe_overlay.serving.vllm_args import check_flags, server_flags
failed = 0
for line in sys.argv[1:]:
    words = shlex.split(line)
    argv = words[next(i for i, w in enumerate(words) if "=" not in w):]
    try:
        if importlib.util.find_spec(argv[2]) is None:
            raise ValueError(f"no module {argv[2]} in the image")
        check_flags(server_flags(argv))
        print("ok  ", argv[2])
    except ValueError as err:
        failed += 1
        print("FAIL", argv[2], err)
sys.exit(1 if failed else 0)
"""


class Steps:
    """Runs named steps, prints each one's time and outcome, and remembers the failures."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.started = time.monotonic()

    def __call__(self, name: str, step: Callable[[], str | None]) -> bool:
        print(f"[image-test] {name} ...", flush=True)
        began = time.monotonic()
        try:
            detail = step()
        except Exception as err:  # any error fails the step, which says what it was
            print(f"[image-test] {name}: FAILED ({time.monotonic() - began:.1f} s)\n{type(err).__name__}: {err}",
                  flush=True)
            self.failed.append(name)
            return False
        suffix = f": {detail}" if detail else ""
        print(f"[image-test] {name}: ok ({time.monotonic() - began:.1f} s){suffix}", flush=True)
        return True

    def summary(self) -> int:
        took = time.monotonic() - self.started
        if self.failed:
            print(f"[image-test] FAILED ({took:.0f} s): {', '.join(self.failed)}", flush=True)
            return 1
        print(f"[image-test] all steps passed ({took:.0f} s)", flush=True)
        return 0


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise Failure(message)


def own_stderr(stderr: str) -> list[str]:
    """The command's stderr lines, without those that `buildah run` adds."""
    return [line for line in stderr.splitlines() if not BUILDAH_EXIT_LINE.match(line)]


def secrets_in_config(config: dict) -> list[str]:
    """Secret-looking variables in the image's environment, and secret text anywhere in its config."""
    found = [f"environment variable {entry.split('=', 1)[0]}" for entry in config.get("config", {}).get("Env") or []
             if SECRET_ENV_NAME.search(entry.split("=", 1)[0])]
    text = json.dumps(config).encode()
    return found + [f"{what} in the image config" for what, pattern in SECRET_TEXT.items() if pattern.search(text)]


def secrets_in_files(root: Path, paths: Iterable[str]) -> list[str]:
    """Credential files and secret text among the given paths (relative to root)."""
    found = []
    for relative in sorted(paths):
        path = root / relative
        if path.name in CREDENTIAL_FILES:
            found.append(f"/{relative}: a credential file")
        if path.is_file() and not path.is_symlink():
            content = path.read_bytes()
            found += [f"/{relative}: {what}" for what, pattern in SECRET_TEXT.items() if pattern.search(content)]
            if path.suffix in (".yaml", ".yml") and DEPLOYMENT_KEY.search(content):
                found.append(f"/{relative}: an API key (server.api_key)")
    return found


def file_table(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under root (symlinks not followed) -> (mode, size, mtime_ns)."""
    table = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            table[os.path.relpath(path, root)] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return table


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http(port: int, path: str, body: dict | None = None, timeout: float = 120) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body else "GET",
                                     data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def command_of(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


class ImageTest:
    def __init__(self, base: tuple[str, str, str], keep: bool) -> None:
        self.base = base
        self.keep = keep
        self.tag = f"localhost/moe-overlay-image-test:{os.getpid()}"
        self.containers: list[str] = []
        self.main = self.user = self.entrypoint = ""
        self.default_command: list[str] = []
        self.scratch = Path(tempfile.mkdtemp(prefix="moe-overlay-image-test-"))
        self.scratch.chmod(0o755)  # the image's user reads the wrong configs mounted from here
        self.server: subprocess.Popen | None = None

    # -- helpers ---------------------------------------------------------------------------------
    def container(self, purpose: str) -> str:
        name = buildah("from", "--pull=never", "--name", f"moe-overlay-image-test-{os.getpid()}-{purpose}",
                       self.tag).stdout.strip()
        self.containers.append(name)
        return name

    def inside(self, container: str, *argv: str, volumes: Iterable[str] = (), timeout: float = 300,
               check: bool = True) -> subprocess.CompletedProcess:
        """A command in the container as the image's user (the image's environment and workdir)."""
        return buildah(*BUILDAH_RUN, "--user", self.user, *(f"--volume={v}" for v in volumes), container, "--",
                       *argv, timeout=timeout, check=check)

    # -- steps -----------------------------------------------------------------------------------
    def build(self) -> str:
        name, tag, digest = self.base
        buildah("build", "--isolation", "chroot", "--pull=never", "--format", "docker", "--ignorefile", IGNOREFILE,
                "-f", DOCKERFILE, "--build-arg", f"BASE_IMAGE={name}", "--build-arg", f"BASE_TAG={tag}",
                "--build-arg", f"BASE_DIGEST={digest}", "-t", self.tag, str(ROOT), timeout=1800)
        config = json.loads(buildah("inspect", "--type", "image", self.tag).stdout)["Docker"]["config"]
        self.user, self.entrypoint = config.get("User") or "", (config.get("Entrypoint") or [""])[0]
        self.default_command = (config.get("Entrypoint") or []) + (config.get("Cmd") or [])
        expect(self.user not in ("", "0", "root"), f"the image runs as {self.user or 'root (no USER)'}")
        expect(bool(self.entrypoint), "the image has no ENTRYPOINT")
        self.main = self.container("main")
        return f"{self.tag} on {name}:{tag}@{digest[:19]}...; user {self.user}, entrypoint {self.entrypoint}"

    def versions(self) -> str:
        """The image's default command (entrypoint + CMD) prints the versions file, then serve's help."""
        listed = self.inside(self.main, "sh", "-c", 'cat "$MOE_OVERLAY_VERSIONS"').stdout.splitlines()
        now = self.inside(self.main, "python3", "-m", "moe_overlay.serving.versions").stdout.splitlines()
        expect(listed == now, f"the versions file {listed} is not what the image has: {now}")
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        vllm = vllm_requirement().split("==")[1]
        expect(f"moe-overlay: {project}" in listed and any(line.startswith(f"vllm: {vllm}") for line in listed),
               f"the versions file names neither moe-overlay {project} nor vLLM {vllm}: {listed}")
        out = self.inside(self.main, *self.default_command).stdout.splitlines()
        expect(bool(out) and out[0].startswith(VERSIONS_HEADER), f"no versions header first: {out[:3]}")
        expect(out[1:1 + len(listed)] == [VERSION_LINE + line for line in listed],
               f"the entrypoint's versions {out[1:1 + len(listed)]} differ from the file {listed}")
        expect(any(line.startswith("usage: moe-overlay serve") for line in out), "no serve usage after them")
        return "; ".join(listed)

    def dry_runs(self) -> str:
        commands = []
        for config in CONFIGS:
            result = self.inside(self.main, self.entrypoint, f"{IMAGE_CONFIGS}/{config.name}", "--dry-run")
            lines = result.stdout.splitlines()
            expect(bool(lines) and lines[0].startswith(VERSIONS_HEADER), f"{config.name}: no versions first")
            printed = [line for line in lines if not line.startswith(("[moe-overlay]", "#"))]
            expect(bool(printed) and all(" -m vllm.entrypoints." in line for line in printed),
                   f"{config.name}: no vLLM command line in {lines}")
            commands += printed
        parsed = self.inside(self.main, "python3", "-c", PARSE_COMMANDS, *commands, check=False)
        expect(parsed.returncode == 0, f"the image's vLLM refuses a printed command line:\n{parsed.stdout}"
                                       f"{parsed.stderr[-3000:]}")
        return f"{len(CONFIGS)} configs, {len(commands)} command lines parsed by the image's vLLM"

    def config_check(self) -> str:
        result = self.inside(self.main, "moe-overlay", "config", "check",
                             *(f"{IMAGE_CONFIGS}/{config.name}" for config in CONFIGS), check=False)
        passed = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
        expect(result.returncode == 0 and len(passed) == len(CONFIGS),
               f"exit status {result.returncode}, {len(passed)} of {len(CONFIGS)} passed:\n{result.stdout}")
        return f"{len(passed)} of {len(CONFIGS)} configs pass, every node's command line parsed by the image's vLLM"

    def wrong_configs(self) -> str:
        text = (ROOT / "configs" / SERVED).read_text()
        for name, ((old, new), _) in WRONG_CONFIGS.items():
            expect(old in text, f"configs/{SERVED} no longer has {old!r} to change")
            (self.scratch / f"{name}.yaml").write_text(text.replace(old, new, 1))
            (self.scratch / f"{name}.yaml").chmod(0o644)
        for name, (_, refusal) in WRONG_CONFIGS.items():
            path = f"/mnt/image-test/{name}.yaml"
            result = self.inside(self.main, self.entrypoint, path, "--port", str(free_port()),
                                 volumes=[f"{self.scratch}:/mnt/image-test:ro"], timeout=120, check=False)
            lines = own_stderr(result.stderr)
            expect(result.returncode == 2 and len(lines) == 1 and
                   lines[0].startswith(f"moe-overlay serve: error: {path}: {refusal}"),
                   f"{name}: exit status {result.returncode}, stderr {lines}")
        return ", ".join(WRONG_CONFIGS)

    def no_secrets(self) -> str:
        """What the Dockerfile added or changed (the image's files against the stand-in's), and the config."""
        config = json.loads(buildah("inspect", "--type", "image", self.tag).stdout)["Docker"]
        found = secrets_in_config(config)
        scan = self.container("scan")
        base = buildah("from", "--pull=never", "--name", f"moe-overlay-image-test-{os.getpid()}-base",
                       "@".join((":".join(self.base[:2]), self.base[2]))).stdout.strip()
        self.containers.append(base)
        image_root, base_root = (Path(buildah("mount", c).stdout.strip()) for c in (scan, base))
        image_files, base_files = file_table(image_root), file_table(base_root)
        added = [path for path, entry in image_files.items() if base_files.get(path) != entry]
        expect(any(path.startswith("opt/moe-overlay/") for path in added), f"no /opt/moe-overlay among {added[:5]}")
        found += secrets_in_files(image_root, added)
        expect(not found, "\n".join(found))
        return f"{len(added)} paths added or changed, the image config"

    def serve(self) -> str:
        port = free_port()
        log = self.scratch / "serve.log"
        argv = ["buildah", *BUILDAH_RUN, "--user", self.user, f"--volume={ROOT / 'configs'}:{IMAGE_CONFIGS}:ro",
                self.main, "--", self.entrypoint, f"{IMAGE_CONFIGS}/{SERVED}", "--port", str(port)]
        try:
            began = time.monotonic()
            self.start_server(argv, port, log)
            up = time.monotonic() - began
            model = http(port, "/v1/models")["data"][0]["id"]
            chat = http(port, "/v1/chat/completions", {"model": model, "max_tokens": 8,
                                                        "messages": [{"role": "user", "content": "Hello"}]})
            expect(chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] == 8,
                   f"chat completion: {chat}")
            layers = http(port, "/v1/moe")["layers"]
            status = self.stop_server()
        except Exception:
            print("\n".join(log.read_text(errors="replace").splitlines()[-60:]))
            raise
        expect(status == 0, f"the server exited {status} after SIGTERM:\n{log.read_text()[-3000:]}")
        model_config = json.loads(self.inside(self.main, "cat", f"/home/moe/var/models/{model}/config.json").stdout)
        expected = [f"model.layers.{i}.block_sparse_moe.experts" for i in range(model_config["num_hidden_layers"])]
        expect([row["layer"] for row in layers] == expected, f"/v1/moe lists {layers}, the model has {expected}")
        for row in layers:
            expect(row["backend"] == "torch" and row["prepared"] is True and row["kernel"].startswith("moe_overlay::"),
                   f"a layer not on the adapter: {row}")
        return (f"up in {up:.0f} s on 127.0.0.1:{port}; chat answered; /v1/moe: {len(layers)} of "
                f"{len(expected)} MoE layers on {layers[0]['kernel']}; SIGTERM: exit 0")

    def start_server(self, argv: list[str], port: int, log: Path) -> None:
        """Start it and wait for /health; a start that buildah failed before it ran anything is tried again."""
        for attempt in range(1, ATTEMPTS + 1):
            with log.open("w") as out:
                self.server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            try:
                return self.wait_healthy(self.server, port)
            except Failure:
                if attempt == ATTEMPTS or RUNTIME_HICCUP not in log.read_text(errors="replace"):
                    raise

    @staticmethod
    def wait_healthy(server: subprocess.Popen, port: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise Failure(f"the server exited {server.returncode} before answering")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(2)
        raise Failure(f"no answer on /health within {timeout:.0f} s")

    def stop_server(self, timeout: float = 120) -> int | None:
        """SIGTERM to the server process inside (`buildah run` itself would SIGKILL it and leave the
        engine behind); its exit status as `buildah run` reports it, None if it had to be killed."""
        if self.server is None or self.server.poll() is not None:
            return None if self.server is None else self.server.returncode
        inner = [pid for pid in descendants(self.server.pid) if not Path(command_of(pid)[0]).name.startswith("buildah")]
        if inner:
            os.kill(inner[0], signal.SIGTERM)
        try:
            return self.server.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in reversed(descendants(self.server.pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.server.kill()
            self.server.wait()
            return None

    def cleanup(self) -> None:
        self.stop_server()
        for container in self.containers:
            buildah("rm", container, check=False)
        if not self.keep:
            buildah("rmi", self.tag, check=False)
        for path in sorted(self.scratch.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        self.scratch.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the built image (its tag is printed)")
    parser.add_argument("--pip-extra", default="", help="more pip install options for the stand-in's build")
    args = parser.parse_args(argv)
    steps = Steps()
    base: list[tuple[str, str, str]] = []

    def stand_in() -> str:
        base.append(ensure(pip_extra=shlex.split(args.pip_extra)))
        return "{}:{}@{}".format(*base[0])

    if not steps("stand-in base (built once, then cached in buildah's storage)", stand_in):
        return steps.summary()
    test = ImageTest(base[0], args.keep)
    try:
        if steps("build docker/Dockerfile", test.build):
            steps("entrypoint prints the versions file", test.versions)
            steps("--dry-run on every config", test.dry_runs)
            steps("config check on every config", test.config_check)
            steps("wrong configs refused", test.wrong_configs)
            steps("no token or key in the image", test.no_secrets)
            steps(f"serve configs/{SERVED}", test.serve)
    finally:
        test.cleanup()
    return steps.summary()


if __name__ == "__main__":
    sys.exit(main())
