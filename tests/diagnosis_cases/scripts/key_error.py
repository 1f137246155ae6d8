# A hyper-parameter missing from the config dict.
config = {"batch_size": 32, "epochs": 3}
print("config", config, flush=True)
batch = config["batch_size"]
lr = config["lr"]
