# A shape bug in the user's model: the traceback ends deep inside torch, the bug is here.
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(128, 10)  # should take 64

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def train_step(model, batch):
    return model(batch).sum()


print("step 0", flush=True)
train_step(Net(), torch.randn(8, 32))
