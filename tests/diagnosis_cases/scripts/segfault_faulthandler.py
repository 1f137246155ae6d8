# The same crash with faulthandler on (PYTHONFAULTHANDLER=1): Python prints where it happened.
import ctypes
import faulthandler

faulthandler.enable()


def decode(ptr):
    return ctypes.string_at(ptr)


print("calling the extension", flush=True)
decode(0)
