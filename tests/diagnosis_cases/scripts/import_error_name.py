# A misspelt name imported from an installed module.
print("importing the data helpers", flush=True)
from json import load_datasett  # noqa: E402,F401
