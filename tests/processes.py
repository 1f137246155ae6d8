"""The machine's processes as tests see them in /proc: whether one is still running, and a uid's."""

from pathlib import Path


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper that this container may lack."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def processes_of(uid: int) -> list[int]:
    """Processes with this uid (real, effective, saved or file-system), zombies included. Read
    from each process's status: a process that is not dumpable has /proc/<pid> owned by root."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        uids = next((line.split()[1:] for line in text.splitlines() if line.startswith("Uid:")), [])
        if str(uid) in uids:
            found.append(int(status.parent.name))
    return found
