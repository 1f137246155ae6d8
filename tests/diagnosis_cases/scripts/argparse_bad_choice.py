# An argument value argparse refuses.
import argparse

p = argparse.ArgumentParser()
p.add_argument("--optim", choices=["sgd", "adam", "adamw"], default="adamw")
args = p.parse_args()
print(args)
