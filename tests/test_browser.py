"""End to end, in a real browser: every lesson in notebooks/ runs in JupyterLab and its sliders work.

One JupyterLab server (127.0.0.1, a random token, a free port) and one headless Chromium serve the whole
module. For each lesson (found by globbing notebooks/, so a new lesson is covered without touching this
file) the test opens it, clears the stored outputs, runs all cells, checks that nothing raised, moves every
slider one step and checks that the output below it changed, again without an error, and saves a
screenshot to test-artifacts/browser/<lesson>.png (with the server's log beside it).

"Nothing raised" is read from the kernel's message stream, not from the page's looks: every `error`
message the kernel publishes counts, whether it ends up in a cell, in a widget's Output area (where an
exception in a slider callback wired with wb_kernels.widgets.link_slider lands) or nowhere on the page
(an observer that raises outside any Output area). A slider whose callback ends without changing any
output fails too. The throwaway notebooks at the end prove that each of these failures is reported.

The same server is checked for the two promises `make lab` makes: it refuses requests without the token,
and nothing it runs listens beyond the loopback interface.

Browser: Debian's `chromium` package driven by the `playwright` package from PyPI (no browser download).
Where either is missing the browser tests skip with the reason, except under CI (CI=1), where they fail.
Set WB_CHROMIUM to use another Chromium binary. Timeouts can be raised with WB_BROWSER_RUN_ALL_TIMEOUT
and WB_BROWSER_SLIDER_TIMEOUT (seconds), e.g. for a slow machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb"))
ARTIFACTS = ROOT / "test-artifacts" / "browser"

# Lessons 02-04 run numba kernels in the simulator: "run all" may take a minute or two there on 2 cores.
RUN_ALL_TIMEOUT_S = float(os.environ.get("WB_BROWSER_RUN_ALL_TIMEOUT", 300))
# A slider callback on the simulator is capped to stay interactive; a minute is already far too slow.
SLIDER_TIMEOUT_S = float(os.environ.get("WB_BROWSER_SLIDER_TIMEOUT", 90))
KERNEL_START_TIMEOUT_S = 90
SERVER_START_TIMEOUT_S = 60
POLL_S = 0.25
# After the kernel handled a slider's message and went idle, how long the page may take to show the result.
QUIET_AFTER_CALLBACK_S = 3.0
# A slider's handle moves in the page itself, before the kernel hears of it.
KEY_PRESS_TIMEOUT_S = 5.0

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",  # containers often give /dev/shm only 64 MB, too little for a page this big
]

# JupyterLab user settings for the test server: no autosave (the lessons are committed with their
# outputs, and a run in the browser must not rewrite them), no news or update pop-ups over the page,
# and every cell kept in the DOM (the default windowing drops cells scrolled out of view).
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_or_fail(reason: str):
    """Outside CI a missing browser is the contributor's choice; in CI the browser test must run."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set, so the browser test may not skip)", pytrace=False)
    pytest.skip(reason)


def find_chromium() -> str | None:
    explicit = os.environ.get("WB_CHROMIUM")
    if explicit:
        return explicit
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_status(url: str, headers: dict | None = None) -> int:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


# --------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------

