"""Hosts made of network namespaces on this machine, for `python -m loom.bench --hosts` and
the multi-host tests: a hub namespace holding a bridge, and per host a namespace whose one
interface, eth0 (10.<subnet>.<h + 1>/24), is a veth pair to that bridge. Nothing is added
to the machine's own namespace; everything is removed by close(). Needs root and iproute2
(`ip`, and `tc` to shape links)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

_CLONE_NEWNET = 0x40000000


def unavailable_reason() -> str:
    """Why hosts cannot be made here, or "" if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (the ip command) is missing"
    return ""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def reap_orphans() -> None:
    """Removes namespaces left by loom processes that are gone (killed before cleaning up):
    their names carry the pid (loom<pid>py..., loom<pid>n...)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(r"loom(\d+)(?:n|py)[0-9a-z]*", name)
        if not match:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        except PermissionError:
            pass


class NamespaceHosts:
    """`count` hosts named <prefix>h<i>, with a hub <prefix>hub."""

    def __init__(self, count: int, prefix: str | None = None, subnet: str = "10.78.0") -> None:
        reap_orphans()
        self.prefix = prefix or f"loom{os.getpid()}py"
        self.subnet = subnet
        self.hub = self.prefix + "hub"
        self.names: list[str] = []
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for h in range(count):
                name = f"{self.prefix}h{h}"
                _ip("netns", "add", name)
                self.names.append(name)
                _ip("-n", self.hub, "link", "add", f"p{h}", "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("-n", self.hub, "link", "set", f"p{h}", "master", "br0", "up")
                _ip("-n", name, "addr", "add", f"{self.address(h)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def address(self, h: int) -> str:
        return f"{self.subnet}.{h + 1}"

    def enter(self, h: int) -> None:
        """Moves the calling process (its current thread, before it starts others) into host
        h's namespace. Sockets opened before stay where they were."""
        fd = os.open(f"/var/run/netns/{self.names[h]}", os.O_RDONLY)
        try:
            if hasattr(os, "setns"):
                os.setns(fd, os.CLONE_NEWNET)
            elif ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"cannot enter network namespace {self.names[h]}")
        finally:
            os.close(fd)

    def shape(self, h: int, gbit: float) -> None:
        """Limits host h's link to `gbit` Gb/s each way: a tc token bucket on both ends of its
        veth pair (the bucket holds 2 ms at the rate, at least 64 KiB)."""
        burst = max(int(gbit * 1e9 / 8 / 500), 64 << 10)
        tbf = ["root", "tbf", "rate", f"{int(gbit * 1e6)}kbit", "burst", str(burst), "latency", "50ms"]
        for namespace, device in ((self.names[h], "eth0"), (self.hub, f"p{h}")):
            done = subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, *tbf],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"cannot shape host {h}'s link: {done.stderr.strip()}")

    def close(self) -> None:
        for name in [*self.names, self.hub]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.names = []

    def __enter__(self) -> "NamespaceHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
