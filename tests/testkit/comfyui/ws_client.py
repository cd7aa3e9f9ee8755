"""A websocket client for ComfyUI's /ws: websocket-client when installed (and
LORA_RUNTIME_IT_WS is not "builtin"), else a minimal RFC 6455 client built in here."""
from __future__ import annotations

import base64
import hashlib
import os
import socket
import time


class _BuiltinWebSocket:
    """Just enough of a websocket client for ComfyUI's /ws: unmasked server frames
    (text, binary, continuation, ping, close), masked client frames (pong, close)."""

    GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

    def __init__(self, host: str, port: int, path: str, timeout: float):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        req = (f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
        self.sock.sendall(req.encode())
        self._buf = b""
        deadline = time.monotonic() + timeout
        while b"\r\n\r\n" not in self._buf:
            if len(self._buf) > 65536 or not self._fill(deadline):
                raise ConnectionError("websocket handshake: no complete answer from the server")
        head, self._buf = self._buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        if " 101 " not in lines[0] + " ":
            raise ConnectionError(f"websocket handshake refused: {lines[0]!r}")
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        want = base64.b64encode(hashlib.sha1((key + self.GUID).encode()).digest()).decode()
        if headers.get("sec-websocket-accept") != want:
            raise ConnectionError("websocket handshake: bad Sec-WebSocket-Accept")
        self._fragments: list[bytes] = []
        self._frag_opcode = 0

    def _fill(self, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self.sock.settimeout(remaining)
        try:
            chunk = self.sock.recv(65536)
        except (socket.timeout, TimeoutError):
            return False
        if not chunk:
            raise ConnectionError("websocket closed by the server")
        self._buf += chunk
        return True

    def _frame(self):
        """One complete frame from the buffer, or None (buffer untouched)."""
        b = self._buf
        if len(b) < 2:
            return None
        fin, opcode, masked, n = b[0] & 0x80, b[0] & 0x0F, b[1] & 0x80, b[1] & 0x7F
        pos = 2
        if n == 126:
            if len(b) < 4:
                return None
            n, pos = int.from_bytes(b[2:4], "big"), 4
        elif n == 127:
            if len(b) < 10:
                return None
            n, pos = int.from_bytes(b[2:10], "big"), 10
        mask = b""
        if masked:
            if len(b) < pos + 4:
                return None
            mask, pos = b[pos:pos + 4], pos + 4
        if len(b) < pos + n:
            return None
        payload = b[pos:pos + n]
        if masked:
            payload = bytes(c ^ mask[i % 4] for i, c in enumerate(payload))
        self._buf = b[pos + n:]
        return bool(fin), opcode, payload

    def _send(self, opcode: int, payload: bytes = b"") -> None:
        mask = os.urandom(4)
        n = len(payload)
        head = bytes([0x80 | opcode])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 65536:
            head += bytes([0x80 | 126]) + n.to_bytes(2, "big")
        else:
            head += bytes([0x80 | 127]) + n.to_bytes(8, "big")
        self.sock.sendall(head + mask + bytes(c ^ mask[i % 4] for i, c in enumerate(payload)))

    def recv(self, timeout: float):
        """The next message (str for text, bytes for binary), or None after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            frame = self._frame()
            if frame is None:
                if not self._fill(deadline):
                    return None
                continue
            fin, opcode, payload = frame
            if opcode == 0x9:  # ping
                self._send(0xA, payload)
            elif opcode == 0x8:
                raise ConnectionError("websocket closed by the server")
            elif opcode in (0x0, 0x1, 0x2):
                if opcode:
                    self._frag_opcode, self._fragments = opcode, []
                self._fragments.append(payload)
                if fin:
                    data = b"".join(self._fragments)
                    self._fragments = []
                    return data.decode("utf-8") if self._frag_opcode == 0x1 else data

    def close(self) -> None:
        try:
            self._send(0x8, (1000).to_bytes(2, "big"))
        except OSError:
            pass
        self.sock.close()


class _LibWebSocket:
    """websocket-client behind the same recv(timeout) / close() interface."""

    def __init__(self, host: str, port: int, path: str, timeout: float):
        import websocket  # websocket-client

        self._exc = websocket.WebSocketTimeoutException
        self.ws = websocket.create_connection(f"ws://{host}:{port}{path}", timeout=timeout,
                                              http_no_proxy=[host])  # never through a proxy

    def recv(self, timeout: float):
        self.ws.settimeout(max(timeout, 0.001))
        try:
            return self.ws.recv()
        except (self._exc, socket.timeout, TimeoutError):
            return None

    def close(self) -> None:
        self.ws.close()


def open_websocket(host: str, port: int, path: str, timeout: float = 30.0):
    if os.environ.get("LORA_RUNTIME_IT_WS", "").lower() != "builtin":
        try:
            import websocket  # noqa: F401
            if hasattr(websocket, "create_connection"):
                return _LibWebSocket(host, port, path, timeout)
        except ImportError:
            pass
    return _BuiltinWebSocket(host, port, path, timeout)
