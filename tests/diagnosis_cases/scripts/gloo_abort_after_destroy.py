# 2 ranks on gloo finish their work; one then aborts at exit (the TRAPS.md case: no barrier
# before destroy_process_group). The abort is libstdc++'s own std::terminate.
import ctypes
import os

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
print(f"rank {rank} done: sum {t.sum().item()}", flush=True)
dist.destroy_process_group()
if rank == 1:
    ctypes.CDLL("libstdc++.so.6")._ZSt9terminatev()
