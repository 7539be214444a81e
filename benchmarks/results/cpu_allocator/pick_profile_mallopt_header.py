import ctypes
libc=ctypes.CDLL("libc.so.6")
M_TRIM_THRESHOLD=-1; M_MMAP_THRESHOLD=-3
print("mmap", libc.mallopt(M_MMAP_THRESHOLD, 1<<30), "trim", libc.mallopt(M_TRIM_THRESHOLD, 1<<30))
