# A tree walk with no base case.
def depth(node):
    return 1 + depth(node)


print("walking the module tree", flush=True)
depth({})
