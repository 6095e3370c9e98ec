"""The CLI's side of the daemon API: call the running daemon (or start one) with the token."""

from __future__ import annotations

from typing import Any

import httpx

from orchestrator.common.errors import RuntimeFailure, UserError
from orchestrator.control import auth
from orchestrator.control import discovery
from orchestrator.control.discovery import running_daemon_url, start_daemon_in_background

class DaemonClient:
    """Thin HTTP client; every error becomes one line (UserError)."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.token = token or auth.read_token() or ""
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers={"Authorization": f"Bearer {self.token}"},
                                  verify=discovery.verify())

    @classmethod
    def connect(cls, start: bool = False) -> DaemonClient:
        url = running_daemon_url()
        if url is None:
            if not start:
                raise RuntimeFailure("no daemon is running; start one with `spotctl daemon` "
                                     "(or `spotctl up` starts it)")
            url = start_daemon_in_background()
        return cls(url)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise RuntimeFailure(f"daemon at {self.url} unreachable: {err}") from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            if r.status_code >= 500:  # the daemon failed, not the input
                raise RuntimeFailure(f"daemon error ({r.status_code}): {detail}")
            raise UserError(str(detail))
        return r.json() if r.content else None

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, **kw: Any) -> Any:
        return self.request("POST", path, **kw)

    def delete(self, path: str, **kw: Any) -> Any:
        return self.request("DELETE", path, **kw)

    def stream_lines(self, path: str, **kw: Any):
        with self._http.stream("GET", path, timeout=None, **kw) as r:
            if r.status_code >= 400:
                r.read()
                raise UserError(r.json().get("detail", r.text))
            yield from r.iter_lines()
