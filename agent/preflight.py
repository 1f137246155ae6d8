"""The node's half of the preflight: the checks of fleet/preflight.py over what this agent's
GPU provider reports now, and the multi-node rendezvous."""

import socket
import time
from collections.abc import Callable

from django.conf import settings

from agent import network, running
from fleet.models import Node
from fleet.preflight import Context, Result, record, run_checks, stored_context
from fleet.rendezvous import OWN_HOST, RANK_ZERO_UNRESOLVED, UNREACHABLE, Failure, blame
from portal.multihost import is_loopback


def rendezvous_reachable(host: str, port: int, timeout: float = 2.0) -> tuple[bool, str]:
    """For multi-node jobs: can this rank open a TCP connection to the rendezvous address?"""
    start = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True, f"{host}:{port} reachable in {(time.perf_counter() - start) * 1000:.0f} ms"
    except OSError as exc:
        return False, f"{host}:{port} unreachable: {exc}"


# --- Multi-node: can the ranks reach rank 0 on the rendezvous port? -------------------------
#
# Rank 0's agent listens on the job's own MASTER_PORT during its preflight, greets
# each connection with the attempt's id, and frees the port for the job once every
# other rank has answered (or its wait ran out). Every other rank connects to
# MASTER_ADDR:MASTER_PORT until it is greeted or its wait runs out. A rank that
# arrives after rank 0's job took the port still reaches the port (the job's own
# store answers the connection), which is what the check is about.

POLL_SECONDS = 0.2


def rendezvous_seconds() -> float:
    return settings.HANGAR_RENDEZVOUS_SECONDS


def run_rendezvous(attempt, rank: int, world_size: int, master_addr: str, port: int, still_current) -> list[str]:
    """Record the rendezvous check of one rank. A rank that cannot reach rank 0 makes the node the
    evidence points at a suspect (fleet/rendezvous.py) and fails the attempt (infra). Returns what failed."""
    start = time.perf_counter()
    still_current = at_most_every(still_current, 0.5)  # each look renews the lease: a write
    failure = own_host_problem(attempt.node.network_interface, master_addr) if world_size > 1 else None
    if failure is None and rank != 0:
        failure = unresolved(master_addr, port)
    if failure is not None:
        passed, evidence = False, failure.evidence
    elif rank == 0:
        passed, evidence = listen_for_ranks(attempt.pk, port, world_size - 1, still_current)
    else:
        passed, evidence = reach_rank_zero(attempt.pk, rank, master_addr, port, still_current)
        failure = None if passed else Failure(UNREACHABLE, evidence)
    result = Result("rendezvous", passed, evidence, (time.perf_counter() - start) * 1000)
    record(attempt.node, [result], "preflight", attempt)
    if passed:
        return []
    if failure is not None and still_current():
        rank_zero = Node.objects.get(pk=attempt.ranks[0]["node_id"])
        suspect, _ = blame(attempt, rank, attempt.node, rank_zero, failure)
        evidence = f"{evidence} (suspect: node {suspect.name})"
    return [f"rendezvous: {evidence}"]


def own_host_problem(interface: str, master_addr: str) -> Failure | None:
    """What gloo and NCCL will meet on this host: the interface they are told to use has an address;
    with none named, this host's name resolves to a routable address (else they fall back to
    loopback, and a rank on another host cannot reach this one)."""
    if interface:
        if interface in network.interface_addresses():
            return None
        return Failure(OWN_HOST, f"interface {interface} (GLOO/NCCL_SOCKET_IFNAME) has no IPv4 address here")
    if is_loopback(master_addr):
        return None  # every rank on this host: loopback is right
    name = socket.gethostname()
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)}
    except OSError as exc:
        addresses, error = set(), f"does not resolve ({exc})"
    else:
        error = "resolves only to loopback " + ", ".join(sorted(addresses))
    if addresses and not all(is_loopback(a) for a in addresses):
        return None
    return Failure(
        OWN_HOST,
        f"this host's name {name} {error}: gloo and NCCL would fall back to loopback; "
        "advertise this node's address (--advertise-address) or name its interface (HANGAR_NODE_NETWORK_INTERFACE)",
    )


