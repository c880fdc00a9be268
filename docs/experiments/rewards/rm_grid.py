import time, tempfile, torch, sys
torch.set_num_threads(1)
from transformers import AutoModelForSequenceClassification, AutoTokenizer
import molt_agents.tiny.reward as R
from molt_agents.tiny.build import build_tiny
steps = int(sys.argv[1]); lr = float(sys.argv[2])
orig = R.train_reward
R.train_reward = lambda model, tokenizer, seed=0: orig(model, tokenizer, steps=steps, lr=lr, seed=seed)
import molt_agents.tiny.build as B
t=time.time(); d=build_tiny("reward", tempfile.mkdtemp()); print("build", round(time.time()-t), "s")
tok=AutoTokenizer.from_pretrained(d); m=AutoModelForSequenceClassification.from_pretrained(d)
convs=[R.conversation(a,str(r)) for a in range(10) for r in range(10)]
texts=[tok.apply_chat_template(c, tokenize=False) for c in convs]
with torch.no_grad(): s=m(**tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)).logits[:,0].view(10,10)
off = s[~torch.eye(10, dtype=bool)]
print("diag min %.2f, off-diagonal max %.2f, off > 0: %d of 90, off > -2: %d" % (s.diag().min(), off.max(), (off>0).sum(), (off>-2).sum()))
