"""The address and interface a node's cross-node connections use, and the trainer ranks' rendezvous.

Every connection one pod opens to another goes to the other node's own IP (Ray's node address,
the pod IP on KubeRay), never to what a host name resolves to: on many machines and in some pods
the host name resolves to 127.0.0.1, and a peer that dials that reaches itself. Servers are given
the node IP as their host (engines, router, rendezvous stores). torch's gloo and NCCL choose the
address they advertise themselves: gloo from the host name unless GLOO_SOCKET_IFNAME names an
interface, NCCL by its own ranking of interfaces unless NCCL_SOCKET_IFNAME names one. So every
process that opens a process group (a trainer rank, an engine) gets both variables set to the
interface that holds its node IP (`socket_ifname_env`), except those the user set.

Before the trainer ranks build their process group, each one listens on its node IP and dials
every other rank's (`check_ranks_reach_each_other`): ranks that cannot reach each other fail at
once with the addresses and nodes named, not with a gloo stack trace after its timeout.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import json
import os
import socket
from collections.abc import Iterable, Mapping
from typing import Any

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
OVERRIDE_HINT = (
    "set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the interface the pods reach each other on, "
    "through spec.resources.env"
)
# How long ranks wait for each other at the rendezvous: ranks start at different times (a rank
# imports torch and loads the model on a busy node while another is already waiting).
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)
# How long one rank's dial of another's listening address may take before it counts as unreachable.
# The listener is up before its address is published, so a refusal is final and a dropped SYN
# (a NetworkPolicy, a firewall) is the only thing waited for.
DIAL_TIMEOUT_S = 20.0
_KEY = "rlkube/ranks"


class NodeNetworkError(RuntimeError):
    """Nodes that cannot reach each other at their addresses, or an address no interface holds."""


def describe_node(address: str) -> str:
    """`address (host NAME)`: the IP peers dial and the host name (the pod's name on Kubernetes)."""
    return f"{address} (host {socket.gethostname()})"


def socket_ifname_env(address: str, environ: Mapping[str, str], interfaces: Mapping[str, Iterable[str]] | None = None) -> dict[str, str]:
    """The GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME a process on the node at `address` needs: both
    name the interface that holds `address`; a variable already in `environ` (the user's) is left
    out. Loopback means one machine and a wildcard every interface: nothing to choose, {}. `interfaces` (name ->
    addresses) is looked up on this machine when None and only when a variable is missing."""
    missing = [var for var in SOCKET_IFNAME_VARS if not environ.get(var)]
    ip = _ip(address)
    if not missing or ip.is_loopback or ip.is_unspecified:
        return {}
    interface = interface_holding(address, local_interfaces() if interfaces is None else interfaces)
    # NCCL reads a bare name as a prefix (eth0 would match eth01 too); '=' asks for exactly this one.
    values = {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": f"={interface}"}
    return {var: values[var] for var in missing}


def interface_holding(address: str, interfaces: Mapping[str, Iterable[str]]) -> str:
    """The name of the interface that holds `address` (interfaces: name -> its addresses)."""
    wanted = _ip(address)
    for name, addresses in interfaces.items():
        if any(_ip(a) == wanted for a in addresses if _parses(a)):
            return name
    held = ", ".join(f"{name} {' '.join(a for a in addrs if _parses(a)) or '(none)'}" for name, addrs in interfaces.items())
    raise NodeNetworkError(
        f"the node address {address} is held by no interface of this node (host {socket.gethostname()}; "
        f"interfaces: {held or 'none'}), so gloo and NCCL cannot be told where to listen; start Ray with "
        f"--node-ip-address set to one of those addresses, or {OVERRIDE_HINT}"
    )


def local_interfaces() -> dict[str, list[str]]:
    """This machine's interfaces and their IPv4/IPv6 addresses."""
    import psutil

    families = (socket.AF_INET, socket.AF_INET6)
    return {
        name: [a.address for a in addrs if a.family in families]
        for name, addrs in psutil.net_if_addrs().items()
    }


# ---- the trainer ranks' rendezvous ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Unreached:
    """Rank `rank` on `node` could not open a TCP connection to rank `peer` at `peer_address` (on `peer_node`)."""

    rank: int
    node: str
    peer: int
    peer_address: str
    peer_node: str
    reason: str


def unreached_message(unreached: list[Unreached], what: str = "trainer rank") -> str:
    lines = [
        f"  {what} {u.rank} on {u.node} -> {what} {u.peer} at {u.peer_address} on {u.peer_node}: {u.reason}"
        for u in unreached
    ]
    return (
        f"{what}s cannot reach each other at their node addresses:\n" + "\n".join(lines) + "\n"
        "Each rank listens on its node's IP (Ray's node address, the pod IP on KubeRay) and its process group "
        "connects there; allow traffic between the pods on that address (NetworkPolicy, firewall), or "
        f"{OVERRIDE_HINT} and start Ray with --node-ip-address on it"
    )


def rendezvous_store(master_address: str, master_port: int, rank: int, world_size: int, node: str,
                     timeout: datetime.timedelta = RENDEZVOUS_TIMEOUT) -> Any:
    """A TCPStore at rank 0's node (served by rank 0, joined by the others)."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout,
                             wait_for_workers=False)
    except RuntimeError as err:
        role = "could not serve" if rank == 0 else "could not reach"
        raise NodeNetworkError(
            f"trainer rank {rank} on {node} {role} the rank rendezvous at {master_address}:{master_port} "
            f"(trainer rank 0's node address) within {timeout.total_seconds():.0f} s: {err}. Allow traffic between the "
            f"pods on their node addresses (NetworkPolicy, firewall), or {OVERRIDE_HINT}"
        ) from err


def check_ranks_reach_each_other(store: Any, rank: int, world_size: int, address: str,
                                 dial_timeout_s: float = DIAL_TIMEOUT_S) -> None:
    """Each rank listens on its node `address`, publishes it in `store` and dials every other
    rank's; then all ranks wait for each other's results (the listener stays up until every rank
    has dialled it) and all raise the same NodeNetworkError if any dial failed."""
    family = socket.AF_INET6 if _ip(address).version == 6 else socket.AF_INET
    node = describe_node(address)
    # No accept() needed: the kernel completes a dialler's handshake on a listening socket.
    with socket.create_server((address, 0), family=family, backlog=max(world_size, 1)) as listener:
        port = listener.getsockname()[1]
        here = f"[{address}]:{port}" if family == socket.AF_INET6 else f"{address}:{port}"
        store.set(f"{_KEY}/at/{rank}", json.dumps({"address": here, "node": node}))
        unreached = []
        for peer in range(world_size):
            if peer == rank:
                continue
            at = json.loads(_wait_for(store, f"{_KEY}/at/{peer}", rank, peer))
            reason = _dial(at["address"], dial_timeout_s)
            if reason is not None:
                unreached.append(Unreached(rank, node, peer, at["address"], at["node"], reason))
        store.set(f"{_KEY}/result/{rank}", json.dumps([dataclasses.asdict(u) for u in unreached]))
        # Every rank's failures, this one's included, read back once all have dialled.
        unreached = [
            Unreached(**u)
            for peer in range(world_size)
            for u in json.loads(_wait_for(store, f"{_KEY}/result/{peer}", rank, peer))
        ]
    if unreached:
        raise NodeNetworkError(unreached_message(unreached))


def _dial(address: str, timeout_s: float) -> str | None:
    """None if a TCP connection to `host:port` opens within `timeout_s`, else why not."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except TimeoutError:
        return f"no answer within {timeout_s:.0f} s"
    except OSError as err:
        return os.strerror(err.errno) if err.errno else str(err)
    return None


def _wait_for(store: Any, key: str, rank: int, peer: int) -> bytes:
    try:
        return store.get(key)
    except RuntimeError as err:  # the store's timeout: the peer never got this far
        raise NodeNetworkError(
            f"trainer rank {rank} waited in vain for trainer rank {peer} at the rank rendezvous ({key}): {err}; "
            "see that rank's log for why it did not arrive"
        ) from err


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0])  # fe80::1%eth0: the zone is not part of the address
    except ValueError:
        raise NodeNetworkError(f"the node address must be an IP address, got {address!r}") from None


def _parses(address: str) -> bool:
    try:
        ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    return True
