"""Small helpers shared by the datagen tests."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.datagen.llama_cpp_server import command_template


def llama_server_command() -> str:
    """The local-server command template the tests (and the demo) use in place of SGLang."""
    return command_template("smollm2")


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


class EchoAuthServer:
    """A tiny OpenAI-shaped endpoint (stdlib http.server) that accepts one API key: GET /v1/models answers 200 to it,
    and everything else is a 401 whose body echoes the Authorization header it got, as some gateways do."""

    def __init__(self, good_key: str, answer_with_key: bool = False):
        """answer_with_key: a chat request with the good key gets a 200 answer that repeats the key."""
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                auth = self.headers.get("Authorization", "")
                if self.command == "GET" and self.path == "/v1/models" and auth == f"Bearer {good_key}":
                    return self._answer(200, {"object": "list", "data": [{"id": "echo-model"}]})
                if answer_with_key and self.command == "POST" and auth == f"Bearer {good_key}":
                    return self._answer(200, {"choices": [{"message": {"role": "assistant", "content":
                                                           f"Your key is {good_key}, twice: {good_key}."},
                                                           "finish_reason": "stop"}],
                                              "usage": {"prompt_tokens": 5, "completion_tokens": 9}})
                self._answer(401, {"error": {"message": f"invalid credentials; you sent Authorization: {auth}",
                                             "key_seen": auth.removeprefix("Bearer ")}})

            do_GET = do_POST = _handle

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "EchoAuthServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def assert_not_in_files(folder: Path, *secrets: str) -> int:
    """No secret in any file under `folder`; returns how many files were checked."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    for p in files:
        data = p.read_bytes()
        for s in secrets:
            assert s.encode() not in data, f"{s[:6]}... found in {p}"
    return len(files)
