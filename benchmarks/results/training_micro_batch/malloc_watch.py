"""Run `elm` with a thread that logs glibc's heap counters (mallinfo2) and RSS every N seconds.

usage: python malloc_watch.py LOG SECONDS TRIM elm-args...   (TRIM=1: malloc_trim(0) after each log line)
Why: tells a leak (bytes in use grow) from fragmentation (free bytes held in the heap grow)."""
import ctypes, sys, threading, time, os

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc_trim.argtypes = (ctypes.c_size_t,)
log, every, trim = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"

def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1])
    return 0

def watch():
    with open(log, "a", buffering=1) as f:
        f.write("time rss_gib arena_gib in_use_gib free_gib mmapped_gib trimmed\n")
        while True:
            time.sleep(every)
            m = libc.mallinfo2()
            r = rss_kb() / 2**20
            t = libc.malloc_trim(0) if trim else -1
            g = 2**30
            f.write(f"{time.strftime('%H:%M:%S')} {r:.2f} {m.arena/g:.2f} {m.uordblks/g:.2f} {m.fordblks/g:.2f} {m.hblkhd/g:.2f} {t}\n")

threading.Thread(target=watch, daemon=True).start()
sys.argv = ["elm"] + sys.argv[4:]
from elm_memory.cli import main
main()
