"""A TCP proxy on its own thread, to freeze or cut a real connection to a real server."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target. `pause()` stops forwarding in both directions (bytes
    wait in the socket buffers, as on a stalled network); `hold_on(marker)` does the same to one
    connection only, the first whose client sends `marker`, from those bytes on; `resume()` ends
    both. `cut()` resets every open connection and refuses new ones until `restore()`.

    With `tls`, it terminates TLS with that server context and forwards plain bytes: a TLS
    listener in front of a server that has none. `postgres=True` speaks PostgreSQL's way into TLS
    (an SSLRequest answered with `S`, then the handshake) and drops clients that do not ask."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        tls: ssl.SSLContext | None = None,
        postgres: bool = False,
    ) -> None:
        self._target = (target_host, target_port)
        self._tls = tls
        self._postgres = postgres
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="tcp-proxy"
        )
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._refusing = False
        self._connections: set[asyncio.StreamWriter] = set()
        self.port = 0
        self.accepted = 0
        self.tripped = 0
        self._trip: tuple[bytes, Callable[[], None]] | None = None
        self._hold: bytes | None = None
        self._holding: list[asyncio.Event] = []  # the held connections' own flow
        #: How many connections `hold_on` stopped (each holds the marker's bytes unsent).
        self.held = 0

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        self.port = self._call(self._start())
        return self

    def __exit__(self, *_: object) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def pause(self) -> None:
        self._call(self._set_flowing(False))

    def resume(self) -> None:
        self._call(self._set_flowing(True))

    def hold_on(self, marker: bytes) -> None:
        """Stall the first connection whose client sends bytes containing `marker`, both ways,
        before forwarding those bytes (the other connections flow), until `resume()`: one AMQP
        connection of several stalled, as by a link or a broker's flow control."""
        self._hold = marker

    def cut(self) -> None:
        self._call(self._cut())

    def restore(self) -> None:
        self._refusing = False

    def trip_on(self, marker: bytes, action: Callable[[], None]) -> None:
        """When a client sends bytes containing `marker`, call `action` (on the proxy's thread)
        and reset that connection without forwarding them: the peer never sees that data."""
        self._trip = (marker, action)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _start(self) -> int:
        self._flowing = asyncio.Event()
        self._flowing.set()
        direct = self._tls if not self._postgres else None
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=direct)
        return int(self._server.sockets[0].getsockname()[1])

    async def _stop(self) -> None:
        await self._cut()
        if self._server is not None:
            self._server.close()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _set_flowing(self, flowing: bool) -> None:
        assert self._flowing is not None
        if flowing:
            self._flowing.set()
            for held in self._holding:
                held.set()
            self._holding.clear()
        else:
            self._flowing.clear()

    async def _cut(self) -> None:
        self._refusing = True
        for writer in list(self._connections):
            transport = writer.transport
            if hasattr(transport, "abort"):
                transport.abort()  # RST, like a crashed peer or a dropped route
        self._connections.clear()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self._refusing:
            client_w.transport.abort()
            return
        self.accepted += 1
        if (
            self._postgres
            and self._tls is not None
            and not await self._postgres_tls(client_r, client_w)
        ):
            return
        try:
            server_r, server_w = await asyncio.open_connection(*self._target)
        except OSError:
            client_w.transport.abort()
            return
        self._connections.update((client_w, server_w))
        mine = asyncio.Event()  # this connection's own flow (`hold_on`)
        mine.set()
        await asyncio.gather(
            self._pump(client_r, server_w, mine, watch=client_w),
            self._pump(server_r, client_w, mine),
            return_exceptions=True,
        )
        for writer in (client_w, server_w):
            self._connections.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def _postgres_tls(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> bool:
        """Answer the client's SSLRequest and upgrade the connection; False if it did not ask
        (it would talk in clear) or the handshake failed."""
        assert self._tls is not None
        try:
            request = await client_r.readexactly(8)
        except (asyncio.IncompleteReadError, OSError):
            client_w.transport.abort()
            return False
        if struct.unpack("!ii", request) != (8, 80877103):  # not an SSLRequest
            client_w.transport.abort()
            return False
        client_w.write(b"S")
        await client_w.drain()
        try:
            await client_w.start_tls(self._tls)
        except (ssl.SSLError, OSError):
            client_w.transport.abort()
            return False
        return True

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        mine: asyncio.Event,
        watch: asyncio.StreamWriter | None = None,
    ) -> None:
        assert self._flowing is not None
        tail = b""
        held_tail = b""
        while True:
            await self._flowing.wait()
            await mine.wait()
            data = await reader.read(65536)
            if not data:
                break
            if watch is not None and self._trip is not None:
                marker, action = self._trip
                if marker in tail + data:  # the marker may straddle two reads
                    self.tripped += 1
                    action()
                    watch.transport.abort()
                    writer.transport.abort()
                    return
                tail = (tail + data)[-len(marker) :]
            if watch is not None and self._hold is not None:
                if self._hold in held_tail + data:
                    self._hold = None  # one connection
                    self.held += 1
                    mine.clear()
                    self._holding.append(mine)
                held_tail = (held_tail + data)[-len(self._hold or b"") :] if self._hold else b""
            await self._flowing.wait()
            await mine.wait()
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(Exception):
            writer.write_eof()
