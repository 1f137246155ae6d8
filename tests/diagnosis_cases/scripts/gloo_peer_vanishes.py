# 2 ranks on gloo: rank 1 dies without a word (os._exit) before the allreduce.
import os
from datetime import timedelta

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
print(f"rank {rank} joined", flush=True)
if rank == 1:
    os._exit(1)
t = torch.ones(4)
dist.all_reduce(t)
