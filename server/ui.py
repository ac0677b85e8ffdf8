"""The built-in web page (``GET /``; ``--no-ui`` turns it off): a chat playground and a live
view of the cluster, as three static files of this package (``server/ui/``: plain HTML, CSS
and JavaScript written for it, no build step, nothing loaded from elsewhere).

The page talks to this server only (same origin), with the API the clients use: streamed
``POST /v1/chat/completions`` (JSON bodies, the ``x-splitserve-timing`` breakdown), ``GET
/cluster`` every two seconds (``server.cluster_view``) and, for the operator only,
``POST /workers/{id}/drain`` and ``/resume``. The files are open (they hold no data); every
call the page makes carries the API key the user typed into it (kept in the browser's local
storage), as any client's would. A Content-Security-Policy keeps the page to its own origin.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI, Response

from splitserve.server.errors import APIError

FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
         "style.css": "text/css; charset=utf-8"}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def read_files() -> dict[str, bytes]:
    """The page's files, by name, as the package ships them."""
    folder = resources.files("splitserve.server") / "ui"
    return {name: (folder / name).read_bytes() for name in FILES}


def install_ui(app: FastAPI) -> None:
    """Serve the page at ``/`` and its files at ``/ui/<name>``."""
    files = read_files()

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return Response(files["index.html"], media_type=FILES["index.html"], headers=HEADERS)

    @app.get("/ui/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in FILES:
            raise APIError(f"no file '{name}'", status_code=404)
        return Response(files[name], media_type=FILES[name], headers=HEADERS)
