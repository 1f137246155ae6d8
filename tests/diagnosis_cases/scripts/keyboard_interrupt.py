# Ctrl-C (SIGINT) during training: Python's KeyboardInterrupt.
import time


def train():
    for step in range(1000):
        print(f"step {step}", flush=True)
        time.sleep(0.05)


train()
