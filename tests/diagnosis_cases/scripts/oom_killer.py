# The kernel's OOM killer: the process moves itself into a 64 MiB memory cgroup (standing in for
# a node short of memory) and grows past it; the kernel kills it with SIGKILL, no word printed.
import os

print("loading the dataset into memory", flush=True)
with open(os.path.join(os.environ["DIAG_OOM_CGROUP"], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
chunks = [bytearray(16 * 1024 * 1024) for _ in range(64)]
print("loaded", len(chunks))
