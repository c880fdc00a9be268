import torch, collections, sys
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM, AutoTokenizer
from molt_agents.tiny import tiny_model
from molt_agents.chat_template import render_text
from molt_train.reward_model import RewardModel
ck = sys.argv[1]
tok = AutoTokenizer.from_pretrained(ck); m = AutoModelForCausalLM.from_pretrained(ck).eval()
rm = RewardModel(str(tiny_model("reward")))
torch.manual_seed(0)
replies = collections.Counter(); convs = []
for d in range(10):
    msgs = [{"role": "user", "content": f"Repeat the digit {d}."}]
    ids = tok(render_text(tok, msgs), return_tensors="pt", add_special_tokens=False)
    out = m.generate(**ids, do_sample=True, max_new_tokens=16, num_return_sequences=8, pad_token_id=tok.pad_token_id)
    for o in out:
        r = tok.decode(o[ids["input_ids"].shape[1]:], skip_special_tokens=True)
        convs.append((d, r, msgs + [{"role": "assistant", "content": r}]))
scores = rm.score([c for *_, c in convs])
for (d, r, _), s in list(zip(convs, scores))[:40]:
    print(d, repr(r), round(s, 2))
