# torch.save of a checkpoint to a full disk (out/ is a 64 KiB tmpfs).
import torch

model = torch.nn.Linear(512, 512)
print("step 100: saving checkpoint to out/ckpt.pt", flush=True)
torch.save(model.state_dict(), "out/ckpt.pt")
