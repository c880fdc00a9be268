"""Play N episodes of an env with a model dir on HF (sampling at T=1), report the env facts' means and reward."""
import sys, time, importlib, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from molt_agents.chat_template import render_text
from molt_env.spaces import as_messages
model_dir, spec, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
mod, cls = spec.split(":"); Env = getattr(importlib.import_module(mod), cls)
tok = AutoTokenizer.from_pretrained(model_dir); model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
torch.manual_seed(0); torch.set_num_threads(1)
sums, R, examples = {}, 0.0, []
t0 = time.time()
for i in range(n):
    env = Env(); obs, _ = env.reset(seed=10_000 + i); msgs = as_messages(obs); info = {}
    for turn in range(env.max_turns or 3):
        text = render_text(tok, msgs, env.tools)
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        out = model.generate(ids, max_new_tokens=32, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
        reply = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        obs, r, term, trunc, info = env.step(reply)
        if i < 4: examples.append(repr(reply))
        if term or trunc: break
        msgs = msgs + [{"role": "assistant", "content": reply}] + as_messages(obs)
    R += r
    for k, v in info.items():
        if isinstance(v, (int, float, bool)): sums[k] = sums.get(k, 0) + float(v)
print(f"{model_dir} {spec} n={n}: reward {R/n:.3f} " + " ".join(f"{k} {v/n:.3f}" for k, v in sums.items()) + f" ({time.time()-t0:.0f} s)")
print("\n".join(examples[:8]))