def unresolved(master_addr: str, port: int) -> Failure | None:
    """Rank 0's advertised address does not resolve here."""
    try:
        socket.getaddrinfo(master_addr, port, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        return Failure(RANK_ZERO_UNRESOLVED, f"rank 0's address {master_addr} does not resolve here: {exc}")
    return None


def at_most_every(check: Callable[[], bool], seconds: float) -> Callable[[], bool]:
    """`check`, called again only once `seconds` have passed; its last answer in between."""
    last = {"at": -seconds, "answer": True}

    def call() -> bool:
        now = time.monotonic()
        if now - last["at"] >= seconds:
            last["at"], last["answer"] = now, check()
        return last["answer"]

    return call


def listen_for_ranks(attempt_id: int, port: int, expected: int, still_current) -> tuple[bool, str]:
    greeting = f"hangar-rendezvous {attempt_id}\n".encode()
    try:
        server = socket.create_server(("", port), reuse_port=False)
    except OSError as exc:  # the job could not bind it either; not the node's health
        return False, f"cannot listen on rendezvous port {port}: {exc}"
    server.settimeout(POLL_SECONDS)
    seen: set[int] = set()
    deadline = time.monotonic() + rendezvous_seconds()
    with server:
        while len(seen) < expected and time.monotonic() < deadline and still_current():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2.0)
                try:
                    conn.sendall(greeting)
                    rank = int(conn.recv(64).decode().split()[-1])
                except (OSError, ValueError, IndexError):
                    continue  # not a rank of ours
                if 1 <= rank <= expected:
                    seen.add(rank)
    if not still_current():
        return False, f"the attempt ended (another rank failed, or a cancel) while rank 0 waited on port {port}"
    missing = sorted(set(range(1, expected + 1)) - seen)
    if missing:
        return True, f"listened on port {port}; ranks {missing} did not check in (each records its own check)"
    return True, f"listened on port {port}; ranks {sorted(seen)} reached it"


def reach_rank_zero(attempt_id: int, rank: int, host: str, port: int, still_current) -> tuple[bool, str]:
    deadline = time.monotonic() + rendezvous_seconds()
    error = "no answer"
    tries = 0
    while time.monotonic() < deadline and still_current():
        tries += 1
        try:
            with socket.create_connection((host, port), timeout=2.0) as conn:
                conn.settimeout(1.0)
                try:
                    hello = conn.recv(64).decode()
                except TimeoutError:
                    return True, f"{host}:{port} reachable (the job already listens there), try {tries}"
                if hello.strip() == f"hangar-rendezvous {attempt_id}":
                    conn.sendall(f"rank {rank}\n".encode())
                    return True, f"{host}:{port} reachable, rank 0 answered, try {tries}"
                error = f"something else answered on {host}:{port}: {hello[:40]!r}"
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        time.sleep(POLL_SECONDS)
    if not still_current():
        return False, "the attempt ended before rank 0 was reached"
    return False, f"{host}:{port} unreachable for {rendezvous_seconds():g}s ({tries} tries): {error}"


def live_context(node: Node, gpu_indices: list[int], gpu_type: str) -> Context:
    """What the node reports now: from this process's agent when there is one, else stored telemetry."""
    ctx = Context(node, gpu_indices, gpu_type)
    current = running.CURRENT
    if current is not None and current.node is not None and current.node.pk == node.pk:
        start = time.perf_counter()
        try:
            ctx.present = {g.index for g in current.provider.inventory()}
            ctx.samples = {s.index: s for s in current.provider.sample(set(), events=False)}
        except Exception as exc:  # any driver failure is the check's evidence
            ctx.driver_error = f"{type(exc).__name__}: {exc}"
        if time.perf_counter() - start > 10:
            ctx.driver_error = ctx.driver_error or "the driver took over 10 s to answer"
        return ctx
    return stored_context(node, gpu_indices, gpu_type)


def run_preflight(attempt, gpu_type: str) -> list[str]:
    """Run and record the preflight of an attempt; a failure cordons the node. Returns what failed."""
    node = attempt.node
    results = run_checks(live_context(node, attempt.gpu_indices, gpu_type))
    record(node, results, "preflight", attempt)
    failures = [f"{r.name}: {r.evidence}" for r in results if not r.passed]
    if failures:
        evidence = {"attempt": attempt.pk, "failed_checks": {r.name: r.evidence for r in results if not r.passed}}
        node.auto_cordon("preflight failed: " + "; ".join(failures), evidence)
    return failures
