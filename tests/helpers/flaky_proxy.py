"""A TCP proxy on 127.0.0.1 in front of a test server, for transient and fatal network faults.

``FlakyProxy(target_port, drop_first=n)`` closes the first ``n`` connections it accepts as soon as they send
something (the client sees a reset / a connection closed before any answer: a transient failure), and relays
every later one. ``die_after=m`` makes it relay ``m`` connections' worth of requests, then close every
connection and stop listening (a server that died mid-load); ``stall_after_bytes=m`` relays ``m`` bytes of
answers, then holds every connection open without relaying anything more (a server that hangs). Threads
only; :meth:`close` stops it.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class FlakyProxy:
    def __init__(
        self,
        target_port: int,
        drop_first: int = 0,
        die_after_bytes: int | None = None,
        stall_after_bytes: int | None = None,
    ) -> None:
        self.target = ("127.0.0.1", target_port)
        self.drop_first = drop_first
        self.die_after_bytes = die_after_bytes
        self.stall_after_bytes = stall_after_bytes
        self.accepted = 0
        self.dropped = 0
        self.relayed_bytes = 0
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                drop = self.accepted <= self.drop_first
            if drop:
                self.dropped += 1
                with contextlib.suppress(OSError):
                    client.recv(65536)
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, counted: bool = False) -> None:
        try:
            while chunk := src.recv(65536):
                if counted and self._stalled():
                    self._closed.wait()  # hold the connection: nothing more is relayed until close()
                    return
                dst.sendall(chunk)
                if counted:
                    with self._lock:
                        self.relayed_bytes += len(chunk)
                        dying = self.die_after_bytes is not None and self.relayed_bytes >= self.die_after_bytes
                    if dying:
                        self.close()
                        return
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _stalled(self) -> bool:
        with self._lock:
            return self.stall_after_bytes is not None and self.relayed_bytes >= self.stall_after_bytes

    def close(self) -> None:
        """Stop listening and close every relayed connection."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
