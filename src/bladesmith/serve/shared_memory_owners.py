"""Whose shared memory the request front (``front``) serves: only connections of the
serving user may use it, and only regions that are the serving user's alone are
registered.

A connection's owner is read from the kernel's socket table (``/proc/net/tcp``). A
system region registered must be a file of /dev/shm that is the serving user's alone
(owner, mode 0600), holds the bytes named and is not one of the Python backend's own.

Part of the front's process: like it, it imports neither torch nor bladesmith.
"""

from __future__ import annotations

import ipaddress
import re
import stat
from pathlib import Path

from bladesmith.serve.request_checks import Refused, is_size


def check_region(key, offset, byte_size, uid: int, private: str = "") -> None:
    """Refused unless ``key`` names a system shared-memory region (/dev/shm/NAME) that is
    user ``uid``'s alone, is not one whose name starts with ``private`` (the Python
    backend's own) and holds ``byte_size`` bytes from ``offset``."""
    if (
        not isinstance(key, str)
        or not re.fullmatch(r"/[!-.0-~]{1,250}", key)
        or key in ("/.", "/..")
    ):
        raise Refused(
            f"key {key!r:.80}: a shared-memory key is /NAME (printable ASCII, no '/' or "
            "space), a region in /dev/shm"
        )
    if private and key[1:].startswith(private):
        raise Refused(f"key {key!r}: the region is the server's own, not a client's")
    try:
        found = (Path("/dev/shm") / key[1:]).lstat()  # a link is not followed
    except OSError:
        raise Refused(f"key {key!r}: there is no such shared-memory region") from None
    if not stat.S_ISREG(found.st_mode) or found.st_uid != uid or found.st_mode & 0o077:
        raise Refused(
            f"key {key!r}: the region is not the serving user's alone (owner "
            f"{found.st_uid}, mode {found.st_mode & 0o777:o}): make it with mode 0600"
        )
    if not (is_size(offset) and is_size(byte_size)) or offset + byte_size > found.st_size:
        raise Refused(
            f"key {key!r}: offset {offset!r} and byte_size {byte_size!r} are not within "
            f"its {found.st_size} bytes"
        )


def connection_owner(peer: tuple[str, int], local_port: int) -> int | None:
    """The user id owning the other end of a TCP connection from ``peer`` to our
    ``local_port``, where it is a socket of this machine (the kernel's table lists it);
    else None."""
    try:
        host = ipaddress.ip_address(peer[0].split("%")[0])
    except ValueError:
        return None
    if isinstance(host, ipaddress.IPv6Address) and host.ipv4_mapped:
        host = host.ipv4_mapped
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            (address, port), (_, remote_port) = (f.split(":") for f in fields[1:3])
            if int(port, 16) == peer[1] and int(remote_port, 16) == local_port:
                if _table_address(address) == host:
                    return int(fields[7])
    return None


def _table_address(text: str):
    """An address as /proc/net/tcp writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(text)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address
