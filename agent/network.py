"""Where this node is reached from the other nodes, and which interface its ranks use.

A multi-node job's ranks meet at rank 0's advertised address (MASTER_ADDR). Host names
need not resolve across hosts, so an agent advertises an address: the one given
(`--advertise-address`, HANGAR_NODE_ADDRESS), else that of the interface that reaches the
database or broker, else that of the default route. gloo and NCCL pick their own
interface by resolving the host's name, and fall back to loopback where it does not
resolve: the ranks on this node are told the interface that holds the advertised address
(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), or the one HANGAR_NODE_NETWORK_INTERFACE names.
"""

import fcntl
import ipaddress
import socket
import struct

from portal.multihost import is_loopback, remote_services

SIOCGIFADDR = 0x8915
# An address of TEST-NET-1: "connecting" a UDP socket sends nothing, it only picks the route.
DEFAULT_ROUTE_PROBE = ("192.0.2.1", 9)


class AddressError(ValueError):
    """An address or interface this node cannot advertise, with why and what to give instead."""


def route_source(host: str, port: int) -> str | None:
    """The local address this host sends from to reach host:port (no packet is sent)."""
    try:
        family = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family[0], socket.SOCK_DGRAM) as probe:
            probe.connect(family[4])
            return probe.getsockname()[0]
    except OSError:
        return None


def detect_address() -> tuple[str, str]:
    """(address, how it was chosen) when none is given."""
    for what, host, port in remote_services():
        source = route_source(host, port)
        if source and not is_loopback(source):
            return source, f"the interface that reaches {what} at {host}"
    source = route_source(*DEFAULT_ROUTE_PROBE)
    if source and not is_loopback(source):
        return source, "the interface of the default route"
    return "127.0.0.1", "no network route: only nodes on this host can reach it"


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each interface that has one."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address on it
            out[name] = socket.inet_ntoa(raw[20:24])
    return out


def interface_of(address: str) -> str:
    """The interface holding `address` ('' when it is a name, or no interface has it)."""
    try:
        ipaddress.IPv4Address(address)
    except ValueError:
        return ""
    return next((name for name, addr in interface_addresses().items() if addr == address), "")


def choose(address: str, interface: str) -> tuple[str, str, str]:
    """(address, interface, how) this node advertises, from what was given (either may be '').
    Raises AddressError where the result could not work."""
    how = "given"
    if not address:
        address, how = detect_address()
    remote = remote_services()
    if is_loopback(address) and remote:
        what, host, _ = remote[0]
        raise AddressError(
            f"this node would advertise {address}, a loopback address, but {what} is on another host ({host}): "
            "the other nodes' ranks could not reach this node's. Give this node's own address with "
            "--advertise-address or HANGAR_NODE_ADDRESS"
        )
    if interface:
        if interface not in {name for _, name in socket.if_nameindex()}:
            names = ", ".join(name for _, name in socket.if_nameindex())
            raise AddressError(f"HANGAR_NODE_NETWORK_INTERFACE: no interface {interface!r} here (there are: {names})")
    elif not is_loopback(address):
        interface = interface_of(address)
    return address, interface, how


def rank_network_env(interface: str) -> dict[str, str]:
    """What tells gloo and NCCL which interface to use (nothing when none is known)."""
    if not interface:
        return {}
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}
