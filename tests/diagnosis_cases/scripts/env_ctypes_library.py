# A library a package loads at import: the CUDA runtime the environment lacks.
import ctypes

print("loading the CUDA runtime", flush=True)
ctypes.CDLL("libcudart.so.99")
