# A DataLoader worker killed by the kernel's OOM killer: the worker moves itself into a 64 MiB
# memory cgroup (a node short of memory) and grows past it.
import os

import torch
from torch.utils.data import DataLoader, Dataset


class Big(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        with open(os.path.join(os.environ["DIAG_OOM_CGROUP"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        chunks = [bytearray(16 * 1024 * 1024) for _ in range(64)]
        return torch.tensor([len(chunks)])


if __name__ == "__main__":
    print("epoch 0", flush=True)
    for batch in DataLoader(Big(), batch_size=2, num_workers=1):
        print(batch)
