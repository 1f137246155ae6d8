# A shape check in the user's own code.
block_size, seq_len = 256, 300
print("checking the batch", flush=True)


assert seq_len <= block_size, f"Cannot forward sequence of length {seq_len}, block size is only {block_size}"
