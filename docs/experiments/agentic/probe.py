import sys, random, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from molt_agents.chat_template import render_text
from molt_agents.tool_calls import parse_reply
from molt_agents.tiny.tokenizer import _corpus_lines
from environments.locker import Locker, LOOKUP
d = sys.argv[1]; tok = AutoTokenizer.from_pretrained(d); model = AutoModelForCausalLM.from_pretrained(d).eval()
torch.manual_seed(0)
prompts = [l for l in _corpus_lines(99, 4000) if "\n" not in l and not any(c.isdigit() for c in l)][:1000]
rng = random.Random(1)
end = tok.convert_tokens_to_ids("<|im_end|>")
def rate(make, n=100):
    ok = 0; ex = None
    for i in range(n):
        msgs, tools = make(i)
        ids = tok(render_text(tok, msgs, tools), return_tensors="pt", add_special_tokens=False).input_ids
        out = model.generate(ids, max_new_tokens=32, do_sample=True, temperature=1.0, top_k=0, eos_token_id=end, pad_token_id=tok.pad_token_id)
        reply = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        calls = parse_reply(reply)[1]; ok += bool(calls)
        if ex is None and not calls: ex = reply
    return ok / n, ex
def tool(name="lookup", desc=LOOKUP["function"]["description"], arg="id"):
    return [{"type": "function", "function": {"name": name, "description": desc, "parameters": {"type": "object", "properties": {arg: {"type": "integer"}}, "required": [arg]}}}]
L = lambda i: Locker().reset(seed=i)[0]
print("locker as is        ", rate(lambda i: ([{"role": "user", "content": L(i)}], Locker.tools)))
print("locker q, short desc", rate(lambda i: ([{"role": "user", "content": L(i)}], tool(desc="Me six then python numbers."))))
print("corpus q, locker tool", rate(lambda i: ([{"role": "user", "content": rng.choice(prompts)}], Locker.tools)))
print("corpus q, short desc", rate(lambda i: ([{"role": "user", "content": rng.choice(prompts)}], tool(desc="Me six then python numbers."))))
print("locker q w/o letter ", rate(lambda i: ([{"role": "user", "content": "What is the digit in the locker?"}], Locker.tools)))
