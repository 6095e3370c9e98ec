"""What every emulated cloud that boots its VMs shares (tests/fakes/emulated_gcp, emulated_azure):
its API served on 127.0.0.1 by the subclass's `route`, and per VM a machine (tests/fakes/vm_runner)
started from its boot script, with a metadata server of its own. Without a runner, VMs are
records only (nothing boots): for the daemon's fast tests."""

from __future__ import annotations

import contextlib
import threading

from tests.fakes.clouds import Request, Reply, serve
from tests.fakes.vm_runner import VMRunner


class BootingCloud:
    def __init__(self, runner: VMRunner | None = None):
        self.runner = runner
        self.url = ""
        self.metadata: dict = {}  # instance id -> its metadata server's state (tests/fakes/metadata)
        self.preempted: list[str] = []
        self._lock = threading.RLock()
        self._servers = contextlib.ExitStack()
        self._vm_servers: dict[str, contextlib.ExitStack] = {}
        self._stopping: list[threading.Thread] = []  # machines shutting down, joined at close

    def route(self, req: Request) -> Reply:
        raise NotImplementedError

    def start(self):
        self.url = self._servers.enter_context(serve(self.route)).url
        return self

    def close(self) -> None:
        for thread in self._stopping:  # a machine left half stopped would outlive the test
            thread.join(timeout=30)
        if self.runner is not None:
            self.runner.close()
        for stack in self._vm_servers.values():
            stack.close()
        self._servers.close()

    def boot(self, instance_id: str, metadata, script: str, private_ip: str) -> None:
        """Start the VM's machine from its boot script, with `metadata` served for it (a script
        that is not one, e.g. a test's bare VM, boots nothing)."""
        if self.runner is None or not script.startswith("#!"):
            return
        stack = contextlib.ExitStack()
        server = stack.enter_context(serve(metadata.route))
        self._vm_servers[instance_id], self.metadata[instance_id] = stack, metadata
        self.runner.start(instance_id, script, private_ip, server.url)

    def halt(self, instance_id: str) -> None:
        """The VM's machine goes away, in the background: the API's answer does not wait for it."""
        stack = self._vm_servers.pop(instance_id, None)

        def stop() -> None:
            if self.runner is not None:
                self.runner.stop(instance_id)
            if stack is not None:
                stack.close()

        thread = threading.Thread(target=stop, daemon=True)
        self._stopping.append(thread)
        thread.start()
