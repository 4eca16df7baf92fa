"""The network lab itself: namespaces linked by shaped veths, partitions, user-space latency, cleanup."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from demonet.lab import netlab

ok, why = netlab.available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not ok, reason=why)]

# A sink that reads everything sent to it and prints how many bytes and seconds that took.
SINK = """
import socket, sys, time
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
c, _ = s.accept()
n, t0 = 0, None
while data := c.recv(1 << 16):
    t0 = t0 or time.monotonic()
    n += len(data)
print(n, time.monotonic() - t0, flush=True)
"""
SEND = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
c.sendall(b"x" * int(sys.argv[3]))
c.close()
"""


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _transfer(src: netlab.Host, dst: netlab.Host, nbytes: int, timeout: float = 30) -> float:
    """Mbit/s of one TCP transfer of ``nbytes`` from ``src`` to ``dst``, measured at the receiver."""
    sink = dst.popen([sys.executable, "-c", SINK, "9000"], stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None
    assert sink.stdout.readline().strip() == "ready"
    src.run([sys.executable, "-c", SEND, dst.addr, "9000", str(nbytes), str(timeout)], check=True, timeout=timeout)
    got, seconds = sink.stdout.readline().split()
    sink.wait(timeout=10)
    assert int(got) == nbytes
    return nbytes * 8 / float(seconds) / 1e6


def test_links_are_shaped_partitioned_and_removed() -> None:
    before = _namespaces()
    with netlab.Lab() as lab:
        fast = lab.add_host("fast")
        slow = lab.add_host("slow", mbit=8)
        assert lab.switch in _namespaces() and fast.ns in _namespaces()

        # tbf holds the slow host's link to its rate both ways; the unshaped one is far faster.
        up = _transfer(slow, fast, 2_000_000)
        down = _transfer(fast, slow, 2_000_000)
        free = _transfer(fast, lab.add_host("other"), 20_000_000)
        assert 2 < up < 8 * 1.25 and 2 < down < 8 * 1.25, (up, down)
        assert free > 40, free

        slow.set_rate(40)
        assert _transfer(fast, slow, 5_000_000) > 16

        # A partition: nothing gets through until the link is healed.
        slow.set_link(up=False)
        blocked = slow.run([sys.executable, "-c", SEND, fast.addr, "9", "1", "2"], capture_output=True, timeout=30)
        assert blocked.returncode != 0
        slow.set_link(up=True)
        assert _transfer(slow, fast, 100_000) > 0

        leftover = slow.popen(["sleep", "600"])
        tx, rx = slow.counters()
        assert tx > 2_000_000 and rx > 7_000_000
    assert leftover.poll() is not None, "close() must stop the processes the lab started"
    assert _namespaces() == before


def test_delay_proxy_adds_latency_each_way() -> None:
    echo = ("import socket\ns = socket.create_server(('127.0.0.1', 9100))\nprint('ready', flush=True)\n"
            "c, _ = s.accept()\nwhile d := c.recv(100): c.sendall(d)\n")
    ping = ("import socket, time\nc = socket.create_connection(('127.0.0.1', 9101), timeout=10)\n"
            "rtts = []\nfor _ in range(5):\n    t = time.monotonic(); c.sendall(b'p'); c.recv(1)\n"
            "    rtts.append(time.monotonic() - t)\nprint(min(rtts))\n")
    with netlab.Lab() as lab:
        host = lab.add_host("a")
        server = host.popen([sys.executable, "-c", echo], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        proxy = host.popen([sys.executable, "-m", "demonet.lab.netlab", "proxy", "--listen", "127.0.0.1:9101",
                            "--target", "127.0.0.1:9100", "--delay-ms", "50"], stdout=subprocess.PIPE, text=True)
        assert proxy.stdout is not None and "listening" in proxy.stdout.readline()
        t0 = time.monotonic()
        out = host.run([sys.executable, "-c", ping], capture_output=True, text=True, check=True, timeout=30)
        rtt = float(out.stdout)
        assert 0.1 <= rtt < time.monotonic() - t0, rtt  # 50 ms each way, never less


def test_sweep_removes_only_dead_labs() -> None:
    dead = f"{netlab.PREFIX}999999999x0-sw"  # no such pid
    subprocess.run(["ip", "netns", "add", dead], check=True)
    try:
        with netlab.Lab() as lab:
            removed = netlab.sweep()
            assert dead in removed and lab.switch not in removed
            assert lab.switch in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", dead], capture_output=True)


def test_cli_rejects_bad_proxy_arguments() -> None:
    bad = subprocess.run([sys.executable, "-m", "demonet.lab.netlab", "proxy", "--listen", "nowhere",
                          "--target", "127.0.0.1:1", "--delay-ms", "5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr
