# Pure Python: reading a whole dataset into memory past the limit.
import resource

limit = 512 * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
print("reading the dataset", flush=True)
data = bytearray(2 * 1024**3)
