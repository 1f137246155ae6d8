# A CPU build of torch asked for CUDA: the environment's torch, not the script, is wrong.
import torch

print("moving the model to the GPU", flush=True)
x = torch.zeros(1).cuda()
