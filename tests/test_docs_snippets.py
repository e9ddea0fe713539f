"""The code blocks of README.md and docs/*.md run as documented, on CPU with the built-in tiny model.

Every ```python and ```bash block starts with a marker comment (docs/index.md, "Tested docs"):
  # test: run            run as it is
  # test: tiny           run with quoted Hub ids and the word MODEL replaced by the tiny model's path
  # test: serve          its `nanoinfer serve ...` line starts the server the `server` blocks share
  # test: server         run against that server (8000 -> its port, MODEL -> its served name)
  # test: skip (reason)  skipped, the reason shown with -rs
A block without a marker fails, so no block escapes the test silently. Each runnable block runs in a
fresh process (as a reader would run it) with a time limit; a failure prints the block and its output.
"""
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(python|bash)\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"#\s*test:\s*(run|tiny|serve|server|skip)\b\s*(.*)")
HUB_ID = re.compile(r"""(["'])[A-Za-z][\w.-]*/[\w.-]+\1""")
SERVED_NAME = re.compile(r"--served-model-name\s+(\S+)")
SNIPPET_TIMEOUT_S = 180
SERVER_START_TIMEOUT_S = 180


@dataclass
class Snippet:
    where: str          # file:line of the block's fence
    lang: str           # "python" or "bash"
    mode: str | None    # the marker's mode; None when the block has no marker
    reason: str
    code: str


def collect_snippets() -> list[Snippet]:
    snippets = []
    for path in DOC_FILES:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            code = m.group(2)
            marker = MARKER.fullmatch(code.split("\n", 1)[0].strip())
            snippets.append(Snippet(f"{path.relative_to(ROOT)}:{line}", m.group(1),
                                    marker.group(1) if marker else None,
                                    marker.group(2).strip(" ()") if marker else "", code))
    return snippets


SNIPPETS = collect_snippets()
SERVE_BLOCKS = [s for s in SNIPPETS if s.mode == "serve"]


def snippet_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # `python` is ours
    return env


def execute(snippet: Snippet, code: str, cwd: Path) -> tuple[str, str]:
    """Runs a block in a fresh process; returns (what went wrong or "", its output)."""
    argv = [sys.executable, "-c", code] if snippet.lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    try:
        done = subprocess.run(argv, cwd=cwd, env=snippet_env(), capture_output=True, text=True,
                              timeout=SNIPPET_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return f"still running after {SNIPPET_TIMEOUT_S} s", f"{e.stdout or ''}{e.stderr or ''}"
    # curl exits 0 on an HTTP error: the OpenAI-shaped error body is what tells
    if done.returncode != 0 or (snippet.lang == "bash" and '"error":' in done.stdout):
        return f"exit status {done.returncode}", done.stdout + done.stderr
    return "", done.stdout + done.stderr


def check(snippet: Snippet, code: str, problem: str, output: str) -> None:
    if problem:
        pytest.fail(f"{snippet.where}: {problem}\n--- block:\n{code}\n--- output:\n{output[-4000:]}", pytrace=False)


def offline_code(snippet: Snippet, tiny_model_path: str) -> str:
    code = snippet.code
    if snippet.mode == "tiny":
        quoted = repr(tiny_model_path) if snippet.lang == "python" else shlex.quote(tiny_model_path)
        code = HUB_ID.sub(lambda m: quoted, code)
        code = re.sub(r"\bMODEL\b", tiny_model_path, code)
    return code


@pytest.fixture(scope="module")
def tiny_model_path() -> str:
    from nanoinfer.utils.tiny_model import default_tiny_model_dir
    return str(default_tiny_model_dir())


@pytest.fixture(scope="module")
def offline_runs(tiny_model_path, tmp_path_factory, request):
    """The selected runnable offline blocks, started at once on two workers; each test waits for its own."""
    selected = {item.callspec.params["snippet"].where for item in request.session.items
                if item.name.startswith("test_offline_snippet")}
    pool = ThreadPoolExecutor(max_workers=2)
    runs = {}
    for s in SNIPPETS:
        if s.mode in ("run", "tiny") and s.where in selected:
            code = offline_code(s, tiny_model_path)
            runs[s.where] = code, pool.submit(execute, s, code, tmp_path_factory.mktemp("snippet"))
    yield runs
    pool.shutdown(cancel_futures=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the documented server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the documented server did not answer /health in {SERVER_START_TIMEOUT_S} s:\n"
                f"{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def documented_server(tiny_model_path, tmp_path_factory):
    """The README's `nanoinfer serve` line, run on a free port; yields (port, served model name)."""
    if len(SERVE_BLOCKS) != 1:
        pytest.fail(f"expected one `# test: serve` block, found {[s.where for s in SERVE_BLOCKS]}")
    lines = [ln.strip() for ln in SERVE_BLOCKS[0].code.splitlines() if ln.strip().startswith("nanoinfer serve")]
    if len(lines) != 1:
        pytest.fail(f"{SERVE_BLOCKS[0].where}: expected one `nanoinfer serve` line")
    port = free_port()
    log = tmp_path_factory.mktemp("docs_server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-c", f"exec {lines[0]} --port {port}"], env=snippet_env(),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, port, log)
        name = SERVED_NAME.search(lines[0])
        yield port, name.group(1) if name else Path(tiny_model_path).name
    finally:
        os.killpg(proc.pid, signal.SIGTERM)   # its own session: the server and its engine process
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_every_block_is_marked_and_found():
    assert len(SNIPPETS) >= 10, [s.where for s in SNIPPETS]   # the collector itself works
    unmarked = [s.where for s in SNIPPETS if s.mode is None]
    assert not unmarked, f"code blocks without a `# test: ...` marker (docs/index.md, Tested docs): {unmarked}"
    assert {s.mode for s in SNIPPETS} >= {"run", "tiny", "serve", "server"}


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.mode in ("run", "tiny", "skip")],
                         ids=lambda s: s.where)
def test_offline_snippet(snippet, offline_runs):
    if snippet.mode == "skip":
        pytest.skip(f"{snippet.where}: {snippet.reason or 'marked skip'}")
    code, run = offline_runs[snippet.where]
    check(snippet, code, *run.result())


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.mode == "server"], ids=lambda s: s.where)
def test_server_snippet(snippet, documented_server, tmp_path):
    port, served_name = documented_server
    if snippet.lang == "bash" and "curl " in snippet.code and shutil.which("curl") is None:
        pytest.skip(f"{snippet.where}: curl is not installed")
    code = re.sub(r"\b8000\b", str(port), snippet.code)
    code = re.sub(r"\bMODEL\b", served_name, code)
    check(snippet, code, *execute(snippet, code, tmp_path))
