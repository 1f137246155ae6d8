# Autograd's anomaly detection names the op that produced NaN.
import torch

torch.autograd.set_detect_anomaly(True)
w = torch.zeros(4, requires_grad=True)
print("step 0", flush=True)
loss = (torch.sqrt(w) * 0).sum()
loss.backward()
