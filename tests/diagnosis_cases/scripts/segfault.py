# A native extension dereferencing NULL.
import ctypes

print("calling the extension", flush=True)
ctypes.string_at(0)
