"""A server speaking the GCS JSON API on 127.0.0.1, for the gs:// tests.

It is gcp-storage-emulator (PyPI) in this process, with what that emulator lacks and the
clients here rely on added to its request handlers: the object generation in download headers
(`x-goog-generation`; TensorStore reads it) and the generation preconditions
(`ifGenerationMatch`, `ifGenerationNotMatch`: 412 / 304), with which TensorStore's OCDBT
commits its manifests and a create-if-absent fails when the object exists. Nothing on the
client side is replaced: Orbax / TensorStore, gcsfs (etils.epath) and google-cloud-storage
talk HTTP to it, pointed there by `TENSORSTORE_GCS_HTTP_URL` and `STORAGE_EMULATOR_HOST`.
"""

from __future__ import annotations

import http.server
import os
import socket
import threading
import time
import types
from http import HTTPStatus

BUCKET = "realm-test"
SLOW_UPLOADS = {}   # object-name part -> seconds each upload of a matching object takes


class _HTTPServer(http.server.ThreadingHTTPServer):
  """One thread per connection, as a real endpoint serves (with one, a client that keeps its
  connection open starves the others), with the open connections known so that an outage cuts
  them as well as refusing new ones."""
  daemon_threads = True

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.connections, self.lock = set(), threading.Lock()

  def process_request(self, request, client_address):
    with self.lock:
      self.connections.add(request)
    super().process_request(request, client_address)

  def shutdown_request(self, request):
    with self.lock:
      self.connections.discard(request)
    super().shutdown_request(request)

  def handle_error(self, request, client_address):
    import sys
    if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
      return   # a client that went away (a killed builder, a connection cut by an outage)
    super().handle_error(request, client_address)

  def cut(self) -> None:
    with self.lock:
      open_ = list(self.connections)
    for connection in open_:
      try:
        connection.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _precondition(handler):
  """`handler` after the request's generation preconditions hold (else 412 or 304)."""
  from gcp_storage_emulator.exceptions import NotFound

  def checked(req, response, store, *args, **kwargs):
    query = req.query
    match, not_match = query.get("ifGenerationMatch"), query.get("ifGenerationNotMatch")
    if match or not_match:
      bucket, name = req.params.get("bucket_name"), _object_name(req)
      try:
        current = int(store.get_file_obj(bucket, name)["generation"])
      except (NotFound, KeyError, TypeError):
        current = 0   # absent: generation 0 (ifGenerationMatch=0: create only)
      if match and int(match[0]) != current:
        response.status = HTTPStatus.PRECONDITION_FAILED
        response.json({"error": {"code": 412, "message": "Precondition Failed"}})
        return None
      if not_match and int(not_match[0]) == current:
        response.status = HTTPStatus.NOT_MODIFIED
        return None
    return handler(req, response, store, *args, **kwargs)
  return checked


def _object_name(req):
  name = req.params.get("object_id") or (req.query.get("name") or [None])[0]
  if name is None and (req.query.get("uploadType") or [""])[0] == "multipart":
    name = req.data["meta"].get("name")   # named in the metadata part
  return name


_STORE_LOCK = threading.RLock()   # re-entrant: the batch handler calls the others


def _one_at_a_time(handler):
  """`handler` holding the store's lock: the emulator's in-memory store is not thread-safe
  (one thread serialising its metadata while another adds an object raised "dictionary
  changed size during iteration" mid-request, the client saw the connection drop, and its
  retry of the finished resumable upload got a 404), and a real bucket serves each request
  whole."""
  def locked(req, response, store, *args, **kwargs):
    with _STORE_LOCK:
      return handler(req, response, store, *args, **kwargs)
  return locked


def _slow(insert):
  """Uploads of objects named in SLOW_UPLOADS take that long (a slow link to the bucket; the
  wait holds no lock, so other requests are served meanwhile)."""
  def handler(req, response, store, *args, **kwargs):
    name = _object_name(req) or ""
    delay = max([s for part, s in SLOW_UPLOADS.items() if part in name], default=0.0)
    time.sleep(delay)
    return insert(req, response, store, *args, **kwargs)
  return handler


