"""The agent beside vLLM on each replica: serves this replica's KV shard store.

    python -m orchestrator.replica.agent --store-port P --secret-file F [--max-bytes N] [--ttl S] [--host H]
                                 [--tls-dir DIR] [--watch CLOUD --api DAEMON_URL [--metadata-url URL]]

orchestrator.replica.main starts it. With --watch it also runs the cloud's notice watcher
(orchestrator.replica.watchers), which reports notices to the daemon with this replica's own
token (orchestrator.common.identity; never the daemon's admin token). It logs "agent: shard
store listening on http://H:P" once the port is bound (with --store-port 0, the port the OS picked) and stops
cleanly on SIGTERM/SIGINT. With --tls-dir (the service CA's certificate for this store and its key,
orchestrator.common.kvtls's file names) the store's port also speaks TLS, for peers in other clouds.
More duties: `serve(options, duties=[...])` starts each once the store listens
and stops it at shutdown (watchers.WatchLoop has that shape).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import ssl
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from orchestrator.common import kvtls
from orchestrator.replica.kv.httpserver import server_tls_context, start_server
from orchestrator.replica.kv.store import MAX_BODY, StoreHandler

log = logging.getLogger("orchestrator.replica.agent")


class Duty(Protocol):
    def start(self) -> object: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class AgentOptions:
    store_port: int | None  # None: no shard store (a service without the KV cache)
    secret: str
    host: str = "127.0.0.1"
    max_bytes: int = 1 << 30
    ttl_s: float = 3600.0
    watch: str | None = None  # aws | gcp | azure: the notice watcher to run
    api_url: str | None = None
    metadata_url: str | None = None
    tls_dir: Path | None = None  # kvtls.CERT_FILE and KEY_FILE: the store also speaks TLS


def parse_args(argv: Sequence[str] | None = None) -> AgentOptions:
    """The options; a bad or missing one (an unreadable or empty secret file, say) exits with
    argparse's usage error (SystemExit 2)."""
    parser = argparse.ArgumentParser(prog="python -m orchestrator.replica.agent", description=__doc__.split("\n")[0])
    parser.add_argument("--store-port", type=int, help="shard store port (0: any free one; none: no store)")
    parser.add_argument("--secret-file", type=Path, required=True, help="file holding the service's KV secret")
    parser.add_argument("--max-bytes", type=int, default=1 << 30, help="memory bound of the store (bytes)")
    parser.add_argument("--ttl", type=float, default=3600.0, help="seconds a shard lives after its last use")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--watch", metavar="CLOUD", help="watch this cloud's metadata for notices")
    parser.add_argument("--api", dest="api_url", help="the daemon's base URL (notices go to its /v1/notices)")
    parser.add_argument("--metadata-url", help="override the metadata server's base URL (tests)")
    parser.add_argument("--tls-dir", type=Path, help="folder with this store's certificate and key (TLS too)")
    args = parser.parse_args(argv)
    if args.watch and not args.api_url:
        parser.error("--watch needs --api DAEMON_URL")
    try:
        secret = args.secret_file.read_text().strip()
    except OSError as err:
        parser.error(f"--secret-file {args.secret_file}: {err.strerror}")
    if not secret:
        parser.error(f"--secret-file {args.secret_file}: the file is empty")
    if args.store_port is None and not args.watch:
        parser.error("nothing to do: give --store-port, --watch, or both")
    if args.store_port is not None and not 0 <= args.store_port <= 65535:
        parser.error(f"--store-port must be 0..65535, got {args.store_port}")
    if args.max_bytes <= 0 or args.ttl <= 0:
        parser.error("--max-bytes and --ttl must be positive")
    if args.tls_dir is not None:
        try:
            _tls_context(args.tls_dir)
        except (OSError, ssl.SSLError) as err:
            parser.error(f"--tls-dir {args.tls_dir}: no usable certificate and key: {err}")
    return AgentOptions(args.store_port, secret, args.host, args.max_bytes, args.ttl, args.watch, args.api_url,
                        args.metadata_url, args.tls_dir)


def _tls_context(folder: Path) -> ssl.SSLContext:
    return server_tls_context(str(folder / kvtls.CERT_FILE), str(folder / kvtls.KEY_FILE))


def notice_duties(options: AgentOptions) -> list[Duty]:
    """The notice watcher the options ask for (none on the local cloud: the daemon kills)."""
    if not options.watch:
        return []
    from orchestrator.common import identity
    from orchestrator.replica.watchers import NoticeReporter, WatchLoop, load_watcher

    kwargs = {"base_url": options.metadata_url} if options.metadata_url else {}
    reporter = NoticeReporter(options.api_url, identity.own_token(options.secret))
    return [WatchLoop(load_watcher(options.watch)(**kwargs), reporter)]


async def serve(options: AgentOptions, duties: Sequence[Duty] = (), stop: asyncio.Event | None = None) -> None:
    """Run the shard store (and the duties) until SIGTERM/SIGINT (or `stop` is set). Raises
    OSError when the store's address cannot be bound."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    server = None
    if options.store_port is not None:
        handler = StoreHandler(options.secret, max_bytes=options.max_bytes, ttl_s=options.ttl_s)
        # A body can never be larger than what the store may hold (plus framing).
        max_body = min(MAX_BODY, options.max_bytes + (1 << 20))
        tls = _tls_context(options.tls_dir) if options.tls_dir is not None else None
        server = await start_server(handler, options.host, options.store_port, max_body, admit=handler.admit,
                                    tls=tls)
        port = server.sockets[0].getsockname()[1]
        log.info("agent: shard store listening on http://%s:%d%s", options.host, port,
                 " (and TLS on the same port)" if tls else "")
    started: list[Duty] = []
    try:
        for duty in duties:
            duty.start()
            started.append(duty)
        await stop.wait()
    finally:
        if server is not None:
            server.close()
        for duty in started:
            duty.stop()
        log.info("agent: stopped")


def _loop_factory():
    """uvloop when installed: its transports are faster than asyncio's for bulk bytes."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(options: AgentOptions, duties: Sequence[Duty] = ()) -> None:
    """Serve until SIGTERM/SIGINT, on uvloop when it is installed (OSError as `serve`)."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(serve(options, duties))


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per metadata poll is noise
    options = parse_args(argv)
    try:
        run(options, notice_duties(options))
    except OSError as err:  # the port is taken, the address is not ours, ...
        log.error("agent: cannot serve the shard store on %s:%d: %s", options.host, options.store_port,
                  err.strerror or err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
