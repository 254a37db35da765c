"""What the kernel says about this process's memory, for the tests of where buffers live."""

from __future__ import annotations


def thp_eligible(address: int) -> bool | None:
    """/proc/self/smaps' THPeligible for the mapping holding `address` (None where it is not said)."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return None
