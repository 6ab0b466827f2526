"""Key-value stores used only to bootstrap a group (never on the data path).

Like torch.distributed's ``Store``: ``set``/``get``/``add``/``wait``/
``delete``. Transports exchange addresses, segment names and the like
through a store before any collective runs. Every blocking call takes a
timeout in seconds and raises [`CollectiveTimeout`][gradcoll.errors.CollectiveTimeout].

* [`HashStore`][gradcoll.store.HashStore]: threads of one process.
* [`TCPStore`][gradcoll.store.TCPStore]: a small key-value server (run by rank 0, bound to
  127.0.0.1 unless told otherwise) and its clients. Requests and responses
  are length-prefixed frames (below); the server answers a malformed or
  oversized request with an error and drops the connection.
* [`FileStore`][gradcoll.store.FileStore]: processes that share a file system; an append-only
  log guarded by ``flock``.

TCPStore wire format: a frame is ``u32 big-endian length`` + payload.
Request payload: ``u8 op`` then fields, strings and blobs as ``u32 length``
+ bytes (little-endian): SET key value | GET key u32 timeout_ms | ADD key
i64 amount | CHECK u32 n, n keys | DELETE key | HELLO magic ``GCST`` u16
version. Response payload: ``u8 status`` (0 ok, 1 timeout, 2 error) then
GET: value | ADD: i64 | CHECK, DELETE: u8 | HELLO: magic, version | error:
message. A client greets the server with HELLO as soon as it connects, so a
client that reached some other program (a web server, another job's store)
says so at once instead of waiting for its timeout.

Modules: ``base`` (``Store``, ``PrefixStore``), ``hash``, ``tcp`` (the
client), ``_server`` (the server and the request codec), ``file``.
"""

from __future__ import annotations

# Constants of the wire format, importable from here as before the split.
from ._server import MAX_FRAME as MAX_FRAME
from ._server import STORE_MAGIC as STORE_MAGIC
from ._server import STORE_VERSION as STORE_VERSION
from .base import PrefixStore, Store
from .file import FileStore
from .hash import HashStore
from .tcp import GREETING_TIMEOUT as GREETING_TIMEOUT  # read by TCPStore in gradcoll.store.tcp: patch it there
from .tcp import TCPStore

__all__ = ["Store", "HashStore", "PrefixStore", "TCPStore", "FileStore"]
