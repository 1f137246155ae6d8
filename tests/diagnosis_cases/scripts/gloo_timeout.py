# 2 ranks on gloo: rank 1 is late to the collective; rank 0's allreduce times out.
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=3))
print(f"rank {rank} joined", flush=True)
if rank == 1:
    time.sleep(8)
    raise SystemExit(0)
t = torch.ones(4)
dist.all_reduce(t)
