# nanoGPT's train.py, cut to its configuration: defaults, then configurator.py exec'd, which execs
# the config file named on the command line.
out_dir = "out"
eval_interval = 2000
batch_size = 12
block_size = 1024
learning_rate = 6e-4
max_iters = 600000
device = "cuda"
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))]
exec(open("configurator.py").read())  # overrides from command line or config file
config = {k: globals()[k] for k in config_keys}
print("training with", config, flush=True)
