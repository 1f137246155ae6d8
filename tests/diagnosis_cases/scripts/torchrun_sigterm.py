# A torchrun job (one worker) ended by a SIGTERM from outside Hangar: torchrun reports it.
import time

for step in range(1000):
    print(f"step {step}", flush=True)
    time.sleep(0.05)
