# A None where a number was meant.
def schedule(step, warmup=None):
    return min(1.0, step / warmup)


print("step 0", flush=True)
for step in range(3):
    print(schedule(step))
