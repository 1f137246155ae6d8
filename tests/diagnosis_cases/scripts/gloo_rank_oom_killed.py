# 2 ranks on gloo: rank 1 is killed by the kernel's OOM killer (it moves itself into a 64 MiB
# memory cgroup and grows past it) before the allreduce; rank 0 then loses its peer.
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
print(f"rank {rank} joined", flush=True)
if rank == 1:
    with open(os.path.join(os.environ["DIAG_OOM_CGROUP"], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    chunks = [bytearray(16 * 1024 * 1024) for _ in range(64)]
else:
    time.sleep(0.5)
t = torch.ones(4)
dist.all_reduce(t)
print("sum", t.sum().item(), flush=True)
