"""Child process for figure 2's peak-RSS measurement: ``python -m benchmarks._rss_child METHOD PATH SIZE``.

Prints JSON: the peak RSS (KiB) with the payload resident, before the write, and after it. A fresh
process per method, so one method's high-water mark never hides another's.

The peak is the kernel's VmHWM of this process. ``getrusage(RUSAGE_SELF).ru_maxrss`` would be wrong
here: Linux carries the RSS high-water mark of the forked parent across ``exec`` into the child's
ru_maxrss, so a child of a parent that once held a 256 MB payload starts with that peak and every
method would measure 0. ru_maxrss is the fallback where /proc is missing.
"""

from __future__ import annotations

import json
import resource
import sys


def peak_kib() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main(argv: list[str]) -> None:
    method, path, size = argv[0], argv[1], int(argv[2])
    from benchmarks import _writers

    writer = _writers.ALL[method]
    # Import everything the writer needs before the baseline (imports are not the write's memory).
    writer(path + ".warm", _writers.make_payload(16))
    payload = _writers.make_payload(size)
    before = peak_kib()
    writer(path, payload)
    after = peak_kib()
    print(json.dumps({"before_kib": before, "after_kib": after, "size": size}))


if __name__ == "__main__":
    main(sys.argv[1:])
