# A script that stops itself with a message (sys.exit with a string: exit status 1).
import os
import sys

print("resuming", flush=True)
if not os.path.exists("out/ckpt.pt"):
    sys.exit("no checkpoint found in out/: run with --init_from=scratch first")
