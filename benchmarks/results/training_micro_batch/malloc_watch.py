"""Run `elm` with a thread that logs glibc's heap counters (mallinfo2) and the resident size.

    python malloc_watch.py LOG SECONDS TRIM elm-args...

Every SECONDS a line: time, resident GiB, heap held (``arena``), in use (``uordblks``), free but held
(``fordblks``), mmapped (``hblkhd``); TRIM=1 also calls ``malloc_trim(0)`` after each line. Why: tells a
leak (bytes in use grow) from a kept peak (free bytes held in the heap)."""

import ctypes
import sys
import threading
import time

from elm_memory.cli import main

FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]


def resident_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def watch(log: str, every: float, trim: bool) -> None:
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    gib = 2**30
    with open(log, "a", buffering=1) as f:
        f.write("time rss_gib arena_gib in_use_gib free_gib mmapped_gib trimmed\n")
        while True:
            time.sleep(every)
            m = libc.mallinfo2()
            rss = resident_kb() / 2**20
            trimmed = libc.malloc_trim(0) if trim else -1
            f.write(
                f"{time.strftime('%H:%M:%S')} {rss:.2f} {m.arena / gib:.2f} {m.uordblks / gib:.2f} "
                f"{m.fordblks / gib:.2f} {m.hblkhd / gib:.2f} {trimmed}\n"
            )


if __name__ == "__main__":
    threading.Thread(target=watch, args=(sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"), daemon=True).start()
    sys.argv = ["elm", *sys.argv[4:]]
    main()
