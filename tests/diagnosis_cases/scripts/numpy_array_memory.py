# A dataset loaded into one dense array far larger than the host's memory.
import numpy as np

print("allocating the embedding table", flush=True)
table = np.zeros((2_000_000, 1_000_000), dtype=np.float32)
