# A learning rate far too high: the loss diverges to inf, then NaN; the script checks it.
import torch

torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e6)
x, y = torch.randn(64, 16), torch.randn(64, 1)
for step in range(50):
    loss = torch.nn.functional.mse_loss(model(x), y)
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"loss is {loss.item()} at step {step}")
    opt.zero_grad()
    loss.backward()
    opt.step()
