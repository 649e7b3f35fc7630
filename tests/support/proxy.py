"""A TCP proxy on its own thread, to freeze or cut a real connection to a real server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _reading(writer: asyncio.StreamWriter, on: bool) -> None:
    """Resume or pause reading the socket under `writer` (its stream's reader shares it)."""
    transport = writer.transport
    if isinstance(transport, asyncio.ReadTransport):
        if on:
            transport.resume_reading()
        else:
            transport.pause_reading()


@dataclasses.dataclass
class _Reply:
    """How many bytes the target has sent on one connection since its client last sent any: the
    reply under way."""

    size: int = 0


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target. `pause()` stops forwarding in both directions (bytes
    wait in the socket buffers, as on a stalled network); `hold_on(marker)` does the same to one
    connection only, the first whose client sends `marker`, from those bytes on; `stop_replies()`
    stops only the target's side (a client that stops reading); `resume()` ends all three.
    `cut()` resets every open connection and refuses new ones until `restore()`.
    `upstream_ports()` are the local ports of the connections to the target (PostgreSQL's
    pg_stat_activity.client_port).

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
        self._replies: asyncio.Event | None = None  # set: the target's bytes are forwarded
        self._stop_after: int | None = None  # stop_replies(longer_than=…) is armed
        self._upstreams: set[asyncio.StreamWriter] = set()
        #: Set once `stop_replies` took effect; `replies_stopped_at` is when it last did
        #: (time.monotonic()).
        self.replies_stopped = threading.Event()
        self.replies_stopped_at: float | None = None

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

    def stop_replies(self, *, longer_than: int | None = None) -> None:
        """Stop reading what the target sends, on every connection (new ones too), while what
        clients send still reaches it: the target's writes fill the socket buffers, then block,
        as when the client process stops reading. At once; or, with `longer_than`, from the first
        reply (what the target sent on a connection since its client last sent) that grows past
        that many bytes — the rest of that reply is held. `replies_stopped` tells when. Until
        `resume()`."""
        self._call(self._stop_replies(longer_than))

    def upstream_ports(self) -> list[int]:
        """The local ports of the open connections to the target."""
        return self._call(self._upstream_ports())

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
        self._replies = asyncio.Event()
        self._replies.set()
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
        assert self._replies is not None
        if flowing:
            self._flowing.set()
            for held in self._holding:
                held.set()
            self._holding.clear()
            self._stop_after = None
            if not self._replies.is_set():
                self._replies.set()
                for upstream in self._upstreams:
                    _reading(upstream, True)
        else:
            self._flowing.clear()

    async def _stop_replies(self, longer_than: int | None) -> None:
        if longer_than is None:
            self._halt_replies()
        else:
            self._stop_after = longer_than

    def _halt_replies(self) -> None:
        assert self._replies is not None
        self._stop_after = None
        self._replies.clear()
        for upstream in self._upstreams:
            _reading(upstream, False)  # not even into the proxy's own buffers
        self.replies_stopped_at = time.monotonic()
        self.replies_stopped.set()

    async def _upstream_ports(self) -> list[int]:
        return sorted(int(w.get_extra_info("sockname")[1]) for w in self._upstreams)

    async def _cut(self) -> None:
        self._refusing = True
        for writer in list(self._connections):
            transport = writer.transport
            if hasattr(transport, "abort"):
                transport.abort()  # RST, like a crashed peer or a dropped route
        self._connections.clear()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        # A handler cancelled as the proxy stops ends quietly: asyncio's stream callback (3.11)
        # reports a cancelled handler as an error in a callback.
        with contextlib.suppress(asyncio.CancelledError):
            await self._serve(client_r, client_w)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
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
        self._upstreams.add(server_w)
        assert self._replies is not None
        if not self._replies.is_set():
            _reading(server_w, False)
        mine = asyncio.Event()  # this connection's own flow (`hold_on`)
        mine.set()
        reply = _Reply()
        await asyncio.gather(
            self._pump(client_r, server_w, mine, watch=client_w, reply=reply),
            self._pump(server_r, client_w, mine, reply=reply, replying=True),
            return_exceptions=True,
        )
        self._upstreams.discard(server_w)
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
        reply: _Reply | None = None,
        replying: bool = False,
    ) -> None:
        """Forward `reader` to `writer`: from the client (`watch` is its writer) or, `replying`,
        from the target (counting the reply's size in `reply`, which the client's side resets)."""
        assert self._flowing is not None
        assert self._replies is not None
        tail = b""
        held_tail = b""
        while True:
            await self._flowing.wait()
            await mine.wait()
            if replying:
                await self._replies.wait()
            data = await reader.read(65536)
            if not data:
                break
            if reply is not None:
                reply.size = reply.size + len(data) if replying else 0
                if replying and self._stop_after is not None and reply.size > self._stop_after:
                    self._halt_replies()
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
            if replying:
                await self._replies.wait()
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(Exception):
            writer.write_eof()
