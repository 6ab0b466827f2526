"""``python -m gradcoll.sync --store DIR [--host H] [--port P]``: run a standalone sync server."""

from .grpc_server import main

if __name__ == "__main__":
    main()
