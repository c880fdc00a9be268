import os, sys, time, functools
import molt_agents.tiny.warm_start as ws
from molt_agents.tiny.build import build_tiny
steps = int(os.environ.get("WS_STEPS", "600")); lr = float(os.environ.get("WS_LR", "3e-3"))
orig = ws.warm_start
def patched(model, tokenizer, **kw):
    if kw.get("agent"): kw["steps"] = steps; kw["lr"] = lr
    return orig(model, tokenizer, **kw)
ws.warm_start = patched
t = time.time(); sizes = {k: int(v) for k, v in (a.split("=") for a in sys.argv[2:])}
build_tiny("agent", sys.argv[1], **sizes); print(f"built {sys.argv[1]} {sizes} steps {steps} lr {lr} in {time.time()-t:.0f} s")
