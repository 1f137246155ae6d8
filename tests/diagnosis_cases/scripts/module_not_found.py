import os

print("starting", os.getpid(), flush=True)
import transformerz  # noqa: E402,F401  (a typo of transformers)
