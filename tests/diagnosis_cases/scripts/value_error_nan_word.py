# An exception whose text happens to hold "nan" as part of a word.
SCHEDULERS = {"cosine", "linear"}
name = "nanny"
print("building the scheduler", flush=True)
if name not in SCHEDULERS:
    raise ValueError(f"unknown scheduler {name!r}: choose one of {sorted(SCHEDULERS)}")
