"""A network lab on one Linux machine: hosts in network namespaces around a bridge, real kernel links.

Each host is a network namespace with one veth link to a switch namespace that holds a bridge. A link's
bandwidth is shaped with ``tc qdisc ... tbf`` on both ends (the host's end shapes its upload, the switch's
end its download). Latency is added in user space by :class:`DelayProxy` (netem is not on every kernel).
A partition is the switch end of a link set down.

    with Lab() as lab:
        coord = lab.add_host("coord", mbit=100)
        slow = lab.add_host("peer0", mbit=2)
        proc = coord.popen([sys.executable, "-m", "demonet", "coordinator", "--host", coord.addr, ...])
        slow.set_link(up=False)  # partition

Everything a lab creates (namespaces, and with them veths and bridges; the processes it started) is removed
by ``close()``, also after a failure. Namespace names carry the creating pid, so :func:`sweep` can remove
what a killed run left behind. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PREFIX = "dn"
SUBNET = "10.77"  # hosts get 10.77.0.2, 10.77.0.3, ...: only ever inside the lab's own namespaces
_labs = itertools.count()


def available() -> tuple[bool, str]:
    """Whether labs can be built here, and if not, why (for a test's skip reason)."""
    if sys.platform != "linux":
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")


def _tbf(ns: str, dev: str, mbit: float, *, change: bool = False) -> None:
    """Shape ``dev``'s egress to ``mbit``: a bucket of 1/50 s of traffic (at least 32 KiB), a 0.5 s queue."""
    rate = int(mbit * 1e6)
    burst = max(32 * 1024, rate // 8 // 50)
    limit = max(2 * burst, rate // 8 // 2)
    cmd = ["tc", "-n", ns, "qdisc", "replace" if change else "add", "dev", dev, "root", "tbf",
           "rate", f"{rate}bit", "burst", str(burst), "limit", str(limit)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")


def _unshape(ns: str, dev: str) -> None:
    subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)


@dataclass
class Host:
    """One namespace ("machine") of a lab, with the address ``addr`` on the lab's switch."""

    lab: Lab
    name: str
    ns: str
    addr: str
    mbit: float | None
    _veth: str  # the switch's end of this host's link
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host's namespace, in its own process group; ``close()`` stops it."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], timeout=timeout, **kwargs)

    def set_rate(self, mbit: float | None) -> None:
        """Change this host's link bandwidth (both directions); None removes the shaping."""
        for ns, dev in ((self.ns, "eth0"), (self.lab.switch, self._veth)):
            if mbit is None:
                _unshape(ns, dev)
            else:
                _tbf(ns, dev, mbit, change=True)
        self.mbit = mbit

    def set_link(self, *, up: bool) -> None:
        """Partition this host (``up=False``: its link goes down at the switch) or heal it."""
        _ip("link", "set", self._veth, "up" if up else "down", ns=self.lab.switch)
        if up:
            # Addresses looked up during the partition are cached as unreachable for a while
            # ("No route to host"); a healed link reaches them at once.
            for host in self.lab.hosts.values():
                subprocess.run(["ip", "-n", host.ns, "neigh", "flush", "all"], capture_output=True)

    def counters(self) -> tuple[int, int]:
        """Bytes (sent, received) on this host's link since it was made, as the kernel counts them."""
        base = "/sys/class/net/eth0/statistics"
        out = self.run(["cat", f"{base}/tx_bytes", f"{base}/rx_bytes"], capture_output=True, text=True, check=True)
        tx, rx = (int(v) for v in out.stdout.split())
        return tx, rx


class Lab:
    """A star of hosts around one bridge. Use as a context manager, or call ``close()`` in a finally."""

    def __init__(self) -> None:
        self.id = f"{PREFIX}{os.getpid()}x{next(_labs)}"
        self.switch = f"{self.id}-sw"
        self.hosts: dict[str, Host] = {}
        self._closed = False
        _ip("netns", "add", self.switch)
        try:
            _ip("link", "set", "lo", "up", ns=self.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, name: str, *, mbit: float | None = None) -> Host:
        """A new namespace linked to the switch, shaped to ``mbit`` Mbit/s each way (None: unshaped)."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        index = len(self.hosts)
        if index > 250:
            raise ValueError("a lab holds at most 251 hosts")
        ns = f"{self.id}-{index}"
        veth = f"v{index}"
        host = Host(self, name, ns, f"{SUBNET}.0.{index + 2}", mbit, veth)
        self.hosts[name] = host
        _ip("netns", "add", ns)
        _ip("link", "set", "lo", "up", ns=ns)
        # Both ends are made in the switch namespace, then one end moves into the host.
        _ip("link", "add", veth, "type", "veth", "peer", "name", f"h{index}", ns=self.switch)
        _ip("link", "set", f"h{index}", "netns", ns, "name", "eth0", ns=self.switch)
        _ip("link", "set", veth, "master", "br0", ns=self.switch)
        _ip("link", "set", veth, "up", ns=self.switch)
        _ip("addr", "add", f"{host.addr}/16", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        if mbit is not None:
            host.set_rate(mbit)
        return host

    def close(self) -> None:
        """Stop every process the lab started (SIGTERM, then SIGKILL after 5 s) and delete its namespaces."""
        if self._closed:
            return
        self._closed = True
        procs = [p for h in self.hosts.values() for p in h.procs if p.poll() is None]
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=10)
        for host in self.hosts.values():
            _kill_namespace_pids(host.ns)
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_namespace_pids(ns: str) -> None:
    """SIGKILL whatever still runs inside ``ns`` (a daemon a test process forked and left behind)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in out.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def sweep() -> list[str]:
    """Delete the namespaces of labs whose creating process is gone (a run killed before its ``close()``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    removed = []
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX) or "x" not in name:
            continue
        pid = name[len(PREFIX):].split("x", 1)[0]
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue
        _kill_namespace_pids(name)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        removed.append(name)
    return removed


# --------------------------------------------------------------------------- user-space latency


class DelayProxy:
    """A TCP forwarder that holds every chunk ``delay_s`` in each direction (a round trip gains 2 x delay).

    Bytes keep their order; a chunk is released ``delay_s`` after it arrived, so a stream's throughput is
    not cut, only its latency is raised, as on a long link.
    """

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_s: float) -> None:
        self.listen, self.target, self.delay_s = listen, target, delay_s
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, *self.listen)
        return int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def release() -> None:
            while True:
                due, chunk = await queue.get()
                if not chunk:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.create_task(release())
        try:
            while chunk := await reader.read(1 << 16):
                queue.put_nowait((time.monotonic() + self.delay_s, chunk))
        except OSError:
            pass
        finally:
            queue.put_nowait((0.0, b""))
            try:
                await sender
            except OSError:
                pass
            try:
                writer.close()
            except OSError:
                pass


def _parse_addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m demonet.lab.netlab proxy --listen H:P --target H:P --delay-ms D``, or ``sweep``."""
    parser = argparse.ArgumentParser(prog="python -m demonet.lab.netlab")
    sub = parser.add_subparsers(dest="cmd", required=True)
    proxy = sub.add_parser("proxy", help="forward TCP with added latency")
    proxy.add_argument("--listen", type=_parse_addr, required=True)
    proxy.add_argument("--target", type=_parse_addr, required=True)
    proxy.add_argument("--delay-ms", type=float, required=True, help="one-way delay added in each direction")
    sub.add_parser("sweep", help="delete namespaces left by labs whose process is gone")
    args = parser.parse_args(argv)
    if args.cmd == "sweep":
        for name in sweep():
            print(f"removed {name}")
        return
    if args.delay_ms < 0:
        parser.error("--delay-ms must be >= 0")

    async def serve() -> None:
        p = DelayProxy(args.listen, args.target, args.delay_ms / 1000)
        port = await p.start()
        print(f"proxy listening on {args.listen[0]}:{port} -> {args.target[0]}:{args.target[1]}", flush=True)
        assert p.server is not None
        await p.server.serve_forever()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
