# A training step that allocates past the job's memory limit (RLIMIT_AS, as HANGAR_JOB_MEMORY_LIMIT_MB sets it).
import resource

import torch

limit = 1536 * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
print("loading the batch", flush=True)
batch = torch.empty(4 * 1024**3, dtype=torch.uint8)
print(batch.sum())
