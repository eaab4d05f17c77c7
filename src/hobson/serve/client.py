"""Asking a running server (``ask --server``), with the standard library alone.

``server`` is a URL (``http://host:port``), a server's address file, or a run directory whose
``serve/address.json`` a Slurm serve job wrote; the token comes from ``token_file``, else
``$HOBSON_SERVE_TOKEN``, else the address file's ``token_file``.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hobson.errors import HobsonError

ADDRESS = Path("serve") / "address.json"  # inside a run directory
TOKEN_ENV = "HOBSON_SERVE_TOKEN"


def resolve(server: str) -> tuple[str, str | None]:
    """``(base URL, token file or None)`` for a URL, an address file or a run directory."""
    if server.startswith(("http://", "https://")):
        return server.rstrip("/"), None
    path = Path(server)
    address = path / ADDRESS if path.is_dir() else path
    if not address.is_file():
        raise HobsonError(f"--server {server}: not a URL (http://host:port), and no server address at {address} "
                          "(is the serve job running? `python launch/submit.py status RUN` says)")
    try:
        data = json.loads(address.read_text(encoding="utf-8"))
        return str(data["url"]).rstrip("/"), data.get("token_file")
    except (ValueError, KeyError, TypeError) as e:
        raise HobsonError(f"{address}: not a server address file ({e})") from None


def _token(token_file: str | None, recorded: str | None) -> str | None:
    if token_file:
        return Path(token_file).read_text(encoding="utf-8").strip()
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if recorded and Path(recorded).is_file():
        return Path(recorded).read_text(encoding="utf-8").strip()
    return None


def request(url: str, body: Any = None, token: str | None = None, timeout_s: float = 120.0) -> Any:
    """GET (no body) or POST JSON; the decoded answer, or one :class:`HobsonError` saying why not."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", e.reason)
        except ValueError:
            message = e.reason
        raise HobsonError(f"{url}: HTTP {e.code}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise HobsonError(f"{url}: cannot reach the server ({reason})") from None


def ask_server(server: str, rows: Sequence[dict[str, Any]], token_file: str | None = None) -> list[list[float]]:
    """The server's probabilities for ``rows`` (corpus rows), in order."""
    base, recorded = resolve(server)
    questions = [{k: r[k] for k in ("state", "instructions", "options", "kind")} for r in rows]
    answer = request(f"{base}/v1/decide", {"questions": questions}, _token(token_file, recorded))
    return [a["probabilities"] for a in answer["answers"]]
