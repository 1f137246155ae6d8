# A JSON config with a trailing comma.
import argparse
import json

p = argparse.ArgumentParser()
p.add_argument("--config")
args = p.parse_args()
with open(args.config) as f:
    config = json.load(f)
print(config)
