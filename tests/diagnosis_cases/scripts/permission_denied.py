# The job runs as an unprivileged user (as the sandbox makes it) and reads a file it may not.
import os

os.setgid(65534)
os.setuid(65534)
print("loading the tokenizer", flush=True)
with open("/root/.hangar-not-yours", "w") as f:
    f.write("x")
