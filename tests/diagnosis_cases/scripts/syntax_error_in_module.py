# The script is fine; a module it imports does not compile.
print("building the model", flush=True)
import model  # noqa: E402

print(model.build(64))