class LabServer:
    """`jupyter lab` on 127.0.0.1 with a token, in its own process group, with private config dirs."""

    def __init__(self, root: Path, scratch: Path, log_path: Path):
        self.root = root
        self.token = secrets.token_hex(24)
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.port = 0
        self._env = self._private_environment(scratch)
        self._checkpoints = scratch / "checkpoints"

    @staticmethod
    def _private_environment(scratch: Path) -> dict:
        # Private Jupyter/IPython dirs: the contributor's own settings, workspaces, kernelspecs and
        # startup files stay out of the test, and the test writes nothing into their home.
        settings = scratch / "lab-settings"
        for relative, body in LAB_SETTINGS.items():
            path = settings / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(body))
        env = dict(os.environ)
        for var, sub in (("JUPYTERLAB_SETTINGS_DIR", "lab-settings"), ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
                         ("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                         ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython")):
            (scratch / sub).mkdir(exist_ok=True)
            env[var] = str(scratch / sub)
        return env

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self):
        for _attempt in range(3):  # another process may take the free port between probe and bind
            self.port = free_port()
            command = [
                sys.executable, "-m", "jupyterlab", "--no-browser",
                "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
                "--ServerApp.terminals_enabled=False",
                # JupyterLab checkpoints a notebook when it opens it; keep those copies out of the repository
                f"--FileCheckpoints.checkpoint_dir={self._checkpoints}",
                # the test drives the page through JupyterLab's own commands and models
                "--LabApp.expose_app_in_browser=True",
                "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                "--LabApp.extension_manager=readonly",
            ]
            if hasattr(os, "getuid") and os.getuid() == 0:
                command.append("--allow-root")
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(command, cwd=self.root, env=self._env, stdin=subprocess.DEVNULL,
                                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            if self._wait_until_up():
                return
            self.stop()
        raise RuntimeError(f"JupyterLab did not start; see {self.log_path}")

    def _wait_until_up(self) -> bool:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                if self.api_status("/api/status") == 200:
                    return True
            except OSError:
                pass
            time.sleep(0.3)
        return False

    def api_status(self, path: str, token: str | None = "own") -> int:
        headers = {}
        if token == "own":
            headers["Authorization"] = f"token {self.token}"
        elif token is not None:
            headers["Authorization"] = f"token {token}"
        return http_status(self.base_url + path, headers)

    def api(self, method: str, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base_url + path, data=data, method=method,
                                         headers={"Authorization": f"token {self.token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
        return json.loads(text) if text else None

    def shut_down_kernels(self):
        """Ends every kernel this server started, through its own API (kernels run in their own sessions)."""
        try:
            for kernel in self.api("GET", "/api/kernels"):
                self.api("DELETE", f"/api/kernels/{kernel['id']}")
        except (OSError, ValueError):
            pass  # the server is already gone; the kernels then exit on their own (they poll their parent)

    def stop(self):
        """Stops the server by its own process group: SIGTERM (it then shuts its kernels down), then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return
        self.shut_down_kernels()
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


@pytest.fixture(scope="module")
def lab_server():
    import importlib.util

    if importlib.util.find_spec("jupyterlab") is None:  # e.g. a GPU machine with only the kernel-side packages
        skip_or_fail("JupyterLab is not installed (pip install -e '.[lab]', or `make lab` once)")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for stale in [*ARTIFACTS.glob("*.png"), ARTIFACTS / "jupyter-server.log"]:  # from an earlier run
        stale.unlink(missing_ok=True)
    log_path = ARTIFACTS / "jupyter-server.log"
    with tempfile.TemporaryDirectory(prefix="wb-lab-") as scratch:
        server = LabServer(ROOT, Path(scratch), log_path)
        try:
            server.start()
            yield server
        finally:
            server.stop()


# --------------------------------------------------------------------------------------------------
# Security: the token, and loopback only
# --------------------------------------------------------------------------------------------------

def test_server_refuses_requests_without_the_token(lab_server):
    assert lab_server.api_status("/api/status", token=None) == 403
    assert lab_server.api_status("/api/contents/notebooks", token=None) == 403
    assert lab_server.api_status("/api/status", token=secrets.token_hex(24)) == 403
    assert lab_server.api_status("/api/status") == 200
    assert http_status(f"{lab_server.base_url}/api/status?token={lab_server.token}") == 200


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (the kernels it started), from /proc."""
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                pass
    return pids


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    return inodes


def _decode_address(hex_address: str, family: str) -> str:
    raw = bytes.fromhex(hex_address)
    if family == "tcp":
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc/net/tcp6 stores the address as four host-order 32-bit words
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening_sockets(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by one of `pids`."""
    if Path("/proc/net/tcp").exists():
        inodes = _socket_inodes(pids)
        found = []
        for family in ("tcp", "tcp6"):
            table = Path(f"/proc/net/{family}")
            if not table.exists():
                continue
            for line in table.read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A = TCP_LISTEN
                    address, port = local.split(":")
                    found.append((_decode_address(address, family), int(port, 16)))
        return found
    try:
        import psutil
    except ImportError:
        pytest.skip("listing the server's sockets needs Linux's /proc or the psutil package")
    found = []
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                found.append((conn.laddr.ip, conn.laddr.port))
    return found


def non_loopback_addresses() -> list[str]:
    """This machine's IPv4 addresses other than 127.x (empty where it has none)."""
    addresses = set()
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            addresses.add(info[4][0])
    except OSError:
        pass
    try:  # the address of the default route's interface; UDP connect sends nothing
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))
            addresses.add(probe.getsockname()[0])
    except OSError:
        pass
    return sorted(a for a in addresses if not a.startswith("127.") and a != "0.0.0.0")


def test_socket_listing_sees_a_listener_on_every_interface():
    # the check below is only as good as this listing: a wildcard bind must show up as such
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as wildcard:
        wildcard.bind(("0.0.0.0", 0))
        wildcard.listen()
        assert ("0.0.0.0", wildcard.getsockname()[1]) in listening_sockets([os.getpid()])


def test_server_and_its_kernels_listen_on_loopback_only(lab_server):
    kernel = lab_server.api("POST", "/api/kernels", {"name": "python3"})  # kernels open ports too
    try:
        deadline = time.monotonic() + KERNEL_START_TIMEOUT_S
        while True:
            sockets = listening_sockets(_process_tree(lab_server.pid))
            kernel_ports = [port for _, port in sockets if port != lab_server.port]
            if len(kernel_ports) >= 5 or time.monotonic() > deadline:  # shell, iopub, stdin, control, hb
                break
            time.sleep(0.3)
        assert (("127.0.0.1", lab_server.port) in sockets), f"the server's own port is not listed: {sockets}"
        assert len(kernel_ports) >= 5, f"the kernel's ports did not show up: {sockets}"
        beyond_loopback = [(a, p) for a, p in sockets if a not in ("127.0.0.1", "::1")]
        assert not beyond_loopback, f"listening beyond loopback: {beyond_loopback}"
        for address in non_loopback_addresses():
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.settimeout(3)
                assert probe.connect_ex((address, lab_server.port)) != 0, (
                    f"the server answers on {address}:{lab_server.port}")
    finally:
        lab_server.api("DELETE", f"/api/kernels/{kernel['id']}")


# --------------------------------------------------------------------------------------------------
# The browser and the lesson driver
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    chromium = find_chromium()
    if chromium is None:
        skip_or_fail("Chromium is not installed (Debian: apt-get install chromium; or set WB_CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        skip_or_fail("the playwright package is not installed (pip install -e '.[test]')")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            browser.close()


class LessonFailure(AssertionError):
    """A lesson failed in the browser: a cell or a callback raised, a slider is missing or changed nothing."""


# Finds the notebook panel for `path` once its kernel is idle, and starts recording the kernel's errors.
FIND_PANEL_JS = """(path) => {
  const app = window.jupyterapp;
  if (!app) return false;
  let panel = null;
  for (const widget of app.shell.widgets('main')) {
    if (widget.context && widget.context.path === path && widget.sessionContext) panel = widget;
  }
  const kernel = panel && panel.sessionContext.session && panel.sessionContext.session.kernel;
  if (!kernel || kernel.status !== 'idle' || !panel.context.isReady) return false;
  if (!window.__wb || window.__wb.panel !== panel) {
    const state = {panel, errors: [], kernelEvents: [], commMessagesHandled: 0};
    panel.sessionContext.iopubMessage.connect((_, msg) => {
      if (msg.header.msg_type === 'error') state.errors.push(msg.content.ename + ': ' + msg.content.evalue);
      // a widget's message (a slider moved) has been handled completely, callbacks included
      if (msg.header.msg_type === 'status' && msg.content.execution_state === 'idle'
          && msg.parent_header && msg.parent_header.msg_type === 'comm_msg') state.commMessagesHandled++;
    });
    panel.sessionContext.statusChanged.connect((_, status) => {
      if (['dead', 'restarting', 'autorestarting'].includes(status)) state.kernelEvents.push(status);
    });
    window.__wb = state;
  }
  app.shell.activateById(panel.id);
  return true;
}"""

RUN_ALL_JS = """() => {
  const app = window.jupyterapp;
  app.shell.activateById(window.__wb.panel.id);
  // clear the stored outputs first, so that every prompt and output seen afterwards is from this run
  return app.commands.execute('notebook:clear-all-cell-outputs').then(() => {
    // "done" is read from the execution counts, so they must all be blank before the run starts
    const cells = window.__wb.panel.content.model.cells;
    let counted = 0;
    for (let i = 0; i < cells.length; i++) {
      if (cells.get(i).type === 'code' && cells.get(i).executionCount !== null) counted++;
    }
    if (counted === 0) app.commands.execute('notebook:run-all-cells');  // not awaited: polled from Python
    return counted;
  });
}"""

STATE_JS = """() => {
  const state = window.__wb, cells = state.panel.content.model.cells;
  let pending = 0, codeCells = 0;
  const cellErrors = [];
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type !== 'code') continue;
    codeCells++;
    if (cell.executionCount === null) pending++;
    for (let j = 0; j < cell.outputs.length; j++) {
      const output = cell.outputs.get(j).toJSON();
      if (output.output_type === 'error') {
        const first = cell.sharedModel.getSource().split('\\n')[0].slice(0, 80);
        cellErrors.push(`cell ${i + 1} (${JSON.stringify(first)}): ${output.ename}: ${output.evalue}`);
      }
    }
  }
  const kernel = state.panel.sessionContext.session && state.panel.sessionContext.session.kernel;
  return {
    pending, codeCells, cellErrors, errors: state.errors.slice(), kernelEvents: state.kernelEvents.slice(),
    commMessagesHandled: state.commMessagesHandled,
    status: kernel ? kernel.status : 'no kernel',
    dialogs: Array.from(document.querySelectorAll('.jp-Dialog')).map(d => d.innerText.slice(0, 300)),
  };
}"""

# A fingerprint of every cell's output, sliders left out (their own readout moves with them).
OUTPUT_FINGERPRINT_JS = """() => {
  let text = '';
  for (const area of window.__wb.panel.content.node.querySelectorAll('.jp-Cell-outputArea')) {
    const copy = area.cloneNode(true);
    for (const slider of copy.querySelectorAll('.widget-slider')) slider.remove();
    text += copy.innerHTML;
  }
  let hash = 2166136261;
  for (let i = 0; i < text.length; i++) { hash ^= text.charCodeAt(i); hash = Math.imul(hash, 16777619); }
  return text.length + ':' + (hash >>> 0).toString(16);
}"""

SLIDER_HANDLES = ".jp-Notebook .widget-slider .noUi-handle"


@dataclass
class LessonRun:
    """What the browser saw for one notebook."""

    path: str
    seconds_run_all: float = 0.0
    writes: list = field(default_factory=list)  # requests that would change files on the server
    sliders: list = field(default_factory=list)  # per slider: (position before, position after, seconds)


def _wait(page, condition, timeout_s: float, what: str):
    """Polls STATE_JS until `condition(state)` is true; raises LessonFailure on a kernel death or timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = page.evaluate(STATE_JS)
        if state["kernelEvents"]:
            raise LessonFailure(f"the kernel stopped ({', '.join(state['kernelEvents'])}) while {what}")
        if condition(state):
            return state
        if time.monotonic() > deadline:
            dialogs = f"; dialogs on screen: {state['dialogs']}" if state["dialogs"] else ""
            raise LessonFailure(f"timed out after {timeout_s:.0f} s while {what} "
                                f"(kernel {state['status']}, {state['pending']} cells not run){dialogs}")
        time.sleep(POLL_S)


def _raise_on_errors(state, what):
    problems = list(state["cellErrors"])
    problems += [f"kernel error: {e}" for e in state["errors"] if not any(e in c for c in state["cellErrors"])]
    if problems:
        raise LessonFailure(f"{what}:\n  " + "\n  ".join(problems))


def run_notebook_in_browser(browser, server: LabServer, notebook: Path, screenshot: Path) -> LessonRun:
    """Opens `notebook`, runs all cells, moves every slider one step; raises LessonFailure on any problem."""
    path = notebook.relative_to(server.root).as_posix()
    run = LessonRun(path)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    # saving, renaming or deleting goes through the contents API with these methods (a checkpoint is a
    # POST, and the server keeps checkpoints outside the repository)
    page.on("request", lambda request: run.writes.append(f"{request.method} {request.url.split('?')[0]}")
            if request.method in ("PUT", "PATCH", "DELETE") and "/api/contents" in request.url else None)
    try:
        # a workspace of its own, so JupyterLab does not also restore the tabs of the lesson before
        workspace = hashlib.sha1(path.encode()).hexdigest()[:12]
        page.goto(f"{server.base_url}/lab/workspaces/{workspace}/tree/{path}?token={server.token}")
        page.wait_for_function(FIND_PANEL_JS, arg=path, polling=500, timeout=KERNEL_START_TIMEOUT_S * 1000)
        page.evaluate("() => window.jupyterapp.shell.collapseLeft()")  # more room for the lesson

        started = time.monotonic()
        still_counted = page.evaluate(RUN_ALL_JS)
        assert still_counted == 0, f"{path}: clearing the outputs left {still_counted} execution counts"
        state = _wait(page, lambda s: s["status"] == "idle" and (s["pending"] == 0 or s["cellErrors"] or s["errors"]),
                      RUN_ALL_TIMEOUT_S, "running all cells")
        run.seconds_run_all = time.monotonic() - started
        _raise_on_errors(state, f"{path}: a cell raised during 'run all'")
        if state["pending"]:
            raise LessonFailure(f"{path}: {state['pending']} of {state['codeCells']} code cells did not run")

        handles = page.locator(SLIDER_HANDLES)
        if handles.count() == 0:
            raise LessonFailure(f"{path}: no slider found after running all cells")
        for index in range(handles.count()):
            run.sliders.append(_move_slider(page, handles.nth(index), f"{path}: slider {index + 1}"))

        first = handles.nth(0)
        first.evaluate("handle => handle.closest('.jp-Cell').scrollIntoView({block: 'start'})")
        page.wait_for_timeout(300)  # let the scroll settle before the picture
        page.screenshot(path=str(screenshot))
        return run
    except Exception:
        try:
            page.screenshot(path=str(screenshot.with_name(screenshot.stem + "-failed.png")))
        except Exception:  # noqa: BLE001 - the page may be gone; the original error matters more
            pass
        raise
    finally:
        context.close()
        server.shut_down_kernels()


def _move_slider(page, handle, what: str):
    """One step towards the smaller value (cheaper on the simulator), or up when already at the minimum."""
    def value():
        return float(handle.get_attribute("aria-valuenow"))

    low, high, before = (float(handle.get_attribute(a)) for a in ("aria-valuemin", "aria-valuemax", "aria-valuenow"))
    if low == high:
        raise LessonFailure(f"{what} offers a single value and cannot move")
    fingerprint = page.evaluate(OUTPUT_FINGERPRINT_JS)
    state = page.evaluate(STATE_JS)
    errors_before, handled_before = len(state["errors"]), state["commMessagesHandled"]
    handle.scroll_into_view_if_needed()
    started = time.monotonic()
    handle.press("ArrowLeft" if before > low else "ArrowRight")

    deadline, quiet_since = started + SLIDER_TIMEOUT_S, None
    while True:
        time.sleep(POLL_S)
        state = page.evaluate(STATE_JS)
        state["errors"] = state["errors"][errors_before:]
        if state["kernelEvents"]:
            raise LessonFailure(f"{what}: the kernel stopped ({', '.join(state['kernelEvents'])})")
        _raise_on_errors(state, f"{what}: its callback raised")
        idle = state["status"] == "idle"
        changed = page.evaluate(OUTPUT_FINGERPRINT_JS) != fingerprint
        if idle and changed and value() != before:
            # the kernel may go idle between two messages of one callback: require idle twice in a row
            time.sleep(2 * POLL_S)
            state = page.evaluate(STATE_JS)
            if state["status"] == "idle":
                state["errors"] = state["errors"][errors_before:]
                _raise_on_errors(state, f"{what}: its callback raised")
                return before, value(), round(time.monotonic() - started, 1)
        # the kernel has handled the slider's message and stayed idle: the output had its chance
        handled = state["commMessagesHandled"] > handled_before
        quiet_since = (quiet_since or time.monotonic()) if (idle and handled and not changed) else None
        if quiet_since is not None and time.monotonic() - quiet_since > QUIET_AFTER_CALLBACK_S:
            raise LessonFailure(f"{what} moved ({before:g} -> {value():g}) but no output changed "
                                f"within {QUIET_AFTER_CALLBACK_S:.0f} s after its callback ended")
        if value() == before and time.monotonic() - started > KEY_PRESS_TIMEOUT_S:
            raise LessonFailure(f"{what} did not move on a key press")
        if time.monotonic() > deadline:
            raise LessonFailure(f"{what}: no new output within {SLIDER_TIMEOUT_S:.0f} s "
                                f"(kernel {state['status']})")


# --------------------------------------------------------------------------------------------------
# The lessons
# --------------------------------------------------------------------------------------------------

def test_every_lesson_is_found():
    assert LESSONS, "no notebooks in notebooks/"


@pytest.mark.parametrize("notebook", LESSONS, ids=lambda p: p.stem)
def test_lesson_runs_and_its_sliders_redraw(browser, lab_server, notebook):
    run = run_notebook_in_browser(browser, lab_server, notebook, ARTIFACTS / f"{notebook.stem}.png")
    print(f"{run.path}: run all {run.seconds_run_all:.1f} s; sliders (before, after, s): {run.sliders}")
    # the committed outputs are what nbval compares: the browser run must not save over them
    assert not run.writes, f"the browser run wrote to the server's files: {run.writes}"


# --------------------------------------------------------------------------------------------------
# The detector itself: throwaway notebooks whose failures must be reported
# --------------------------------------------------------------------------------------------------

SLIDER_IMPORTS = "from wb_kernels.widgets import link_slider, sequence_length_slider\n"

BROKEN_NOTEBOOKS = {
    # the project's own wiring: the exception lands in the slider's Output area
    "callback_raises": (
        SLIDER_IMPORTS
        + "def draw(L):\n"
          "    if L != 32:\n"
          "        raise RuntimeError(f'broken on purpose at L={L}')\n"
          "    return f'L = {L}'\n"
          "link_slider(sequence_length_slider([16, 32, 64], value=32), draw)\n",
        r"(?s)its callback raised:\n.*RuntimeError: broken on purpose at L=16"),
    # an observer outside any Output area: nothing shows on the page, but the kernel publishes the error
    "bare_observer_raises": (
        SLIDER_IMPORTS
        + "slider = sequence_length_slider([16, 32, 64], value=32)\n"
          "def on_change(change):\n"
          "    raise RuntimeError('observer broken on purpose')\n"
          "slider.observe(on_change, names='value')\n"
          "slider\n",
        r"(?s)its callback raised:\n.*observer broken on purpose"),
    # a slider whose callback runs fine but redraws nothing
    "slider_changes_nothing": (
        "import ipywidgets\n"
        "ipywidgets.IntSlider(value=3, min=0, max=10)\n",
        r"moved \(3 -> 2\) but no output changed"),
    # a slider the learner cannot move (here: disabled) fails rather than waiting for the timeout
    "slider_cannot_move": (
        "import ipywidgets\n"
        "ipywidgets.IntSlider(value=3, min=0, max=10, disabled=True)\n",
        r"slider 1 did not move on a key press"),
    "cell_raises": (
        "raise ValueError('cell broken on purpose')\n",
        r"(?s)a cell raised during 'run all':\n.*ValueError: cell broken on purpose"),
    "no_slider": (
        "print('a lesson without a slider')\n",
        r"no slider found"),
}


def write_notebook(path: Path, source: str):
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(source)]
    nbformat.write(notebook, path)


@pytest.mark.parametrize("case", list(BROKEN_NOTEBOOKS))
def test_the_browser_run_reports_a_broken_notebook(browser, lab_server, case):
    source, expected = BROKEN_NOTEBOOKS[case]
    # inside the server's root (JupyterLab serves nothing outside it), in the git-ignored artifacts folder
    folder = Path(tempfile.mkdtemp(prefix="throwaway-", dir=ARTIFACTS))
    try:
        notebook = folder / f"{case}.ipynb"
        write_notebook(notebook, source)
        with pytest.raises(LessonFailure, match=expected) as reported:
            run_notebook_in_browser(browser, lab_server, notebook, folder / f"{case}.png")
        print(f"{case}: reported as {reported.value}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
