# A training loop that handles SIGTERM: it says so, saves, and stops with a failure status.
import signal
import sys
import time


def stop(signum, frame):
    print(f"caught signal {signum}, saving a checkpoint and stopping", flush=True)
    sys.exit(1)


signal.signal(signal.SIGTERM, stop)
for step in range(1000):
    print(f"step {step}", flush=True)
    time.sleep(0.05)
