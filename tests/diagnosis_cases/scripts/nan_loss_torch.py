# A real NaN: a likelihood loss takes the log of a model output that goes negative; the training
# loop prints it (nanoGPT's format) and stops on it.
import torch

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.5)
x = torch.randn(64, 8)
for it in range(20):
    loss = -torch.log(model(x)).mean()
    print(f"iter {it}: loss {loss.item():.4f}, time 3.21ms", flush=True)
    if torch.isnan(loss):
        raise ValueError(f"loss is nan at iter {it}")
    opt.zero_grad()
    loss.backward()
    opt.step()
