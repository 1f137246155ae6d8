# The loss is printed as nan (a logger's first value), training goes on, then the run ends on
# another error.
import math
import time

history = {"train_loss": [math.nan, 2.31, 2.2]}
for step, loss in enumerate(history["train_loss"]):
    print(f"step {step} loss {loss:.4f}", flush=True)
print("train_loss nan at step 0 (warm-up)", flush=True)
time.sleep(0.5)  # the validation pass
best = min(history["val_loss"])
