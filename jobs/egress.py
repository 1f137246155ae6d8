"""Where a webhook may go: public addresses only, checked when a subscription is saved and
again at every send, since a name's address can change in between (DNS rebinding).

A send resolves the name once, checks every address it got, and connects to a checked one:
the request's URL carries that address, while the Host header and TLS (SNI and the
certificate's name check, httpx's `sni_hostname` extension) keep the name, so nothing looks
the name up a second time. Redirects are never followed and no proxy from the environment
is used. An operator may open networks of their own with HANGAR_WEBHOOK_ALLOW_NETS.
"""

import ipaddress
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from django.conf import settings

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# host, port -> the addresses it resolves to (as text); the system's resolver unless a caller
# passes another (tests stand in a name whose address changes between save and send).
Resolver = Callable[[str, int], list[str]]

# Reached through the portal's own network, never the internet's: (what it is, network).
REFUSED_NETS = [
    (kind, ipaddress.ip_network(net))
    for kind, net in (
        ("unspecified", "0.0.0.0/8"),
        ("private", "10.0.0.0/8"),
        ("carrier-grade NAT", "100.64.0.0/10"),
        ("loopback", "127.0.0.0/8"),
        ("link-local", "169.254.0.0/16"),
        ("private", "172.16.0.0/12"),
        ("IETF special-purpose", "192.0.0.0/24"),
        ("documentation", "192.0.2.0/24"),
        ("private", "192.168.0.0/16"),
        ("benchmarking", "198.18.0.0/15"),
        ("documentation", "198.51.100.0/24"),
        ("documentation", "203.0.113.0/24"),
        ("multicast", "224.0.0.0/4"),
        ("reserved", "240.0.0.0/4"),
        ("unspecified", "::/128"),
        ("loopback", "::1/128"),
        ("IPv4-compatible", "::/96"),
        ("NAT64", "64:ff9b::/96"),
        ("NAT64", "64:ff9b:1::/48"),
        ("discard", "100::/64"),
        ("IETF special-purpose", "2001::/23"),
        ("documentation", "2001:db8::/32"),
        ("unique local (ULA)", "fc00::/7"),
        ("link-local", "fe80::/10"),
        ("site-local", "fec0::/10"),
        ("multicast", "ff00::/8"),
    )
]
# Cloud instance metadata (AWS, ECS, GCP, Azure, Alibaba, Oracle): named as such in refusals.
METADATA = {
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200", "192.0.0.192")
}
# A name resolving to more addresses is tried on these first few only (each try has the timeout).
MAX_ADDRESSES = 4


def refusal(ip: Address) -> str | None:
    """What kind of non-public address `ip` is (None: a public one). An IPv6 address that
    carries an IPv4 one (IPv4-mapped, 6to4) is judged by the IPv4 address it reaches."""
    if ip.version == 6 and (inner := ip.ipv4_mapped or ip.sixtofour) is not None:
        return refusal(inner)
    if ip in METADATA:
        return "cloud metadata"
    for kind, net in REFUSED_NETS:
        if ip in net:  # False across IP versions
            return kind
    return None if ip.is_global else "reserved"


def listed(ip: Address, networks: list[str]) -> bool:
    """Whether `ip` is in one of an operator's networks (an IPv4-mapped address as its IPv4 one)."""
    candidates = [ip, *([ip.ipv4_mapped] if ip.version == 6 and ip.ipv4_mapped else [])]
    nets = [ipaddress.ip_network(n, strict=False) for n in networks]
    return any(c in n for c in candidates for n in nets)


def operator_allows(ip: Address) -> bool:
    return listed(ip, settings.HANGAR_WEBHOOK_ALLOW_NETS)


class Refused(Exception):
    """A target the portal will not connect to; the message names the address and why."""

    def __init__(self, host: str, ip: Address, kind: str):
        self.host, self.ip, self.kind = host, ip, kind
        super().__init__(f"refused: private address {ip} ({kind})")

    def advice(self) -> str:
        shown = "" if self.host == str(self.ip) else f"{self.host} resolves to {self.ip}, "
        return (
            f"{shown}a {self.kind} address: webhooks go to public addresses only. Give a public http(s) "
            "URL, or ask an operator to allow its network in HANGAR_WEBHOOK_ALLOW_NETS"
        )


class Unresolvable(Exception):
    """The name has no address now (perhaps for a moment: a send tries again later)."""


@dataclass(frozen=True)
class Target:
    url: httpx.URL
    addresses: tuple[Address, ...]

    @property
    def name(self) -> str:
        return self.url.raw_host.decode("ascii")


# getaddrinfo has no deadline of its own: a name whose servers never answer would hold the page's
# request (or a notifier) for as long as the system resolver retries. A few threads wait for it.
RESOLVING = ThreadPoolExecutor(max_workers=8, thread_name_prefix="webhook-resolve")


def system_resolver(host: str, port: int) -> list[str]:
    """The system's answer within HANGAR_WEBHOOK_TIMEOUT_SECONDS (an OSError past it)."""
    limit = settings.HANGAR_WEBHOOK_TIMEOUT_SECONDS
    asked = RESOLVING.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        infos = asked.result(timeout=limit)
    except TimeoutError:
        asked.cancel()
        raise TimeoutError(f"no answer within {limit:g} s") from None
    return list(dict.fromkeys(info[4][0] for info in infos))


def parse(url: str) -> httpx.URL:
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise httpx.InvalidURL("not an http(s) URL with a host")
    return parsed


def check(url: str, resolve: Resolver = system_resolver) -> Target:
    """Resolve the URL's host once and check every address; raises Refused or Unresolvable."""
    parsed = parse(url)
    host = parsed.raw_host.decode("ascii")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        found = [ipaddress.ip_address(a.split("%", 1)[0]) for a in resolve(host, port)]
    except (OSError, UnicodeError, ValueError) as exc:
        raise Unresolvable(f"{host} does not resolve ({exc})") from exc
    if not found:
        raise Unresolvable(f"{host} does not resolve")
    for ip in found:
        if (kind := refusal(ip)) is not None and not operator_allows(ip):
            raise Refused(host, ip, kind)
    return Target(parsed, tuple(found[:MAX_ADDRESSES]))


def url_problem(url: str, resolve: Resolver = system_resolver) -> str | None:
    """Why a subscription may not have this URL (for the field `url`), or None."""
    try:
        check(url, resolve)
    except Refused as exc:
        return exc.advice()
    except Unresolvable as exc:
        return f"{exc}: check the name, or give the URL with a public address"
    except httpx.InvalidURL as exc:
        return f"is not a valid http(s) URL ({exc})"
    return None


def post(target: Target, body: bytes, headers: dict[str, str], timeout: float) -> int:
    """POST to the checked addresses in turn until one accepts the connection; the status of
    its answer (the body is never read: only the status counts, and it could be huge)."""
    failure: Exception | None = None
    for ip in target.addresses:
        url = target.url.copy_with(host=str(ip))
        pinned = {**headers, "Host": target.url.netloc.decode("ascii")}
        try:
            with httpx.Client(trust_env=False, follow_redirects=False, timeout=timeout) as client:
                request = client.build_request(
                    "POST", url, content=body, headers=pinned, extensions={"sni_hostname": target.name}
                )
                response = client.send(request, stream=True)
                response.close()
                return response.status_code
        except httpx.ConnectError as exc:
            failure = exc
    raise failure or httpx.ConnectError("no address to connect to")
