"""A tiny fault-injecting HTTP proxy (stdlib asyncio) for the datagen fault tests.

It sits between the client and the REAL server. For each request a policy picks an action:
"ok" forwards it, "429"/"500"/"400" answer with that status, "drop" closes the connection
without an answer, "stall" holds the connection open without answering. One request per
connection (it asks the upstream for `Connection: close` and relays until EOF).
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Callable


class FaultProxy:
    def __init__(self, upstream_port: int, policy: Callable[[int, bytes], str], stall_s: float = 60.0):
        self.upstream_port = upstream_port
        self.policy = policy
        self.stall_s = stall_s
        self.actions: list[str] = []
        self.auth_headers: list[str] = []
        self.port = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _shutdown(self):
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _run(self):
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {}
            for h in lines[1:]:
                if ":" in h:
                    k, v = h.split(":", 1)
                    headers[k.strip().lower()] = v.strip()
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            self.auth_headers.append(headers.get("authorization", ""))
            action = self.policy(len(self.actions), body)
            self.actions.append(action)
            if action == "drop":
                return
            if action == "stall":
                await asyncio.sleep(self.stall_s)
                return
            if action in ("429", "500", "400"):
                payload = json.dumps({"error": {"message": f"injected {action}", "type": "injected"}}).encode()
                writer.write(f"HTTP/1.1 {action} Injected\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(payload)}\r\nRetry-After: 0\r\nConnection: close\r\n\r\n".encode()
                             + payload)
                await writer.drain()
                return
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            fwd = [lines[0]] + [h for h in lines[1:] if h and not h.lower().startswith(("connection:", "host:"))]
            fwd += [f"Host: 127.0.0.1:{self.upstream_port}", "Connection: close"]
            up_w.write(("\r\n".join(fwd) + "\r\n\r\n").encode("latin-1") + body)
            await up_w.drain()
            while chunk := await up_r.read(65536):
                writer.write(chunk)
                await writer.drain()
            up_w.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
