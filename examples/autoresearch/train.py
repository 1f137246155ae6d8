"""A tiny training run for the autoresearch example: a two-layer MLP fits a noisy sine
on synthetic data, on the CPU, for a fixed time budget, and prints its validation loss
as `step N val_loss: X` lines (what the job's `metrics_from_log` reads).

The driver (driver.py) edits the constants below in a copy of this file per variant;
the first line it prints is the sha256 of this file, so a run shows which code it ran.

    python train.py [SECONDS]      # or TRAIN_SECONDS=SECONDS; default 20
"""

import hashlib
import os
import sys
import time
import warnings
from pathlib import Path

print(f"code sha256: {hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}", flush=True)

# What a variant changes (driver.py rewrites these lines; keep one `NAME = value` each).
LEARNING_RATE = 0.01
WIDTH = 32

BATCH = 256
EVAL_EVERY = 50  # steps
SEED = 0


def budget() -> float:
    given = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("TRAIN_SECONDS", "20")
    return float(given)


def data(torch, count: int, generator):
    x = torch.rand(count, 1, generator=generator) * 6 - 3
    y = torch.sin(3 * x) + 0.1 * torch.randn(count, 1, generator=generator)
    return x, y


def main() -> None:
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

    torch.set_num_threads(1)  # several variants share a node's cores
    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    train_x, train_y = data(torch, 4096, generator)
    val_x, val_y = data(torch, 1024, generator)
    model = torch.nn.Sequential(torch.nn.Linear(1, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))
    optimiser = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    seconds = budget()
    print(f"training: lr={LEARNING_RATE} width={WIDTH} for {seconds:g}s", flush=True)
    started, step = time.monotonic(), 0
    while time.monotonic() - started < seconds:
        batch = torch.randint(0, len(train_x), (BATCH,), generator=generator)
        loss = torch.nn.functional.mse_loss(model(train_x[batch]), train_y[batch])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        step += 1
        if step % EVAL_EVERY == 0:
            evaluate(torch, model, val_x, val_y, step)
    if step % EVAL_EVERY:
        evaluate(torch, model, val_x, val_y, step)  # the last line is what the run ended at


def evaluate(torch, model, val_x, val_y, step: int) -> None:
    with torch.no_grad():
        val_loss = torch.nn.functional.mse_loss(model(val_x), val_y).item()
    print(f"step {step} val_loss: {val_loss:.6f}", flush=True)


if __name__ == "__main__":
    main()
