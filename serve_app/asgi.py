"""The ingress as a plain ASGI app, without Serve: the same `Ingress` class, the same routes and answers.

Built at the ASGI lifespan's startup, on the server's own event loop, and closed at its
shutdown. With the in-process cluster (local_cluster.py) the whole request path runs in one
process — what the HTTP tests drive through Starlette's TestClient:

    with TestClient(IngressApp(config, LocalClusterSpec())) as client:
        client.post("/v1/messages", json=...)

Like Serve's proxy, it cancels a request's call when the client leaves before its answer (once
the body is read: until then the ingress itself is reading). `Replicas` runs several ingress
replicas on one loop, sharing one in-process cluster, and deals requests to them in turn (or to
the one the `x-zq-replica` header names: tests and benchmarks choose the split). Serve's own
routing and direct ingress are not here; `build_app` is the way to serve.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from serve_app.app import Ingress
from serve_app.cluster import ClusterSpec
from serve_app.config import IngressConfig


class _BodyReceiver:
    """The request's `receive`, for the ingress to read its body with; once the body is read, `until_disconnect`
    reads on, and returns when the client goes (a server then has nothing else to tell)."""

    def __init__(self, receive, *, is_bodiless: bool) -> None:
        self._receive = receive
        self._is_read = asyncio.Event()
        if is_bodiless:  # nobody reads it: what comes first may as well be read here
            self._is_read.set()

    async def receive(self):
        message = await self._receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._is_read.set()
        return message

    async def until_disconnect(self) -> None:
        await self._is_read.wait()
        while (await self._receive())["type"] != "http.disconnect":
            pass


class IngressApp:
    def __init__(self, config: IngressConfig, cluster: ClusterSpec) -> None:
        self.config, self.cluster = config, cluster
        self.ingress: Ingress | None = None  # the deployment's class itself, once started
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, which the ingress runs on

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if self.ingress is None:
            raise RuntimeError("IngressApp serves requests only between its lifespan's startup and shutdown")
        body = _BodyReceiver(receive, is_bodiless=scope["method"] in ("GET", "HEAD", "OPTIONS"))
        handler = asyncio.ensure_future(self.ingress(Request(scope, body.receive)))
        watcher = asyncio.ensure_future(body.until_disconnect())
        try:
            await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not handler.done():  # the client left before its answer: as Serve's proxy does, cancel the call
            handler.cancel()
            await asyncio.wait({handler})
            return
        await handler.result()(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        await _lifespan(receive, send, self.startup, self.shutdown)

    async def startup(self) -> None:
        """Build the ingress on the running loop, as Serve builds a replica: `__new__`, then its async `__init__`."""
        self.loop = asyncio.get_running_loop()
        cls = Ingress.func_or_class
        ingress = cls.__new__(cls)
        await ingress.__init__(self.config, self.cluster)
        self.ingress = ingress

    async def shutdown(self) -> None:
        if self.ingress is not None:
            closing = self.ingress.__del__()  # as Serve stops a replica
            if closing is not None:
                await closing
            self.ingress = None


class Replicas:
    """Several `IngressApp`s on one event loop, as one ASGI app: requests dealt in turn, or to the one whose
    index the `x-zq-replica` header names. Their clusters should share a `LocalNode` (local_cluster.py)."""

    HEADER = b"x-zq-replica"

    def __init__(self, apps: list[IngressApp]) -> None:
        self.apps = apps
        self._next = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        named = dict(scope.get("headers") or ()).get(self.HEADER)
        if named is not None:
            index = int(named) % len(self.apps)
        else:
            index, self._next = self._next, (self._next + 1) % len(self.apps)
        await self.apps[index](scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        await _lifespan(receive, send, self._startup, self._shutdown)

    async def _startup(self) -> None:
        for app in self.apps:
            await app.startup()

    async def _shutdown(self) -> None:
        for app in self.apps:
            await app.shutdown()


async def _lifespan(receive, send, startup, shutdown) -> None:
    """The ASGI lifespan protocol: `await startup()` when the server starts, `await shutdown()` when it stops."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await startup()
            except Exception as e:
                await send({"type": "lifespan.startup.failed", "message": f"{type(e).__name__}: {e}"})
                raise
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return
