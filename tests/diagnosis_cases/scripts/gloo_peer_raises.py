# 2 ranks on gloo: rank 1 fails in its own code before the allreduce; rank 0 then loses its peer.
import os
from datetime import timedelta

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
print(f"rank {rank} joined", flush=True)
if rank == 1:
    config = {"lr": 0.1}
    raise KeyError("batch_size")
t = torch.ones(4)
dist.all_reduce(t)
print("sum", t, flush=True)
