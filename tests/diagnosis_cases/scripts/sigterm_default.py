# A training loop with no signal handler, ended by a SIGTERM from outside Hangar.
import time

for step in range(1000):
    print(f"step {step}", flush=True)
    time.sleep(0.05)
