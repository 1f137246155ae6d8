# A required argument left out of the command.
import argparse

p = argparse.ArgumentParser(description="train a model")
p.add_argument("--data", required=True, help="the training data")
p.add_argument("--epochs", type=int, default=3)
args = p.parse_args()
print(args)