def _with_generation_headers(download):
  def handler(req, response, store, *args, **kwargs):
    from gcp_storage_emulator.exceptions import NotFound
    try:
      obj = store.get_file_obj(req.params["bucket_name"], req.params["object_id"])
      response["x-goog-generation"] = str(obj["generation"])
      response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
    except NotFound:
      pass
    return download(req, response, store, *args, **kwargs)
  return handler


def _patch_handlers() -> None:
  """Once per process: the handlers above into the emulator's routing table."""
  from gcp_storage_emulator import server
  from gcp_storage_emulator.handlers import objects
  if getattr(objects, "_realm_patched", False):
    return
  insert, download, get, delete = objects.insert, objects.download, objects.get, objects.delete
  checked_download = _precondition(_with_generation_headers(download))
  checked_get = _precondition(get)

  def get_or_download(req, response, store, *args, **kwargs):   # ?alt=media is a download
    if req.query.get("alt") and req.query.get("alt")[0] == "media":
      return checked_download(req, response, store, *args, **kwargs)
    return checked_get(req, response, store, *args, **kwargs)
  new = {insert: _slow(_one_at_a_time(_precondition(insert))),
         download: _one_at_a_time(checked_download), get: _one_at_a_time(get_or_download),
         delete: _one_at_a_time(_precondition(delete))}
  for _, handlers in server.HANDLERS:
    for method, fn in list(handlers.items()):
      handlers[method] = new[fn] if fn in new else _one_at_a_time(fn)
  objects.insert = new[insert]   # the server also looks it up by name for bare POST uploads
  server.server = types.SimpleNamespace(HTTPServer=_HTTPServer)
  objects._realm_patched = True


class GcsServer:
  """The server on a free port with bucket BUCKET; `env` are the variables that point the
  clients at it (set them before the clients are first used)."""

  def __init__(self):
    from gcp_storage_emulator.server import create_server
    _patch_handlers()
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self._server = create_server("127.0.0.1", self.port, in_memory=True,
                                 default_bucket=BUCKET)
    self._server.start()
    # The server takes no credentials and speaks only the JSON API: gcsfs anonymous
    # (FSSPEC_GS_TOKEN) and without its gRPC bucket-type probe (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT,
    # read when gcsfs is imported), google-auth not looking for a GCE metadata server.
    self.env = {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
                "GOOGLE_CLOUD_PROJECT": "realm-test", "FSSPEC_GS_TOKEN": "anon",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "NO_GCE_CHECK": "true"}

  def stop(self) -> None:
    self._server.stop()

  def go_down(self) -> None:
    """Unreachable: new connections refused, open ones cut; the stored objects are kept."""
    api = self._server._api
    api.join()
    api._httpd.cut()

  def come_back(self) -> None:
    """Serves again on the same port, with the same objects."""
    from gcp_storage_emulator.server import APIThread
    old = self._server._api
    self._server._api = APIThread(old._host, old._port, old._storage, daemon=True)
    self._server.start()

  def down_for(self, seconds: float) -> threading.Thread:
    """Goes down now and comes back after `seconds` (in a thread, returned)."""
    self.go_down()
    thread = threading.Timer(seconds, self.come_back)
    thread.start()
    return thread


def start_or_skip_reason() -> tuple[GcsServer | None, str]:
  """(server, "") or (None, why it cannot start here)."""
  import importlib.util
  missing = [m for m in ("gcp_storage_emulator", "gcsfs") if importlib.util.find_spec(m) is None]
  if missing:
    return None, f"the GCS emulator needs {', '.join(missing)} (pip install -e '.[test]')"
  try:
    server = GcsServer()
  except OSError as e:
    return None, f"the GCS emulator did not start on 127.0.0.1: {e}"
  os.environ.update(server.env)
  # fsspec reads FSSPEC_* variables when it is imported (long before, in a test process);
  # the child processes the tests start read them from the environment above.
  import fsspec
  fsspec.config.conf.setdefault("gs", {})["token"] = "anon"
  return server, ""
