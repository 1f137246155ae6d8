print("never printed: the interpreter cannot be run")
