# A checkpoint written to a full disk (out/ is a 64 KiB tmpfs).
import os

print("step 100: saving checkpoint", flush=True)
with open(os.path.join("out", "ckpt.bin"), "wb") as f:
    f.write(os.urandom(1024 * 1024))
