# The script calls a tool the node lacks (the shell says so), goes on, then fails on its own error.
import os
import time

os.system("nvidia-smi --query-gpu=name --format=csv")
time.sleep(0.3)
print("epoch 0", flush=True)
config = {"lr": 0.1}
steps = config["max_steps"]
